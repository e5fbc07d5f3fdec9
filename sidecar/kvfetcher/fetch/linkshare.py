"""linkshare: how many fetches share the node's link, counted through a directory the sidecars share.

Every sidecar on a node (one per tensor-parallel rank, and those of other pods) reads from the
store through the same network link. Each fetch in progress holds an *announcement*: a file
``<directory>/<random>.fetch`` locked with ``flock`` for as long as the fetch runs. Counting the
fetches is counting the announcements whose lock is held: the kernel drops a lock when its process
exits, however it exits, so a killed sidecar's announcement stops counting at once (and the next
count deletes the file). An announcement is locked before it is renamed into place, so a counter
never sees one unlocked while its fetch runs. ``flock`` locks taken through different opens
conflict even within one process, so in-process sidecars count one another too.

Contract: :meth:`LinkShare.active` is the number of fetches announced on the node now (0 without a
directory). :meth:`LinkShare.fetch` announces one fetch and samples the count while it runs; its
:attr:`Share.sharers` is the harmonic mean of the samples (itself included, so at least 1): a
fetch that shared the link with ``k - 1`` others for all its time got ``1/k`` of it. The cost model
learns the link's rate as the rate a fetch saw times its sharers, and predicts a fetch's rate as
the link's rate divided by the fetches expected to share it (:class:`kvfetcher.fetch.choice.Estimator`).

Written here rather than taken from a library: the standard library's ``fcntl.flock`` is the whole
mechanism; a counter in shared memory would stay high after a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

SUFFIX = ".fetch"
SAMPLE_S = 0.02  # how often a running fetch counts its sharers


@dataclass
class Share:
    """The counts of fetches on the link sampled while one fetch ran (each includes that fetch)."""

    samples: list[int] = field(default_factory=list)

    @property
    def sharers(self) -> float:
        """How many ways the link was split for this fetch, on average over its time (1: alone)."""
        counts = [max(1, k) for k in self.samples]
        return len(counts) / sum(1 / k for k in counts) if counts else 1.0


class LinkShare:
    """The node's fetch announcements in ``directory`` (None: no sharing is known; every count is 0)."""

    def __init__(self, directory: str | None, sample_s: float = SAMPLE_S):
        self.directory, self.sample_s = directory, sample_s
        if directory:
            os.makedirs(directory, exist_ok=True)

    def active(self) -> int:
        """Fetches announced now on the node; removes announcements whose process is gone."""
        if not self.directory:
            return 0
        n = 0
        for name in os.listdir(self.directory):
            if not name.endswith(SUFFIX):
                continue
            path = os.path.join(self.directory, name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:  # ended between the listing and the open
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # its fetch holds it: running
                n += 1
            else:  # nobody holds it: its fetch ended or its process died
                with contextlib.suppress(OSError):
                    os.unlink(path)
            finally:
                os.close(fd)
        return n

    def _announce(self) -> tuple[int, str] | None:
        if not self.directory:
            return None
        name = secrets.token_hex(8)
        tmp = os.path.join(self.directory, f".{name}.tmp")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDONLY, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        path = os.path.join(self.directory, name + SUFFIX)
        os.rename(tmp, path)  # counted from here on, already locked
        return fd, path

    @staticmethod
    def _withdraw(held: tuple[int, str] | None) -> None:
        if held is not None:
            fd, path = held
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)

    @contextlib.asynccontextmanager
    async def fetch(self) -> AsyncIterator[Share]:
        """Announce one fetch for the block's duration; the yielded :class:`Share` fills with samples
        of :meth:`active` taken at its start, every ``sample_s`` and at its end."""
        share = Share()
        held = self._announce()
        if held is None:
            yield share
            return

        async def sample() -> None:
            while True:
                await asyncio.sleep(self.sample_s)
                share.samples.append(self.active())

        share.samples.append(self.active())
        sampler = asyncio.ensure_future(sample())
        try:
            yield share
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            share.samples.append(self.active())
            self._withdraw(held)
