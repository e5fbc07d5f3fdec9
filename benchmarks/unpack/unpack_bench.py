"""unpack_bench: the GPU time one chunk's restore takes from the model, torch path vs fused kernel.

A decode worker restores a chunk in two steps: NVDEC decodes the frames (a separate engine), then
``layout.unpack`` turns samples into KV in the model's buffer, on the GPU's SMs and memory —
what a model decoding beside it feels. This times that second step per chunk, both ways, side by
side in one run: wall time (CUDA events, median), and the summed duration and number of the GPU
kernels it launched (torch profiler), on real KV:

* ``8b``: Llama-3-8B-shaped chunks tiled from real SmolLM2 KV (benchmarks/lib/kvsource.py; no basis fits);
* ``smol``: SmolLM2-135M's own KV at its shape, where ``balanced``/``compact`` use the shipped basis.

The frames are decoded once (NVDEC on a GPU) and reused, so only the unpack is timed. Writes JSON
and a Markdown table to ``--out`` (a path stem). Both paths' outputs are compared as well.

    python -m benchmarks.unpack.unpack_bench --kvsrc .kvsrc/kvsrc.pt --out benchmarks/unpack/result_h100
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.lib import kvsource

from kvfetcher import codec
from kvfetcher.format import container
from kvfetcher.codec import fused_unpack, layout, rope
from benchmarks.lib.standin import encode_chunk  # a stand-in calibration for random-weight shapes

SMOL_FINGERPRINT = "smollm2-135m-instruct-q4_1/float32"  # the shipped basis' model: balanced/compact use it


def chunks(kvsrc: str) -> dict[str, tuple[torch.Tensor, str, float, int]]:
    """name -> (chunk [L, 2, H, 256, D] bf16, fingerprint, rope theta, start position)."""
    src = torch.load(kvsrc)
    smol = src["kv"][0].float().clone()  # [30, 2, 3, 256, 64], keys before RoPE
    cos, sin = rope.rotation(256, smol.shape[3], smol.shape[-1], src["source_theta"])
    smol[:, 0] = rope.apply(smol[:, 0], cos, sin)  # as the model holds them at positions 256..511
    return {"8b": (kvsource.real_chunks(src, 2)[1], "bench", kvsource.LLAMA3_THETA, 256),
            "smol": (smol.to(torch.bfloat16).contiguous(), SMOL_FINGERPRINT, src["source_theta"], 256)}


def frames_of(obj: bytes, device: str) -> tuple[container.Header, torch.Tensor, torch.Tensor | None]:
    h = container.parse_header(obj)
    dec = codec.decoder(h.codec.format, device)
    frames = torch.cat([container.decode_segment(h, s, container.slice_segment(obj, h, s), dec, device) for s in h.segments])
    side = container.side_tensor(h, container.slice_segment(obj, h, h.side)).to(device) if h.side else None
    return h, frames, side


def time_unpack(h: container.Header, frames: torch.Tensor, side, out: torch.Tensor, repeats: int) -> dict:
    """Median wall ms of ``repeats`` unpacks into ``out``, and the GPU kernels of one (on CUDA)."""
    run = lambda: layout.unpack(frames, side, h.shape, h.torch_dtype, h.layout, out=out, start=h.start)  # noqa: E731
    for _ in range(3):
        run()
    ms = []
    for _ in range(repeats):
        if out.is_cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            run()
            ms.append(1e3 * (time.perf_counter() - t))
    res = {"ms": round(statistics.median(ms), 4)}
    if out.is_cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        res |= {"kernels": len(kernels), "kernel_ms": round(sum(e.device_time for e in kernels) / 1e3, 4)}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvsrc", required=True, help="real Smol KV saved by benchmarks/lib/kvsource.py")
    ap.add_argument("--out", required=True, help="path stem for .json and .md")
    ap.add_argument("--presets", default="balanced,compact,q8")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    dev = a.device
    ways = ["torch"] + (["fused"] if dev == "cuda" and fused_unpack.triton is not None else [])
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "triton": getattr(fused_unpack.triton, "__version__", None), "rows": []}
    for shape, (kv, fp, theta, start) in chunks(a.kvsrc).items():
        for preset in a.presets.split(","):
            obj = encode_chunk(kv, preset, fp, start=start, rope_theta=theta)
            h, frames, side = frames_of(obj, dev)
            kv_bytes = kv.numel() * kv.element_size()
            row = {"shape": shape, "preset": preset, "kv_MB": round(kv_bytes / 1e6, 2), "basis": h.layout.basis}
            outs = {}
            for way in ways:
                os.environ["KVFETCHER_FUSED_UNPACK"] = "1" if way == "fused" else "0"
                out = torch.full(tuple(kv.shape), float("nan"), dtype=kv.dtype, device=dev)
                r = time_unpack(h, frames, side, out, a.repeats)
                r["GB_s"] = round(kv_bytes / r["ms"] / 1e6, 1)
                row[way] = r
                outs[way] = out.float()
            if len(outs) == 2:
                d = (outs["torch"] - outs["fused"]).abs()
                row["max_abs_diff"] = float(d.max())
                row["frac_differ"] = float((d > 0).float().mean())
                row["kernel_time_ratio"] = round(row["torch"]["kernel_ms"] / row["fused"]["kernel_ms"], 1)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    os.environ.pop("KVFETCHER_FUSED_UNPACK", None)
    Path(a.out + ".json").write_text(json.dumps(res, indent=1))
    md = [f"# Unpack per chunk: torch path vs fused kernel ({res['device']}, {res['date']})", "",
          "Produced by `benchmarks/unpack/unpack_bench.py` (what it times: its docstring). One 256-token chunk of real KV, "
          "frames decoded once and reused; wall time is the median of CUDA-event timings, kernel time the summed "
          "duration of the GPU kernels one unpack launched.", "",
          "| shape | preset | basis | KV MB | " + " | ".join(f"{w} ms | {w} GB/s | {w} kernels | {w} kernel ms" for w in ways) + " |",
          "|---|---|---|---|" + "---|---|---|---|" * len(ways)]
    for r in res["rows"]:
        cells = " | ".join(f"{r[w]['ms']} | {r[w]['GB_s']} | {r[w].get('kernels', '—')} | {r[w].get('kernel_ms', '—')}" for w in ways)
        md.append(f"| {r['shape']} | {r['preset']} | {'yes' if r['basis'] else 'no'} | {r['kv_MB']} | {cells} |")
    Path(a.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
