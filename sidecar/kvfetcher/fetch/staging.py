"""staging: reusable host buffers that chunks are read into: a raw chunk before its one copy to the
KV, an entropy-coded one before its one copy to the GPU that decodes it.

Why reuse: a fresh buffer per chunk pays its page faults on first touch, which makes reading
into it several times slower than into reused memory, and pinned memory (what a GPU copies from
by DMA, without a bounce buffer) is slower still to allocate. Why pinned on a GPU: a
non-blocking host-to-device copy needs it.

Buffers come in size classes (:func:`size_class`, at most 1/8 larger than asked): a coded chunk's
size varies from chunk to chunk, and chunks of one geometry must still find each other's buffers.

A buffer is handed back only when no thread can still touch it (see :mod:`fetch.executor`: a
read abandoned at a deadline keeps running in its thread; its buffer is then dropped, not reused).
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

#: free buffers kept per (size, pinned): at least a fetch's window, so steady state allocates nothing
KEEP = 16


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to the next of eight sizes per power of two (``m << k``, ``8 <= m < 16``)."""
    shift = max(0, nbytes.bit_length() - 4)
    return -(-nbytes >> shift) << shift


class StagingPool:
    """Free host buffers by (size class, pinned). ``take`` allocates when none is free; ``give``
    keeps at most ``keep`` per kind (the rest are freed)."""

    #: whether other processes of the sidecar can map its buffers (:meth:`place` says where a view lies)
    shared = False

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self.allocated = 0  # buffers allocated so far (tests and benchmarks read it)

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A uint8 tensor of ``size_class(nbytes)`` bytes in host memory (page-locked if ``pinned``);
        contents undefined. Hand back the tensor itself (not a slice of it) to :meth:`give`."""
        size = size_class(nbytes)
        with self._lock:
            free = self._free[(size, pinned)]
            if free:
                return free.pop()
            self.allocated += 1
        return self._allocate(size, pinned)

    def _allocate(self, size: int, pinned: bool) -> torch.Tensor:
        """A new buffer of ``size`` bytes."""
        return torch.empty(size, dtype=torch.uint8, pin_memory=pinned)

    def _free_buffer(self, buf: torch.Tensor) -> None:
        """A buffer the pool lets go of (nothing uses it): freed with its last reference."""

    def reserve(self, nbytes: int, pinned: bool, count: int) -> int:
        """Allocate ahead, off any request's path, until ``count`` free buffers of this kind wait
        (at most ``keep``); returns how many were added. Unpinned ones are touched, so their page
        faults are paid here, not in the first fetch's reads. Why: a process's first raw fetch
        otherwise allocates its whole window, and reads at a fraction of the later fetches' rate."""
        added, want, size = 0, min(count, self.keep), size_class(nbytes)
        for _ in range(want):
            with self._lock:
                if len(self._free[(size, pinned)]) >= want:
                    break
                self.allocated += 1
            buf = self._allocate(size, pinned)
            if not pinned:
                buf.zero_()
            self.give(buf, pinned)
            added += 1
        return added

    def give(self, buf: torch.Tensor, pinned: bool) -> None:
        """Return a buffer :meth:`take` gave and no one uses any more (``pinned`` as it was taken:
        asking the tensor, ``Tensor.is_pinned``, is slow without CUDA)."""
        with self._lock:
            free = self._free[(buf.numel(), pinned)]
            if len(free) < self.keep:
                free.append(buf)
                return
        self._free_buffer(buf)

    def close(self) -> None:
        """Free every kept buffer; a buffer given back later is freed too (taking still works)."""
        with self._lock:
            self.keep = 0
            kept = [b for free in self._free.values() for b in free]
            self._free.clear()
        for buf in kept:
            self._free_buffer(buf)


_shared = StagingPool()


def shared() -> StagingPool:
    """The process's pool: fetches of one sidecar share their staging memory."""
    return _shared
