"""write_bench: what one chunk's write into vLLM's cross-layer paged cache costs on a GPU, step by step.

The direct path writes a verified raw chunk (8B shape, bf16, 256 tokens: 32 MiB) by one copy to the
device, a finite check there and one scatter into its blocks (``executor._write_native``). This
times each step alone (the copy from pinned, from a reader process's shared staging buffer, and from
pageable memory) and then the whole write from 1, 2, 4 and 8 threads at once: the rate the write
threads can reach when nothing else in the pipeline waits. GPU only; about 10 s.

    python -m benchmarks.paged_restore.write_bench --out benchmarks/paged_restore/result_h200_write.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvfetcher import kvbuffer
from kvfetcher.fetch.executor import _write_native
from kvfetcher.fetch.readers import SharedStaging
from kvfetcher.format import container
from kvfetcher.kvbuffer import ChunkRef

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def median_ms(fn, repeats: int = 10) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return round(1e3 * statistics.median(times), 3)


def threaded(dest, kvs, chunks: int, threads: int) -> dict:
    """GB/s of ``chunks`` whole writes from ``threads`` threads (after a warm-up round)."""
    refs = [ChunkRef(f"c{i}", 0, i * kvs[0].shape[3], kvs[0].shape[3]) for i in range(chunks)]
    one = lambda i: _write_native(dest, refs[i], kvs[i % len(kvs)])  # noqa: E731
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(kvs))))
        torch.cuda.synchronize()
        t = time.perf_counter()
        list(pool.map(one, range(chunks)))
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    return {"GB_s": round(chunks * kvs[0].numel() * 2 / dt / 1e9, 2), "ms_a_chunk": round(1e3 * dt / chunks, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256, help="tokens a chunk")
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = torch.device("cuda")
    blocks = a.chunks * a.tokens // BLOCK + 64
    cross = torch.zeros(blocks, LAYERS, BLOCK, KV_HEADS, 2 * HEAD_DIM, dtype=torch.bfloat16, device=dev)
    paged = kvbuffer.PagedKV(cross, kvbuffer.PagedLayout("BLTH(KD)", BLOCK))
    ids = random.Random(0).sample(range(blocks), a.chunks * a.tokens // BLOCK)
    nbytes = LAYERS * 2 * KV_HEADS * a.tokens * HEAD_DIM * 2
    shape = (LAYERS, 2, KV_HEADS, a.tokens, HEAD_DIM)
    pinned = torch.randn(nbytes // 2).to(torch.bfloat16).view(torch.uint8).pin_memory()
    pageable = pinned.clone()
    staging = SharedStaging()
    shared = [staging.take(nbytes, True) for _ in range(8)]
    for s in shared:
        s.copy_(pinned)
    on_gpu = pinned.to(dev).view(torch.bfloat16).view(shape)
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "chunk_tokens": a.tokens, "chunk_bytes": nbytes,
           "steps_ms": {"copy_from_pinned": median_ms(lambda: pinned.to(dev, non_blocking=True)),
                        "copy_from_shared_staging": median_ms(lambda: shared[0].to(dev, non_blocking=True)),
                        "copy_from_pageable": median_ms(lambda: pageable.to(dev, non_blocking=True)),
                        "finite_check": median_ms(lambda: container.check_finite(on_gpu, torch.bfloat16)),
                        "scatter": median_ms(lambda: paged.write(ids[: a.tokens // BLOCK], on_gpu))},
           "whole_write_by_threads": {}}
    dest = kvbuffer.destination(paged, a.chunks * a.tokens, block_ids=ids)
    kvs = [s.view(torch.bfloat16).view(shape) for s in shared]
    for threads in (1, 2, 4, 8):
        res["whole_write_by_threads"][threads] = threaded(dest, kvs, a.chunks, threads)
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
