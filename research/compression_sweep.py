"""First points of the size-accuracy curve beyond q8 (research toward issue 6's presets).

Each point is a layout + codec setting run through the accuracy harness over the shipped
prompts: ratio vs fp16 (all overheads counted), greedy agreement, NLL increase.

    python -m research.compression_sweep [--points q6,q5,q8qp12]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from kvfetcher.eval import accuracy
from kvfetcher.codec.base import CodecParams
from kvfetcher.codec.layout import LayoutParams
from kvfetcher.format.presets import Preset

POINTS = {
    "q7": Preset("q7", LayoutParams(mode="quant", bits=7), CodecParams(lossless=True), False, "7-bit, lossless HEVC"),
    "q6": Preset("q6", LayoutParams(mode="quant", bits=6), CodecParams(lossless=True), False, "6-bit, lossless HEVC"),
    "q5": Preset("q5", LayoutParams(mode="quant", bits=5), CodecParams(lossless=True), False, "5-bit, lossless HEVC"),
    "q8qp12": Preset("q8qp12", LayoutParams(mode="quant"), CodecParams(lossless=False, qp=12), False, "8-bit, HEVC QP 12"),
    "q8qp20": Preset("q8qp20", LayoutParams(mode="quant"), CodecParams(lossless=False, qp=20), False, "8-bit, HEVC QP 20"),
    "k8v6": Preset("k8v6", LayoutParams(mode="quant", bits_map=((8, 6),) * 30), CodecParams(lossless=True), False, "keys 8-bit, values 6-bit"),
    "k8v5": Preset("k8v5", LayoutParams(mode="quant", bits_map=((8, 5),) * 30), CodecParams(lossless=True), False, "keys 8-bit, values 5-bit"),
    "k8v4": Preset("k8v4", LayoutParams(mode="quant", bits_map=((8, 4),) * 30), CodecParams(lossless=True), False, "keys 8-bit, values 4-bit"),
    "k7v5": Preset("k7v5", LayoutParams(mode="quant", bits_map=((7, 5),) * 30), CodecParams(lossless=True), False, "keys 7-bit, values 5-bit"),
    "k5v5r": Preset("k5v5r", LayoutParams(mode="quant", kv_bits=(5, 5)), CodecParams(lossless=True), False, "keys 5-bit pre-RoPE, values 5-bit", pre_rope=True),
    "k6v6r": Preset("k6v6r", LayoutParams(mode="quant", kv_bits=(6, 6)), CodecParams(lossless=True), False, "keys 6-bit pre-RoPE, values 6-bit", pre_rope=True),
    "k6v8": Preset("k6v8", LayoutParams(mode="quant", bits_map=((6, 8),) * 30), CodecParams(lossless=True), False, "keys 6-bit, values 8-bit"),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default=",".join(POINTS))
    ap.add_argument("--out", default=str(ROOT / "research" / "results" / "compression_sweep.json"))
    args = ap.parse_args()
    out = {"date": datetime.date.today().isoformat(), "device": "CPU (2 shared cores)", "prompts": len(accuracy.PROMPTS), "tokens": 512, "points": {}}
    if Path(args.out).exists():  # extend earlier points rather than forget them
        out["points"] = json.loads(Path(args.out).read_text())["points"]
    for name in args.points.split(","):
        p = POINTS[name]
        t = time.perf_counter()
        s = accuracy.evaluate(p, tokens=512).summary()
        s.pop("per_prompt")
        s["summary"], s["wall_s"] = p.summary, time.perf_counter() - t
        out["points"][name] = s
        print(f"{name}: ratio {s['ratio_vs_fp16']:.2f} agreement {s['greedy_agreement']:.3f} nll {100 * s['nll_increase']:+.3f}%", flush=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
