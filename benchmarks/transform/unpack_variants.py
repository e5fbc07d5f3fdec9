"""The fused unpack kernel's settings on a GPU: its time a chunk and how its values differ.

One Llama-3-8B-shaped chunk (``transform_bench``'s: real KV tiled from SmolLM2 with ``--kvsrc``, a
stand-in calibration with a random orthogonal basis) is packed with ``transform-ans``'s layout,
then unpacked with every combination of ``fused_unpack``'s settings:

* ``precision``: the basis' matrix products in float32 FMAs (``ieee``), three TF32 tensor-core
  products (``tf32x3``) or one (``tf32``);
* ``dec``: the basis' inverse stored row-major (as shipped) or column-major (coalesced loads);
* ``hoist``: its four blocks loaded once per program, or once per block of tokens;
* ``warps`` per program.

Per combination: the kernel's GPU time a chunk (torch's profiler, median of ``--repeats`` runs of
``--calls`` calls), and its values against the torch path's (``layout.unpack`` without the kernel)
in units of the KV dtype's spacing, as ``tests/codec/test_fused_unpack.py`` measures them, and
whether they equal the shipped settings' bit for bit. One JSON line per combination.

    python -m benchmarks.transform.unpack_variants --kvsrc .bench/kvsrc.pt --out $OUT/unpack_variants.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.lib import kvsource, standin
from kvfetcher.codec import basis, fused_unpack, layout
from kvfetcher.format import presets

FP = "transform-bench/8b"
START = 256  # a chunk past the prefix's first: no exact sink token


def _kernel_ms(fn, calls: int) -> float:
    """GPU time of ``_unpack_kernel`` a call over ``calls`` calls of ``fn``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us = sum(e.self_device_time_total for e in prof.key_averages() if "_unpack_kernel" in e.key)
    return us / calls / 1e3


def _spacing_diff(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """Largest difference in units of the dtype's spacing (at the value, or at the mean magnitude
    near zero) and the fraction of values that differ."""
    a, b = ref.float(), got.float()
    spacing = torch.finfo(ref.dtype).eps * torch.maximum(a.abs(), a.abs().mean())
    return float(((a - b).abs() / spacing).max()), float((a != b).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvsrc", default=".bench/kvsrc.pt")
    ap.add_argument("--preset", default="transform-ans")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    kvs, kv_desc = kvsource.gpu_chunks(args.kvsrc, 1)
    kv = kvs[0].to(torch.float16)
    standin.ensure(FP, tuple(kv.shape))
    params = presets.get(args.preset, FP).layout
    pk = layout.pack(kv, params, START)
    shape = tuple(kv.shape)
    out = torch.empty_like(kv)

    def unpack() -> torch.Tensor:
        return layout.unpack(pk.frames, pk.side, shape, kv.dtype, params, out=out, start=START)

    os.environ["KVFETCHER_FUSED_UNPACK"] = "0"
    torch_path = unpack().clone()
    os.environ["KVFETCHER_FUSED_UNPACK"] = "1"
    shipped = unpack().clone()
    row_major = basis.on_device

    def column_major(name: str, device: str):
        enc, dec, mean = row_major(name, device)
        return enc, dec.mT.contiguous().mT, mean

    rows = []
    for precision, dec, hoist, warps in itertools.product(("ieee", "tf32x3", "tf32"), ("row", "col"), (False, True), (4, 8)):
        fused_unpack.DOT_PRECISION, fused_unpack.HOIST_BASIS, fused_unpack.BASIS_WARPS = precision, hoist, warps
        basis.on_device = row_major if dec == "row" else column_major
        got = unpack().clone()  # compiles
        ms = statistics.median(_kernel_ms(unpack, args.calls) for _ in range(args.repeats))
        ulps, frac = _spacing_diff(torch_path, got)
        row = {"precision": precision, "dec": dec, "hoist": hoist, "warps": warps, "unpack_gpu_ms": round(ms, 4),
               "ulps_vs_torch": round(ulps, 3), "frac_differing_vs_torch": frac, "equal_to_shipped": bool(torch.equal(got, shipped))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    basis.on_device = row_major
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "kv": kv_desc, "preset": args.preset,
              "chunk_shape": list(shape), "dtype": "float16", "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
