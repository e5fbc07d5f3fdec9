"""readers: ranged reads of a store in processes of their own, straight into shared staging memory.

Why: a read in the sidecar's process takes the GIL for every request's Python (signing, headers)
and every socket read, and the sidecar's decode, copy and event-loop threads want it too; past a
few GB/s the reads wait on the GIL rather than on the link. A reader process has a GIL of its own.
What crosses the process boundary is a small message each way; the bytes land in a staging buffer
both processes map (:class:`SharedStaging`: memfds, page-locked for the GPU's copies where there is
one). Checksums stay with the caller, in the I/O thread that waited for the read (they release
the GIL).

``KVFETCHER_READ_PROCS`` processes (by default some with CUDA, none without);
``benchmarks/paged_restore`` times them against threads (a tuning's fourth number), and
docs/architecture.md says what is known of them.

A reader that dies fails its read (:class:`~kvfetcher.store.Unavailable`: the fetch falls back to
recompute) and is replaced at the next read. Each reader opens the store itself, from the
caller's ``opener`` (a picklable zero-argument callable, e.g. :meth:`S3Store.opener`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
from collections.abc import Callable

import numpy as np
import torch

from kvfetcher import ipc
from kvfetcher import store as stores
from kvfetcher.fetch.reader_proc import Failed, Place, Read, serve
from kvfetcher.fetch.slab import Slab
from kvfetcher.fetch.staging import StagingPool


class SharedStaging(StagingPool):
    """A :class:`StagingPool` whose buffers are memfds that reader processes map too
    (:meth:`place` names where a view of one lies); page-locked ones are registered with CUDA
    (:func:`kvfetcher.ipc.pin`) so the GPU copies from them by DMA."""

    shared = True

    def __init__(self, keep: int = 16):
        super().__init__(keep)
        self._slabs: dict[int, tuple[Slab, int, bool]] = {}  # buffer address -> (slab, inode, registered)

    def _allocate(self, size: int, pinned: bool) -> torch.Tensor:
        slab = Slab(size)
        t = torch.frombuffer(slab.mm, dtype=torch.uint8)
        registered = pinned and ipc.pin(t)
        with self._lock:
            self._slabs[t.data_ptr()] = (slab, os.fstat(slab.fd).st_ino, registered)
        return t

    def _free_buffer(self, buf: torch.Tensor) -> None:
        """Unpin it and close its memfd; the mapping goes with the buffer's last view."""
        with self._lock:
            slab, _, registered = self._slabs.pop(buf.data_ptr())
        if registered:
            ipc.unpin(buf)
        slab.close_fd()

    def place(self, view: memoryview) -> Place:
        """Where ``view`` (a slice of one of this pool's buffers) lies; ``ValueError`` if in none."""
        addr = np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else None
        with self._lock:
            for base, (slab, inode, _) in self._slabs.items():
                if addr is not None and base <= addr and addr + len(view) <= base + slab.size:
                    return Place(slab.path, inode, slab.size, addr - base)
        raise ValueError("the view lies in no shared staging buffer")


class _Reader:
    def __init__(self, ctx, opener) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, opener), daemon=True, name="kvf-reader")
        self.proc.start()
        child.close()


class ReadProcs:
    """``procs`` reader processes over the store ``opener`` opens; :meth:`read_into` is the
    blocking call an I/O thread makes (as :func:`kvfetcher.store.read_into`), for views of
    ``staging``'s buffers."""

    def __init__(self, opener: Callable[[], stores.Store], procs: int, staging: SharedStaging):
        if procs < 1:
            raise ValueError(f"reader processes must be at least one, not {procs}")
        self.opener, self.staging = opener, staging
        self._ctx = mp.get_context("spawn")
        self._idle: queue.Queue[_Reader] = queue.Queue()
        for _ in range(procs):
            self._idle.put(_Reader(self._ctx, opener))
        self.reads = 0  # reads answered (a count for tests and benchmarks)

    def read_into(self, name: str, offset: int, buf: memoryview) -> int:
        """Read ``[offset, offset + len(buf))`` of ``name`` into ``buf`` in a reader process; the
        bytes the object had there. Raises the store's error (a dead reader: Unavailable)."""
        if len(buf) == 0:
            return 0
        msg = Read(name, offset, len(buf), self.staging.place(buf))
        r = self._idle.get()
        try:
            r.conn.send(msg)
            reply = r.conn.recv()
        except (EOFError, OSError) as e:
            r.proc.kill()
            r = _Reader(self._ctx, self.opener)  # the replacement goes back to the pool
            raise stores.Unavailable(f"reader process died during a read of {name}: {e}") from e
        finally:
            self._idle.put(r)
        self.reads += 1
        if isinstance(reply, Failed):
            raise _error(reply)
        return reply.n

    def close(self) -> None:
        """Stop the readers and free the staging buffers (unpinned: a later pool may map the same
        addresses, which CUDA refuses to register twice)."""
        self.staging.close()
        while True:
            try:
                r = self._idle.get_nowait()
            except queue.Empty:
                return
            try:
                r.conn.send(None)
            except OSError:
                pass
            r.proc.join(2)
            if r.proc.is_alive():
                r.proc.kill()


def _error(f: Failed) -> Exception:
    """The caller's exception for a reader's failure: the store's own class where it is one."""
    cls = getattr(stores, f.error, None)
    if isinstance(cls, type) and issubclass(cls, stores.StoreError):
        return cls(f.message)
    return stores.StoreError(f"{f.error}: {f.message}")
