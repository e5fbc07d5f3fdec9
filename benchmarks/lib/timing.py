"""timing: the median wall time of a GPU step, the one stopwatch the benchmark suites share."""

from __future__ import annotations

import statistics
import threading
import time

import torch


def median_s(fn, repeats: int, warmup: int = 1) -> tuple[float, object]:
    """Median wall seconds of ``repeats`` calls of ``fn``, each ended by a CUDA synchronize (so its
    GPU work counts), after ``warmup`` untimed calls; and the last call's result."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    secs, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        secs.append(time.perf_counter() - t)
    return statistics.median(secs), out


def calls_per_s(threads: int, one, seconds: float) -> float:
    """Calls a second of ``one(i)`` by ``threads`` threads looping together for ``seconds`` (each
    thread's first call, untimed, warms it)."""
    stop, counts, ready = threading.Event(), [0] * threads, threading.Barrier(threads + 1)

    def loop(i: int) -> None:
        one(i)
        ready.wait()
        while not stop.is_set():
            one(i)
            counts[i] += 1

    ths = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for t in ths:
        t.start()
    ready.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for t in ths:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def threads_s(threads: int, work) -> float:
    """Wall seconds of ``threads`` threads each running ``work(i)`` once, started together and ended
    by a CUDA synchronize (so their GPU work counts)."""
    ths = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    torch.cuda.synchronize()
    return time.perf_counter() - t0
