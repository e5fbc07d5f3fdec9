"""Where a decode worker's time per chunk goes, in one process and in several at once.

A fetch's decode workers are processes sharing one GPU, each restoring one chunk at a time with
``chunk.restore_chunk`` (verify, entropy decode, the components' sort undone, the fused unpack,
written into a KV buffer and waited for). Their rate end to end sits well under what the unpack
kernel alone allows (``unpack_variants.py``): this measures why. Per preset and per number of
processes (``--procs``), every process restores ``--chunks`` chunks (4 distinct Llama-3-8B-shaped
chunks, ``transform_bench``'s KV and stand-in calibration) into a flat buffer or vLLM's cross-layer
paged blocks (``--dests``) on ``--device``, all starting at once; reported per process: ms a chunk (wall), and of it the ms ``restore_chunk`` spent
verifying and decoding and writing (its ``times``). The aggregate KV GB/s. With ``--profile``
the first process of the largest count also runs under cProfile: its host time by function.
``--memory`` says where a process reads the stored chunks from: ``bytes`` (pageable memory of its
own) or ``slab`` (shared memory mapped as a decode worker maps a reader's staging buffer,
``decode_worker._WorkerState.view``: page-locked on a GPU, its parts decoded from in place).

    python -m benchmarks.transform.restore_steps --kvsrc .bench/kvsrc.pt --procs 1,2,4,8 --memory bytes,slab --profile --out $OUT/restore_steps.json
    python -m benchmarks.transform.restore_steps --device cpu --presets transform-zstd --procs 1,2 --chunks 4   # a smoke run
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import math
import multiprocessing
import pstats
import statistics
import time
from pathlib import Path

import torch

from benchmarks.lib import kvsource, standin
from kvfetcher import chunk
from kvfetcher.fetch import decode_worker
from kvfetcher.fetch.slab import Slab
from kvfetcher.format import container
from kvfetcher.kvbuffer import ChunkRef, Destination, PagedDestination, PagedKV, PagedLayout

FP = "transform-bench/8b"
THETA = kvsource.LLAMA3_THETA
DISTINCT = 4
BLOCK = 16  # vLLM's block size


def _objects(kvsrc: str, preset: str, device: str) -> tuple[list[bytes], tuple[int, ...]]:
    if device == "cuda":
        kvs, _ = kvsource.gpu_chunks(kvsrc, DISTINCT)
    else:  # a smoke run: a small synthetic shape
        kvs = [kvsource.synthetic_kv(4, 2, 256, 64, torch.float16, seed=i) for i in range(DISTINCT)]
    standin.ensure(FP, tuple(kvs[0].shape))
    T = kvs[0].shape[3]
    return [chunk.encode_chunk(kv, preset, FP, start=(i + 1) * T, rope_theta=THETA) for i, kv in enumerate(kvs)], tuple(kvs[0].shape)


def _parts(objs: list[bytes], memory: str, state: decode_worker._WorkerState) -> list[tuple]:
    """Each object as a worker gets it: (header parsed, side information, segments in place), in
    ``bytes`` of this process or in a ``slab`` mapped as a worker maps one (``state`` keeps it)."""
    if memory == "bytes":
        places = [(memoryview(o), None, 0) for o in objs]
    else:
        owner = Slab(sum(len(o) for o in objs))  # (the owner's memfd; the process maps it again by path, as a worker)
        mem, host = state.view(owner.path, owner.size)
        starts = [end - len(o) for o, end in zip(objs, itertools.accumulate(len(o) for o in objs))]
        for o, at in zip(objs, starts):
            mem[at : at + len(o)] = o
        places = [(mem, host, at) for at in starts]
    out = []
    for o, (mem, host, at) in zip(objs, places):
        h = container.parse_header(o)
        spans = [(at + h.header_size + s.offset, at + h.header_size + s.offset + s.length) for s in ([h.side] if h.side else []) + list(h.segments)]
        out.append((h, *decode_worker.parts_at(mem, host, spans, h.side is not None)))
    return out


def _destination(kind: str, shape: tuple[int, ...], device: str) -> Destination:
    """A chunk's place: a flat buffer's slots (a view), or vLLM's cross-layer paged blocks
    (``BLTH(KD)``, blocks of 16 tokens, shuffled)."""
    L, _, H, T, D = shape
    if kind == "flat":
        return Destination(torch.empty(shape, dtype=torch.float16, device=device), tokens=T)
    n = 4 * T // BLOCK
    paged = PagedKV(torch.empty((n, L, BLOCK, H, 2 * D), dtype=torch.float16, device=device), PagedLayout("BLTH(KD)", BLOCK))
    blocks = torch.randperm(n, generator=torch.Generator().manual_seed(0))[: T // BLOCK].tolist()
    return PagedDestination(paged, blocks, T)


def _worker(kvsrc: str, preset: str, dests: str, memory: str, device: str, chunks: int, profile: bool, barrier, results) -> None:
    """One process: restore ``chunks`` chunks once every process is ready; put its figures."""
    try:
        torch.set_num_threads(1)  # as a decode worker
        objs, shape = _objects(kvsrc, preset, device)
        dest = _destination(dests, shape, device)
        parsed = _parts(objs, memory, decode_worker._WorkerState())
        steps: dict[str, list[float]] = {"decode_s": [], "write_s": []}

        def one(i: int) -> None:
            times: dict[str, float] = {}
            h, side, parts = parsed[i % DISTINCT]
            chunk.restore_chunk(dest, ChunkRef("", 0, 0, shape[3]), h, side, parts, times=times)
            for k in steps:
                steps[k].append(times[k])

        for i in range(3):  # warm-up: compiles, plans, pinned buffers
            one(i)
        for v in steps.values():
            v.clear()
        barrier.wait(timeout=300)
        prof = cProfile.Profile() if profile else None
        t = time.perf_counter()
        if prof:
            prof.enable()
        for i in range(chunks):
            one(i)
        if prof:
            prof.disable()
        wall = time.perf_counter() - t
        text = ""
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            text = s.getvalue()
        results.put({"ms_a_chunk": wall / chunks * 1e3, "kv_bytes": math.prod(shape) * 2 * chunks, "wall_s": wall,
                     **{k.replace("_s", "_ms"): statistics.median(v) * 1e3 for k, v in steps.items()}, "profile": text})
    except BaseException as e:  # reported, so the parent never waits for a process that died
        barrier.abort()
        results.put({"error": f"{type(e).__name__}: {e}"})


def run(kvsrc: str, preset: str, dest: str, memory: str, device: str, procs: int, chunks: int, profile: bool) -> dict:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(kvsrc, preset, dest, memory, device, chunks, profile and i == 0, barrier, results)) for i in range(procs)]
    for p in ps:
        p.start()
    got = [results.get(timeout=600) for _ in ps]
    for p in ps:
        p.join()
    errors = [g["error"] for g in got if "error" in g]
    if errors:
        raise RuntimeError(f"{preset} x {procs}: {errors[0]}")
    prof = next((g.pop("profile") for g in got if g["profile"]), "")
    for g in got:
        g.pop("profile", None)
    row = {"preset": preset, "dest": dest, "memory": memory, "procs": procs,
           "kv_GB_s": round(sum(g["kv_bytes"] for g in got) / max(g["wall_s"] for g in got) / 1e9, 2),
           **{k: round(statistics.median(g[k] for g in got), 3) for k in ("ms_a_chunk", "decode_ms", "write_ms")}}
    if prof:
        row["profile_first_process"] = prof
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--kvsrc", default=".bench/kvsrc.pt")
    ap.add_argument("--presets", default="transform-ans,compact-ans")
    ap.add_argument("--procs", default="1,8", help="numbers of processes, comma-separated")
    ap.add_argument("--dests", default="flat,paged", help="flat (a buffer's slots) and/or paged (vLLM's cross-layer blocks)")
    ap.add_argument("--memory", default="bytes,slab", help="bytes (pageable, the process' own) and/or slab (mapped as a decode worker maps staging)")
    ap.add_argument("--chunks", type=int, default=40, help="chunks each process restores")
    ap.add_argument("--profile", action="store_true", help="cProfile the first process at the largest count")
    ap.add_argument("--out")
    args = ap.parse_args()
    counts = [int(n) for n in args.procs.split(",")]
    rows = []
    for preset in args.presets.split(","):
        for dest, n, memory in itertools.product(args.dests.split(","), counts, args.memory.split(",")):
            row = run(args.kvsrc, preset, dest, memory, args.device, n, args.chunks, args.profile and n == max(counts))
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "profile_first_process"}), flush=True)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "date": time.strftime("%Y-%m-%d"),
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
