"""linkstore: an in-memory object store behind an emulated network link.

Stands in for S3 over a link of a set speed when no real one is at hand: every ranged GET
waits a first-byte latency and then queues for the one shared link, which delivers bytes at
``link_Bps`` to one request after another (FIFO). Concurrent fetches therefore share the
bandwidth, as they would on a NIC, also from several processes (one link, given to each).
Emulation, not a network: no TCP, no packet loss.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np

from kvfetcher.store import NotFound


class Link:
    """A FIFO pipe of ``Bps`` bytes per second; ``send(n)`` blocks until ``n`` bytes are through.

    Its state lives in shared memory, so processes started with the link as an argument share it,
    as the sidecars of one node share its NIC (``time.perf_counter`` is the system's monotonic
    clock, the same in every process). ``Bps`` may be set between runs."""

    def __init__(self, Bps: float, latency_s: float = 0.0):
        self._state = mp.get_context("spawn").Array("d", [Bps, latency_s, 0.0, 0.0])  # rate, latency, free at, bytes sent

    @property
    def Bps(self) -> float:
        return self._state[0]

    @Bps.setter
    def Bps(self, value: float) -> None:
        self._state[0] = value

    @property
    def latency_s(self) -> float:
        return self._state[1]

    @property
    def bytes(self) -> int:
        return int(self._state[3])

    def send(self, n: int) -> None:
        now = time.perf_counter()
        with self._state.get_lock():
            rate, latency, free_at, sent = self._state[:]
            done = max(now + latency, free_at) + n / rate
            self._state[2], self._state[3] = done, sent + n
        delay = done - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


class LinkStore:
    """:class:`kvfetcher.store.Store` over a dict, each GET paced by a :class:`Link` (or none)."""

    def __init__(self, link: Link | None = None, endpoint: str = "emulated-link"):
        self.link, self.endpoint = link, endpoint
        self.objects: dict[str, bytes] = {}

    def put(self, name: str, data: bytes) -> bool:
        if name in self.objects:
            return False
        self.objects[name] = bytes(data)
        return True

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        try:
            obj = self.objects[name]
        except KeyError:
            raise NotFound(name) from None
        data = obj[offset:] if length is None else obj[offset : offset + length]
        if self.link is not None:
            self.link.send(len(data))
        return data

    def get_into(self, name: str, offset: int, buf: memoryview) -> int:
        """A ranged GET landing in the caller's buffer (as a socket read would): one copy, no bytes object."""
        try:
            obj = self.objects[name]
        except KeyError:
            raise NotFound(name) from None
        n = max(0, min(len(buf), len(obj) - offset))
        if self.link is not None:
            self.link.send(n)
        if n:
            np.frombuffer(buf, dtype=np.uint8, count=n)[:] = np.frombuffer(obj, dtype=np.uint8, count=n, offset=offset)
        return n

    def list(self, prefix: str) -> dict[str, int]:
        return {k: len(v) for k, v in self.objects.items() if k.startswith(prefix)}

    def exists(self, name: str) -> bool:
        return name in self.objects

    def delete(self, name: str) -> None:
        self.objects.pop(name, None)

    def ping(self) -> None:
        return None
