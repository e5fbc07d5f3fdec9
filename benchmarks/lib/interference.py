"""interference: the serving engine whose slowdown a fetch beside it causes.

:func:`decode_loop` runs in a process of its own: a Llama-3-8B-shaped model (random bf16 weights)
decoding a batch of requests, one CUDA-graph replay per step with a sync per step (as an engine
samples every step), timing every step until told to stop. A benchmark runs its fetches (or
recomputes) in phases meanwhile; the steps that fall inside a phase, against the loop alone,
are that phase's interference (:func:`stats`).
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.lib.llama8b import Llama


def decode_loop(batch: int, ctx: int, ready, stop, q) -> None:
    """The engine: decode ``batch`` requests of ``ctx`` cached tokens, step after step, until told."""
    torch.cuda.set_device(0)
    m = Llama(seed=1)
    kv = m.kv_buffer(ctx + 1, batch=batch)
    kv.normal_(0, 1)
    ids = torch.randint(0, 128000, (batch,), device="cuda")
    pos = torch.full((batch,), ctx, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            m.step(ids, pos, kv, ctx)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        nxt = m.step(ids, pos, kv, ctx)
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    ready.set()
    starts, durs = [], []
    while not stop.is_set():
        t = time.perf_counter()
        g.replay()
        ids.copy_(nxt)
        torch.cuda.synchronize()
        starts.append(t)
        durs.append(time.perf_counter() - t)
    q.put((starts, durs))


def stats(xs: list[float]) -> dict:
    """Step count and median, p90 and mean step time (ms) of ``xs`` (seconds)."""
    if not xs:
        return {"steps": 0}
    s = sorted(xs)
    return {"steps": len(s), "median_ms": 1e3 * statistics.median(s), "p90_ms": 1e3 * s[int(0.9 * (len(s) - 1))], "mean_ms": 1e3 * statistics.mean(s)}


