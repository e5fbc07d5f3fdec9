"""The store path's rate: a prompt's KV from a GPU buffer to stored objects, GB/s of KV.

What a sidecar does for a store request, step by step and timed apart: the copy of the prompt's
KV out of the model's buffer into host memory (``Destination.read``, the one step on which the
request waits), then the writer (``save.Writer``: per chunk and preset, a HEAD, the encode —
on the GPU for entropy-coded presets — and the PUT) until the queue is flushed. ``--encoders``
sets the writer's encode concurrency (``Config.store_encoders``) and ``--batch`` the chunks one encode codes
together (``Config.store_encode_batch``), each value timed. An 8B model's
shape (bf16), synthetic values, or real KV tiled from ``--kvsrc`` (``benchmarks.lib.kvsource``); the
stand-in calibration has a random orthogonal basis, so the calibrated presets pack through one.
The objects go to a local directory (``--store local``, on /dev/shm where there is one) or over S3
to the link server, unpaced (``--store s3``). After each cell the store's copy must equal the buffer,
and every few chunks the stored object must restore what a direct encode of the chunk restores. Medians of
``--repeats`` stores by one writer per cell (its threads kept, as a sidecar's), after one that warms it; prints one JSON line per cell, ``--out`` writes the result.

    python -m benchmarks.store_rate.store_bench --presets transform-ans,balanced-ans,raw --out $OUT/store_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.lib import kvsource, standin
from benchmarks.lib.cpuload import busy_cores, cpu_jiffies
from kvfetcher import chunk, keys, kvbuffer
from kvfetcher.config import Config
from kvfetcher.eval.costmodel import SHAPES
from kvfetcher.format import mac
from kvfetcher.metrics import Metrics
from kvfetcher.save.writer import Job, Writer
from kvfetcher.store.local import LocalStore

FP = "store-bench/8b"


@contextlib.contextmanager
def object_store(kind: str):
    """A store for the objects: a local directory (tmpfs where there is one), or S3 over the link server."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=base) as root:
        bucket = Path(root) / "kvbench"
        bucket.mkdir()
        if kind == "local":
            yield LocalStore(bucket)
            return
        from benchmarks.lib import linkserver
        from kvfetcher.store.s3 import S3Store

        url, group = linkserver.start_process(root, 0.0, linkserver.default_procs())
        try:
            yield S3Store(url, "kvbench", "bench", "bench", verify_tls=False)
        finally:
            group.terminate()


