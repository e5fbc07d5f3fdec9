"""The store-time encode with the pack replayed from a CUDA graph (``codec/graphs``) or launched op by op.

One Llama-3-8B-shaped chunk of real KV (``--kvsrc``) and the stand-in calibration, as
``encode_steps``; ``KVFETCHER_ENCODE_GRAPHS`` switched between the two ways. Side by side in one run:

* the pack's GPU ops by their own GPU time (which ops to cut next);
* ms per pack and per ``encode_chunk``, back to back in one thread, both ways;
* the GPU memory a graph of this chunk holds (what its capture added to the memory torch reserves);
* the whole encode (``chunk.encode_chunk``: pack, nvCOMP, the object) in 1-8 threads at once, GB/s
  of KV over ``--seconds`` each, both ways;
* the objects of both ways must be byte for byte the same;
* with ``--busy N``: N threads encoding with graphs under the profiler, what the GPU did: the share
  of the wall some kernel or copy ran, and GPU ms a chunk by kernel (against one thread's), which
  says whether the GPU or the host holds the threads back.

    python -m benchmarks.transform.pack_graph --kvsrc .bench/kvsrc.pt --out $OUT/pack_graph.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.lib import kvsource, standin, timing
from kvfetcher import chunk
from kvfetcher.codec import graphs, layout
from kvfetcher.format import container, presets

FP = "transform-bench/8b"
WAYS = {"eager": "0", "graph": "8"}  # KVFETCHER_ENCODE_GRAPHS: graphs allowed
THETA = kvsource.LLAMA3_THETA


def ops(fn, n: int = 25) -> list[list]:
    """The GPU ops of one ``fn`` call by own GPU time: [name, calls, ms]."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.count, e.self_device_time_total / 1e3) for e in prof.key_averages() if e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    return [[k[:70], c, round(t, 4)] for k, c, t in rows[:n]]


def pack_ms(fn, n: int = 30) -> float:
    """ms a call of ``fn``, ``n`` back to back in this thread (the GPU's time where that is the wall)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) / n * 1e3, 3)


def busy(threads: int, one, calls: int = 12) -> dict:
    """``threads`` threads each encoding ``calls`` chunks under the profiler: chunks/s, the share of
    the wall in which the GPU ran a kernel or copy, and GPU ms a chunk by op (top 8)."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(threads):  # warm: every thread's stream, coder and plans made
        one(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = timing.threads_s(threads, lambda i: [one(i) for _ in range(calls)])
    evs = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    union, end, by = 0.0, float("-inf"), {}
    for a, b, name in evs:
        union += max(0.0, b - max(a, end))
        end = max(end, b)
        by[name[:60]] = by.get(name[:60], 0.0) + (b - a) / 1e3
    n = threads * calls
    span = (evs[-1][1] - evs[0][0]) if evs else 1.0
    return {"threads": threads, "chunks_per_s": round(n / wall, 1), "gpu_busy": round(union / span, 3),
            "gpu_ms_per_chunk": round(sum(by.values()) / n, 3),
            "top_ms_per_chunk": [[k, round(v / n, 4)] for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:8]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvsrc", default=".bench/kvsrc.pt")
    ap.add_argument("--preset", default="transform-ans")
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--busy", default="", help="thread counts for the profiled run, e.g. 1,8")
    ap.add_argument("--out")
    args = ap.parse_args()
    kvs, kv_desc = kvsource.gpu_chunks(args.kvsrc, 2)
    standin.ensure(FP, tuple(kvs[0].shape))
    kv, start = kvs[1], kvs[0].shape[3]
    p = presets.get(args.preset, FP)
    ref = chunk.encode_chunk(kv, p, FP, start=start, rope_theta=THETA)
    lp = container.parse_header(ref).layout
    gb = kv.numel() * kv.element_size() / 1e9
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "kv": kv_desc,
              "chunk_shape": list(kv.shape), "preset": args.preset, "kv_GB": round(gb, 4),
              "pack_ops": ops(lambda: layout.pack(kv, lp, start))}
    print(json.dumps(result["pack_ops"], indent=0), flush=True)
    one = lambda i: chunk.encode_chunk(kv, p, FP, start=start, rope_theta=THETA)  # noqa: E731
    os.environ["KVFETCHER_ENCODE_GRAPHS"] = WAYS["graph"]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    objs = [one(0)]  # the chunk's kind was seen by ``ref``: this one is captured
    torch.cuda.empty_cache()  # what is left reserved is the graph's
    result["graph_MB"] = round((torch.cuda.memory_reserved() - before) / 1e6, 1)
    ms = {}
    for way, flag in WAYS.items():
        os.environ["KVFETCHER_ENCODE_GRAPHS"] = flag
        objs += [one(0) for _ in range(2)]

        def pack():
            with graphs.packed(kv, lp, start):
                pass

        ms[way] = {"pack": pack_ms(pack), "encode_chunk": pack_ms(lambda: one(0), 20)}
    result["ms"] = ms
    result["same_object"] = all(o == ref for o in objs)
    print(json.dumps({"ms": ms, "same": result["same_object"], "graph_MB": result["graph_MB"]}), flush=True)
    threads = [int(n) for n in args.threads.split(",") if n]
    rows = []
    for n in threads:
        row = {"threads": n}
        for way, flag in WAYS.items():
            os.environ["KVFETCHER_ENCODE_GRAPHS"] = flag
            row[f"{way}_GB_s"] = round(timing.calls_per_s(n, one, args.seconds) * gb, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result["rows"] = rows
    os.environ["KVFETCHER_ENCODE_GRAPHS"] = WAYS["graph"]
    result["busy"] = [busy(int(n), one) for n in args.busy.split(",") if n]
    for b in result["busy"]:
        print(json.dumps(b), flush=True)
    if not result["same_object"]:
        print("OBJECTS DIFFER")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
