"""Screen ad-hoc layout points on the harness's caches (what compression_bench runs per point).

Each argument is a Python expression building a Preset; ``pt(name, scale, bas=BASIS,
profile=None, sink=False)`` is balanced's family: sigma steps ``profile`` (default the v3 base
profile) times ``scale``, in basis ``bas`` (None: per-channel), exact first token only at
position 0 with ``sink``. ``SB`` is the basis sensitivity table. Prints ratio, greedy agreement,
NLL increase and KL per point (the runs behind research/results/basis_screening.txt).

    python -m research.screen_points all 'pt("basis x0.7", 0.7)' \\
        'pt("t", 1.0, profile=presets.sigma_steps(0.0024, lo=0.03, hi=2.0, table=SB), sink=True)'
"""

from __future__ import annotations

import sys
import time

import torch

from benchmarks.compression import compression_bench as cb
from kvfetcher.codec import layout
from kvfetcher.eval import model
from kvfetcher.format import presets
from kvfetcher.codec.base import CodecParams
from kvfetcher.format.presets import Preset
from kvfetcher.format import calibration

BASIS = calibration.default().basis
SB = calibration.default().table("basis")


def pt(name: str, scale: float, bas: str | None = BASIS, profile=None, sink: bool = False) -> Preset:
    steps = presets.scaled(profile or presets.sigma_steps(0.003, table=calibration.default().table("channel")), scale)
    return Preset(name, layout.LayoutParams(mode="quant", sigma_steps=steps, basis=bas),
                  CodecParams(lossless=True, speed="ultrafast"), False, name, pre_rope=True, sink_exact_only=sink)


def main() -> int:
    torch.set_num_threads(1)  # on shared cores, more threads than free cores is far slower
    lm = model.load()
    theta = model.rope_theta(lm)
    cases = cb.load_cases(lm, "/tmp/kv.pt")
    if sys.argv[1] != "all":
        cases = [cases[int(i)] for i in sys.argv[1].split(",")]
    for spec in sys.argv[2:]:
        p = eval(spec)  # noqa: S307 - a developer's own command line
        t = time.time()
        r = cb.run_preset(lm, cases, p, theta)
        print(f"{p.name}: ratio {r['ratio_vs_fp16']:.3f} agree {r['greedy_agreement']:.3f} nll {100 * r['nll_increase']:+.3f}% "
              f"kl {r['kl']:.5f} per {[round(x['greedy_agreement'], 2) for x in r['per_prompt']]} ({time.time() - t:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