def prompt_kv(shape, chunks: int, T: int, kvsrc: str | None, device: str) -> torch.Tensor:
    """A flat KV buffer ``[L, 2, H, chunks * T, D]`` bf16 on ``device``: real KV tiled, or synthetic."""
    L, H, D = shape.layers, shape.kv_heads, shape.head_dim
    if kvsrc:
        src = torch.load(kvsrc)
        pieces = kvsource.real_chunks(src, min(chunks, 8), L)
        return torch.cat([pieces[i % len(pieces)] for i in range(chunks)], dim=3).to(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    return (torch.randn(L, 2, H, chunks * T, D, generator=g) * 2).to(torch.bfloat16).to(device)


def paged(buf: torch.Tensor, block_size: int = 16) -> tuple[kvbuffer.PagedKV, list[int]]:
    """``buf``'s KV in vLLM's cross-layer paged form (``BLTH(KD)``), its blocks shuffled: the tensor and the prompt's blocks."""
    L, _, H, tokens, D = buf.shape
    n = tokens // block_size
    ids = torch.randperm(n + 64, generator=torch.Generator().manual_seed(0))[:n].tolist()
    kv = kvbuffer.PagedKV(torch.zeros(n + 64, L, block_size, H, 2 * D, dtype=buf.dtype, device=buf.device),
                          kvbuffer.PagedLayout("BLTH(KD)", block_size))
    for i, b in enumerate(ids):
        kv.write([b], buf[:, :, :, i * block_size : (i + 1) * block_size])
    return kv, ids


async def store_runs(store, cfg: Config, ns: keys.Namespace, where: Callable[[], kvbuffer.Destination], preset: str,
                     tags: list[str]) -> list[dict]:
    """Stores of the whole destination (a new one from ``where`` each time), one per tag, by one writer (as a sidecar's, its encode threads
    kept warm between them): seconds of the copy out and of the writer, the objects' bytes. Each run's
    objects but the last are deleted before the next."""
    io, meta = ThreadPoolExecutor(cfg.io_workers), ThreadPoolExecutor(cfg.meta_io_workers)
    sizes: list[int] = []
    w = Writer(store, cfg, Metrics(), io, meta, stored=lambda key, preset, size: sizes.append(size))
    w.start()
    runs = []
    try:
        for n, tag in enumerate(tags):
            sizes.clear()
            d = where()
            ck = [f"{tag}-{i:05d}" for i in range(d.tokens // cfg.chunk_tokens)]
            t0 = time.perf_counter()
            kv = d.read(0, d.tokens)
            t1 = time.perf_counter()
            w.reserve(len(ck), kv.numel() * kv.element_size() // len(ck))
            w.submit(Job(ns, ck, kv))
            await w.flush()
            t2 = time.perf_counter()
            runs.append({"copy_s": t1 - t0, "write_s": t2 - t1, "total_s": t2 - t0, "objects": len(sizes),
                         "stored_bytes": sum(sizes), "names": ck})
            if n < len(tags) - 1:
                forget(store, ck, preset)
            else:
                runs[-1]["kv"] = kv
    finally:
        await w.close(0)
        io.shutdown()
        meta.shutdown()
    return runs


def check(store, preset: str, names: list[str], buf: torch.Tensor, kv: torch.Tensor, T: int, theta: float,
          object_key: bytes | None = None) -> bool:
    """The store's copy is the buffer's KV, and (every few chunks) each stored object restores what a
    direct encode of its chunk restores (its tags verified under ``object_key``)."""
    if not torch.equal(kv.view(torch.int16), buf.cpu().view(torch.int16)):
        return False
    for i in range(0, len(names), max(1, len(names) // 4)):
        key = names[i]
        piece = buf[:, :, :, i * T : (i + 1) * T].contiguous()
        want = chunk.decode_chunk(chunk.encode_chunk(piece, preset, FP, start=i * T, rope_theta=theta), FP, device=buf.device)
        name = keys.object_name(key, preset)
        got = chunk.decode_chunk(store.get(name), FP, device=buf.device, auth=mac.ObjectMAC(object_key, name) if object_key else None)
        if not torch.equal(want.view(torch.int16), got.view(torch.int16)):
            return False
    return True


def forget(store, names: list[str], preset: str) -> None:
    """Delete a run's objects (a run of ``raw`` is the prompt's KV again: memory, on tmpfs)."""
    for key in names:
        store.delete(keys.object_name(key, preset))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--chunks", type=int, default=64, help="chunks of the prompt stored (64: 16K tokens, 2.1 GB)")
    ap.add_argument("--presets", default="transform-ans,balanced-ans,raw")
    ap.add_argument("--encoders", default="1", help="the writer's encode concurrency (Config.store_encoders), comma-separated")
    ap.add_argument("--batch", default="1", help="chunks one encode codes together (Config.store_encode_batch), comma-separated")
    ap.add_argument("--dests", default="flat,paged", help="the model's buffer: flat, and/or vLLM's cross-layer paged blocks")
    ap.add_argument("--store", default="local", choices=["local", "s3"])
    ap.add_argument("--kvsrc", help="real KV to tile (benchmarks.lib.kvsource); default synthetic")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--switch-ms", type=float, help="sys.setswitchinterval for the run (default: Python's, 5 ms)")
    ap.add_argument("--object-key", default="", help="a pool's object key (any secret): the writer tags every object (format.mac)")
    ap.add_argument("--out")
    args = ap.parse_args()
    object_key = mac.key_from(args.object_key)
    if args.switch_ms:
        sys.setswitchinterval(args.switch_ms / 1e3)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape, T = SHAPES[args.shape], 256
    standin.ensure(FP, (shape.layers, 2, shape.kv_heads, T, shape.head_dim))
    buf = prompt_kv(shape, args.chunks, T, args.kvsrc, device)
    kv_bytes = buf.numel() * buf.element_size()
    ns = keys.Namespace(FP, "bfloat16", shape=(shape.layers, shape.kv_heads, shape.head_dim))
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "date": time.strftime("%Y-%m-%d"),
              "shape": args.shape, "switch_ms": sys.getswitchinterval() * 1e3, "tokens": buf.shape[3], "kv_bytes": kv_bytes, "store": args.store,
              "kv": "real, tiled" if args.kvsrc else "synthetic", "keyed": object_key is not None, "cells": []}
    tokens = buf.shape[3]
    wheres = {"flat": lambda: kvbuffer.Destination(buf, offset=0, tokens=tokens)}
    if "paged" in args.dests:
        kv_paged, ids = paged(buf)
        wheres["paged"] = lambda: kvbuffer.PagedDestination(kv_paged, ids, tokens)
    with object_store(args.store) as store:
        run = 0
        for dest, preset, enc, batch in itertools.product(args.dests.split(","), args.presets.split(","), [int(e) for e in args.encoders.split(",")],
                                                          [int(b) for b in args.batch.split(",")]):
            cfg = Config(presets=(preset,), store_queue_chunks=args.chunks, store_queue_bytes=kv_bytes, rope_theta=shape.rope_theta,
                         store_encoders=enc, store_encode_batch=batch, object_key=args.object_key)
            cpu0 = cpu_jiffies()  # the first run warms the GPU codecs and the writer's threads
            times = asyncio.run(store_runs(store, cfg, ns, wheres[dest], preset, [f"r{run + k}" for k in range(args.repeats + 1)]))
            run += args.repeats + 1
            cpu = busy_cores(cpu0, cpu_jiffies())
            last = times[-1]
            med = {k: statistics.median(t[k] for t in times[1:]) for k in ("copy_s", "write_s", "total_s")}
            cell = {"dest": dest, "preset": preset, "encoders": enc, "batch": batch, **{k: round(v, 4) for k, v in med.items()},
                    "copy_GB_s": round(kv_bytes / med["copy_s"] / 1e9, 2), "write_GB_s": round(kv_bytes / med["write_s"] / 1e9, 2),
                    "store_GB_s": round(kv_bytes / med["total_s"] / 1e9, 2), "ratio": round(kv_bytes / last["stored_bytes"], 3),
                    "objects": last["objects"], "cpu_busy_cores": cpu,
                    "copied_and_restored": check(store, preset, last["names"], buf, last["kv"], T, shape.rope_theta, object_key)}
            forget(store, last["names"], preset)
            result["cells"].append(cell)
            print(json.dumps(cell), flush=True)
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
