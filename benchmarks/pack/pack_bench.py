"""pack_bench: the store path's GPU encode per chunk, trellis search in torch vs the Triton kernel.

``balanced`` and ``compact`` quantise with a trellis (codec/trellis.py) whose Viterbi search steps
all components one token at a time in torch; codec/trellis_kernel.py runs each component's whole
search in one kernel. This times, per chunk of real KV, both ways in one run:

* ``layout.pack`` alone: wall time (CUDA events, median), the number and summed duration of the
  GPU kernels one pack launched (torch profiler), and the kernels that took the most of it;
* ``chunk.encode_chunk`` end to end for the ``<preset>-ans`` variant (pack, nvCOMP ANS on the GPU,
  the coded bytes to the host, the container), where nvCOMP is installed;

on ``8b`` (Llama-3-8B-shaped chunks tiled from real SmolLM2 KV; no basis fits) and ``smol``
(SmolLM2's own KV, where the presets use the shipped basis and sparse corrections). Both ways'
planes and side information are compared byte for byte. Rates are GB/s of the chunk's KV
(bf16). Writes JSON and a Markdown table to ``--out`` (a path stem).

    python -m benchmarks.pack.pack_bench --kvsrc kvsrc.pt --out benchmarks/pack/result_h100
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.unpack.unpack_bench import chunks
from kvfetcher import chunk
from kvfetcher.codec import layout, nvcomp, trellis_kernel
from kvfetcher.format import container, presets

WAYS = ("torch", "kernel")


def timed(fn, repeats: int) -> float:
    """Median wall ms of ``repeats`` calls (CUDA events around each, after two warm-ups)."""
    fn(), fn()
    ms = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)


def kernels(fn) -> dict:
    """The GPU kernels one call of ``fn`` launched: count, summed ms, the five longest by name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by = collections.Counter()
    for e in evs:
        by[e.name[:60]] += e.device_time / 1e3
    return {"kernels": len(evs), "kernel_ms": round(sum(by.values()), 4),
            "top": [[n, round(ms, 4)] for n, ms in by.most_common(5)]}


def measure(kv: torch.Tensor, preset: str, fp: str, theta: float, start: int, repeats: int) -> dict:
    """One row: pack (and encode) of ``kv`` both ways."""
    p = presets.get(preset, fp)
    obj = chunk.encode_chunk(kv, presets.entropy_variant(p, "zstd"), fp, start=start, rope_theta=theta)
    lp = container.parse_header(obj).layout  # the layout as the encoder applied it (theta, basis dropped or not)
    kv_bytes = kv.numel() * kv.element_size()
    row = {"preset": preset, "kv_MB": round(kv_bytes / 1e6, 2), "basis": lp.basis is not None, "sparse": lp.sparse_tokens}
    packs = {}
    enabled = trellis_kernel.enabled
    for way in WAYS:
        trellis_kernel.enabled = enabled if way == "kernel" else (lambda v: False)
        try:
            n = repeats if way == "kernel" else max(3, repeats // 10)
            ms = timed(lambda: layout.pack(kv, lp, start), n)
            r = {"pack_ms": round(ms, 4), "pack_GB_s": round(kv_bytes / ms / 1e6, 1)} | kernels(lambda: layout.pack(kv, lp, start))
            if nvcomp.available():
                ans = presets.entropy_variant(p, "ans")
                ms = timed(lambda: chunk.encode_chunk(kv, ans, fp, start=start, rope_theta=theta), n)
                r |= {"encode_ans_ms": round(ms, 4), "encode_ans_GB_s": round(kv_bytes / ms / 1e6, 1)}
            packs[way] = layout.pack(kv, lp, start)
            row[way] = r
        finally:
            trellis_kernel.enabled = enabled
    a, b = packs.values()
    row["identical"] = torch.equal(a.frames, b.frames) and torch.equal(a.side.view(torch.uint8), b.side.view(torch.uint8))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvsrc", required=True, help="real Smol KV saved by benchmarks/lib/kvsource.py")
    ap.add_argument("--out", required=True, help="path stem for .json and .md")
    ap.add_argument("--presets", default="balanced,compact,q8")
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    if not torch.cuda.is_available() or trellis_kernel.triton is None:
        raise SystemExit("needs a CUDA GPU and Triton")
    res = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "triton": trellis_kernel.triton.__version__, "nvcomp": nvcomp.available(), "rows": []}
    for shape, (kv, fp, theta, start) in chunks(a.kvsrc).items():
        kv = kv.cuda()
        for preset in a.presets.split(","):
            t = time.perf_counter()
            row = {"shape": shape} | measure(kv, preset, fp, theta, start, a.repeats)
            row["bench_s"] = round(time.perf_counter() - t, 1)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    Path(a.out + ".json").write_text(json.dumps(res, indent=1))
    md = [f"# Pack per chunk: trellis search in torch vs the Triton kernel ({res['device']}, {res['date']})", "",
          "Produced by `benchmarks/pack/pack_bench.py` (what it times: its docstring). One 256-token chunk of real KV on the "
          "GPU; wall ms is the median of CUDA-event timings, kernel ms the summed duration of the GPU kernels one pack "
          "launched; encode is `chunk.encode_chunk` of the `-ans` variant end to end; GB/s of the chunk's bf16 KV.", "",
          "| shape | preset | basis | " + " | ".join(f"{w} pack ms | {w} pack GB/s | {w} kernels | {w} kernel ms | {w} encode-ans GB/s"
                                                for w in WAYS) + " | identical |",
          "|---|---|---|" + "---|---|---|---|---|" * len(WAYS) + "---|"]
    for r in res["rows"]:
        cells = " | ".join(f"{r[w]['pack_ms']} | {r[w]['pack_GB_s']} | {r[w]['kernels']} | {r[w]['kernel_ms']} | "
                           f"{r[w].get('encode_ans_GB_s', '—')}" for w in WAYS)
        md.append(f"| {r['shape']} | {r['preset']} | {'yes' if r['basis'] else 'no'} | {cells} | {r['identical']} |")
    md += ["", "Longest kernels of one pack with the trellis kernel (name, ms):", ""]
    md += [f"- {r['shape']} {r['preset']}: " + "; ".join(f"`{n}` {ms}" for n, ms in r["kernel"]["top"]) for r in res["rows"]]
    Path(a.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
