"""cpuload: how busy the machine's CPU was over a stretch of a benchmark (every process on it),
from ``/proc/stat``: a restore bound by the CPU shows here, not in the GPU's figures."""

from __future__ import annotations

import os


def cpu_jiffies(stat: str = "/proc/stat") -> tuple[int, int] | None:
    """(busy, total) clock ticks of all the machine's cores since boot, from ``stat``'s ``cpu`` line
    (idle and I/O wait are not busy; None where there is no such file)."""
    try:
        with open(stat) as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    total = sum(ticks)
    return total - ticks[3] - (ticks[4] if len(ticks) > 4 else 0), total


def busy_cores(before: tuple[int, int] | None, after: tuple[int, int] | None, cores: int | None = None) -> float | None:
    """How many of the machine's ``cores`` (default: all) were busy on average between two
    :func:`cpu_jiffies` readings: a load that saturates the CPU shows here, not in the GPU's figures."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]) * (cores or os.cpu_count() or 1), 2)
