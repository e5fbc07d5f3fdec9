"""probe: teach the cost model the link's rate before any fetch has.

A fresh sidecar knows its link only by the estimator's prior (1 Gbit/s). Under that prior a load of a
long prompt never looks faster than recompute, so ``auto`` would recompute, never fetch, and never
learn the link; the same holds under a ceiling a slow spell set (:meth:`Estimator.ceiling`) and under
rates a slow spell taught. When a lookup finds a stored prefix and plans a recompute while the
link's rate is stale (:meth:`Estimator.stale`: unmeasured, no read for a while, or under a ceiling
past half its time), the sidecar reads a few of that prefix's objects in the
background (:class:`LinkProbe`), discards them, and teaches the estimator the rate they came at. Nothing read reaches a KV buffer. One probe runs at a
time, announced on the node's link as a fetch is (:mod:`~kvfetcher.fetch.linkshare`: the ranks of a
tensor-parallel group probing at once each learn the whole link); while the rate is fresh no other
starts, and after one failed the next waits ``every_s``.
The probe reads as a fetch does (the reader processes where the sidecar has them, else ranged reads
in its I/O threads, into staging buffers): a rate from a slower read path is a floor under which
``auto`` may never load, so that no fetch ever raises it (docs/results.md).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor

from kvfetcher import keys
from kvfetcher.errors import Reason
from kvfetcher.fetch.choice import Estimator
from kvfetcher.fetch import staging as staging_mod
from kvfetcher.fetch.linkshare import LinkShare
from kvfetcher.metrics import Metrics
from kvfetcher.store import Store, StoreError, read_into

log = logging.getLogger("kvfetcher.probe")

PROBE_BYTES = 256 * 2**20  # what one probe reads at most: enough objects that their request latency is small beside it
PROBE_EVERY_S = 60.0  # after a failed probe, the least time before the next


def objects(chunk_keys: Sequence[str], run: Sequence[Mapping[str, int]], max_bytes: int = PROBE_BYTES) -> list[tuple[str, int]]:
    """(name, size) of the largest stored object of each leading chunk of ``run`` (the stored
    representations of ``chunk_keys``' leading chunks, preset -> size) until ``max_bytes`` (at least one)."""
    out, total = [], 0
    for key, stored in zip(chunk_keys, run):
        if not stored or (out and total >= max_bytes):
            break
        preset, size = max(stored.items(), key=lambda kv: kv[1])
        out.append((keys.object_name(key, preset), size))
        total += size
    return out


class LinkProbe:
    """One sidecar's probe of its link to ``store``, read in ``pool`` and taught to ``estimator`` (the
    module's doc). ``read`` and ``staging`` are a fetch's (default: ranged reads of ``store`` in
    ``pool``, into the process's staging buffers)."""

    def __init__(self, store: Store, pool: Executor, estimator: Estimator, metrics: Metrics, link: LinkShare | None = None,
                 every_s: float = PROBE_EVERY_S, read: Callable[[str, int, memoryview], int] | None = None,
                 staging: staging_mod.StagingPool | None = None):
        self.store, self.pool, self.estimator, self.metrics, self.every_s = store, pool, estimator, metrics, every_s
        self.read = read or functools.partial(read_into, store)
        self.staging = staging or staging_mod.shared()
        self.link = link or LinkShare(None)  # a probe shares the node's link as a fetch does, and counts as one
        self.task: asyncio.Task | None = None
        self._last = float("-inf")  # when the latest probe started
        self.probes = 0  # started

    def wanted(self) -> bool:
        """Whether a probe should start now: the link's rate is stale, none runs, and none started lately."""
        return (self.estimator.stale(self.store.endpoint) and (self.task is None or self.task.done())
                and time.monotonic() - self._last >= self.every_s)

    def start(self, names: Sequence[tuple[str, int]]) -> None:
        """Read ``names`` (from :func:`objects`) in the background, if :meth:`wanted`."""
        if names and self.wanted():
            self._last, self.probes = time.monotonic(), self.probes + 1
            self.task = asyncio.get_running_loop().create_task(self._read(list(names)))

    async def _read(self, names: list[tuple[str, int]]) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with self.link.fetch() as share:
                t = time.perf_counter()
                sizes = await asyncio.gather(*(loop.run_in_executor(self.pool, self._size_of, n, size) for n, size in names))
                seconds = time.perf_counter() - t
        except StoreError as e:  # (a deleted object too): the next probe, later, reads others
            self.metrics.errors.labels(e.reason).inc()
            return
        except Exception:  # noqa: BLE001 — a background probe must not die unseen
            log.exception("link probe failed")
            self.metrics.errors.labels(Reason.INTERNAL).inc()
            return
        ep = self.store.endpoint
        self.estimator.observe_read(ep, sum(sizes), seconds, sharers=share.sharers, probe=True)  # the link's rate, as a fetch teaches it
        self.metrics.link(ep, self.estimator.bandwidth(ep), self.estimator.rates(ep).format_bandwidth)
        log.info("link to %s probed: %d objects, %.0f MB in %.3f s (%.1f Gbit/s)", ep, len(names),
                 sum(sizes) / 1e6, seconds, sum(sizes) * 8 / seconds / 1e9)

    def _size_of(self, name: str, size: int) -> int:
        """Read the object as a fetch would, into a staging buffer given back at once; its bytes."""
        buf = self.staging.take(size, False)
        try:
            return self.read(name, 0, memoryview(buf.numpy())[:size])
        finally:
            self.staging.give(buf, False)

    async def settled(self) -> None:
        """Wait for the running probe, if any."""
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
