"""What the writer adds to the encode, step by step: N threads encoding distinct chunks, GB/s of KV.

Each row adds one thing the writer (``save.Writer``) does per chunk to the one before, in the same
process, threads looping for ``--seconds`` over ``--chunks`` distinct chunks of an 8B model's KV
(real KV tiled with ``--kvsrc``; the stand-in calibration, as ``store_bench``):

* ``gpu_chunks``: ``encode_chunk`` of chunks already on the GPU (what ``transform/pack_graph`` times,
  there on one chunk);
* ``host_views``: the writer's ``_encode`` of views of a job's host copy (its upload through
  page-locked staging first);
* ``host_views_nice``: the same in threads of the writer's lowered priority (``ENCODE_NICE``).

The writer itself on the same KV is ``store_bench``'s ``write_GB_s``.

    python -m benchmarks.store_rate.writer_steps --kvsrc .bench/kvsrc.pt --threads 2,4 --out $OUT/writer_steps.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch

from benchmarks.lib import standin, timing
from benchmarks.store_rate.store_bench import FP, prompt_kv
from kvfetcher import chunk
from kvfetcher.eval.costmodel import SHAPES
from kvfetcher.format import presets
from kvfetcher.save import writer

T = 256


def steps(host: torch.Tensor, preset, theta: float) -> dict:
    """The rows' per-call functions ``one(i)``: each call encodes the next chunk of ``host``."""
    n = host.shape[3] // T
    views = [host[:, :, :, i * T : (i + 1) * T] for i in range(n)]
    on_gpu = [v.contiguous().cuda() for v in views]
    turn, lock, niced = [0], threading.Lock(), threading.local()

    def nxt() -> int:
        with lock:
            turn[0] += 1
            return turn[0] % n

    def gpu_chunks(_: int) -> bytes:
        i = nxt()
        return chunk.encode_chunk(on_gpu[i], preset, FP, {"parent": ""}, start=i * T, rope_theta=theta)

    def host_views(_: int) -> bytes:
        i = nxt()
        return writer._encode(views[i], "cuda", preset, FP, {"parent": ""}, start=i * T, rope_theta=theta)

    def host_views_nice(k: int) -> bytes:
        if not getattr(niced, "done", False):
            writer._lower_priority()
            niced.done = True
        return host_views(k)

    return {"gpu_chunks": gpu_chunks, "host_views": host_views, "host_views_nice": host_views_nice}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvsrc", help="real KV to tile (benchmarks.lib.kvsource); default synthetic")
    ap.add_argument("--preset", default="transform-ans")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--threads", default="2,4")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2, help="each row timed this many times, rows alternated")
    ap.add_argument("--out")
    args = ap.parse_args()
    shape = SHAPES["llama3-8b"]
    standin.ensure(FP, (shape.layers, 2, shape.kv_heads, T, shape.head_dim))
    host = prompt_kv(shape, args.chunks, T, args.kvsrc, "cpu")
    p = presets.get(args.preset, FP)
    fns = steps(host, p, shape.rope_theta)
    gb = host.numel() * host.element_size() / (host.shape[3] // T) / 1e9
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "preset": args.preset,
              "kv": "real, tiled" if args.kvsrc else "synthetic", "chunk_GB": round(gb, 4), "rows": []}
    for n in [int(x) for x in args.threads.split(",") if x]:
        for r in range(args.rounds):
            row = {"threads": n, "round": r}
            for name, one in fns.items():
                row[f"{name}_GB_s"] = round(timing.calls_per_s(n, one, args.seconds) * gb, 2)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
