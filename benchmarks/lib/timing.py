"""timing: the median wall time of a GPU step, the one stopwatch the benchmark suites share."""

from __future__ import annotations

import statistics
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
