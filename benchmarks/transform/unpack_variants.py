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
``--calls`` calls), the wall time of a whole ``layout.unpack`` call, waited for, and with ``--procs``
N the KV GB/s of N processes unpacking at once (as a fetch's decode workers share the GPU), and its values against the torch path's (``layout.unpack`` without the kernel)
in units of the KV dtype's spacing, as ``tests/codec/test_fused_unpack.py`` measures them, and
whether they equal the shipped settings' bit for bit. One JSON line per combination.

    python -m benchmarks.transform.unpack_variants --kvsrc .bench/kvsrc.pt --out $OUT/unpack_variants.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
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


COMBOS = list(itertools.product(("ieee", "tf32x3", "tf32"), ("row", "col"), (False, True), (4, 8)))


def _setup(kvsrc: str, preset: str, dtype: torch.dtype = torch.float16):
    """(unpack, torch path's values, chunk bytes) for one packed chunk on this process's GPU."""
    kvs, kv_desc = kvsource.gpu_chunks(kvsrc, 1)
    kv = kvs[0].to(dtype)
    standin.ensure(FP, tuple(kv.shape))
    params = presets.get(preset, FP).layout
    pk = layout.pack(kv, params, START)
    out = torch.empty_like(kv)

    def unpack() -> torch.Tensor:
        return layout.unpack(pk.frames, pk.side, tuple(kv.shape), kv.dtype, params, out=out, start=START)

    os.environ["KVFETCHER_FUSED_UNPACK"] = "0"
    torch_path = unpack().clone()
    os.environ["KVFETCHER_FUSED_UNPACK"] = "1"
    return unpack, torch_path, kv.numel() * 2, kv_desc


_ROW_MAJOR = basis.on_device


def _column_major(name: str, device: str):
    enc, dec, mean = _ROW_MAJOR(name, device)
    return enc, dec.mT.contiguous().mT, mean


def _use(precision: str, dec: str, hoist: bool, warps: int) -> None:
    fused_unpack.DOT_PRECISION, fused_unpack.HOIST_BASIS, fused_unpack.BASIS_WARPS = precision, hoist, warps
    basis.on_device = _ROW_MAJOR if dec == "row" else _column_major


def _wall_ms(fn, calls: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e3


def _proc(kvsrc: str, preset: str, combo, calls: int, barrier, out, dtype) -> None:
    _use(*combo)
    unpack, _, nbytes, _ = _setup(kvsrc, preset, dtype)
    for _ in range(3):
        unpack()
    torch.cuda.synchronize()
    barrier.wait()
    t = time.perf_counter()
    for _ in range(calls):
        unpack()
        torch.cuda.synchronize()
    out.put((time.perf_counter() - t, nbytes * calls))


def procs_rate(kvsrc: str, preset: str, combo, procs: int, calls: int, dtype: torch.dtype) -> float:
    """KV GB/s of ``procs`` processes each unpacking ``calls`` chunks at once, waiting for each."""
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_proc, args=(kvsrc, preset, combo, calls, barrier, out, dtype)) for _ in range(procs)]
    for p in ps:
        p.start()
    got = [out.get(timeout=600) for _ in ps]
    for p in ps:
        p.join()
    return sum(n for _, n in got) / max(s for s, _ in got) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvsrc", default=".bench/kvsrc.pt")
    ap.add_argument("--preset", default="transform-ans")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="combinations precision/dec/hoist/warps, comma-separated (e.g. ieee/row/0/8)")
    ap.add_argument("--procs", type=int, default=0, help="also the rate of this many processes at once")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--out")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    combos = COMBOS
    if args.only:
        combos = [(p, d, h == "1", int(w)) for p, d, h, w in (c.split("/") for c in args.only.split(","))]
    _use("ieee", "row", False, 8)
    unpack, torch_path, nbytes, kv_desc = _setup(args.kvsrc, args.preset, dtype)
    shipped = unpack().clone()
    rows = []
    for combo in combos:
        _use(*combo)
        got = unpack().clone()  # compiles
        ms = statistics.median(_kernel_ms(unpack, args.calls) for _ in range(args.repeats))
        ulps, frac = _spacing_diff(torch_path, got)
        row = dict(zip(("precision", "dec", "hoist", "warps"), combo), unpack_gpu_ms=round(ms, 4),
                   unpack_wall_ms=round(_wall_ms(unpack, args.calls), 4), ulps_vs_torch=round(ulps, 3),
                   frac_differing_vs_torch=frac, equal_to_shipped=bool(torch.equal(got, shipped)))
        if args.procs:
            row[f"GB_s_{args.procs}_procs"] = round(procs_rate(args.kvsrc, args.preset, combo, args.procs, args.calls, dtype), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    basis.on_device = _ROW_MAJOR
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "kv": kv_desc, "preset": args.preset,
              "chunk_bytes": nbytes, "dtype": args.dtype, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
