"""slab: shared memory between the sidecar's processes, named by a path only they can open."""

from __future__ import annotations

import mmap
import os


class Slab:
    """Shared memory between the sidecar and one of its worker processes (a decode worker reads a
    chunk's bytes from it, a reader process writes them into it): a memfd of the sidecar (``path``
    None creates one), which the worker opens by ``path``, ``/proc/<sidecar pid>/fd/<fd>``. No file
    in a shared directory: nothing another process can name, replace or shrink."""

    def __init__(self, size: int, path: str | None = None):
        self.fd = os.memfd_create("kvfetcher-slab", os.MFD_CLOEXEC) if path is None else None
        fd = self.fd if self.fd is not None else os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if self.fd is not None:
                os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        if self.fd is None:
            os.close(fd)  # the mapping keeps the memory
        self.path, self.size = path or f"/proc/{os.getpid()}/fd/{fd}", size

    def close(self) -> None:
        """Unmap; the sidecar's slab also closes its memfd (a worker's mapping stays valid)."""
        self.mm.close()
        self.close_fd()

    def close_fd(self) -> None:
        """Close the sidecar's memfd (no worker can open the slab any more); the mapping stays."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
