"""A directory as a store: the embedded default, and the simplest correct backend.

Atomicity: each object is written to a temporary file in the same directory, flushed, and
renamed over its name (``os.replace`` is atomic on POSIX), so readers see all or nothing.
Every ``OSError`` of the file system leaves as its typed :class:`~kvfetcher.store.StoreError`
(:func:`~kvfetcher.store.from_os_error`): a full disk is :class:`StoreFull`, a read-only one
:class:`ReadOnly`, and :meth:`LocalStore.ping` writes a probe so that readiness sees both.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from pathlib import Path

from kvfetcher.store import NotFound, Stat, StoreError, fill, from_os_error

PROBE_BYTES = 4096  # what ping writes: a full or read-only file system refuses it


def _typed(method):
    """Turn the ``OSError``s of a store method into typed store errors."""

    @functools.wraps(method)
    def call(self, name: str, *args):
        try:
            return method(self, name, *args)
        except OSError as e:
            raise from_os_error(e, f"{method.__name__} {name!r}") from e

    return call


class LocalStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.endpoint = f"file://{self.root}"

    def opener(self):
        """A picklable call that opens this store again (in another process)."""
        return functools.partial(LocalStore, self.root)

    def _path(self, name: str) -> Path:
        p = (self.root / name).resolve()
        if not p.is_relative_to(self.root.resolve()):
            raise StoreError(f"object name {name!r} escapes the store")
        return p

    @_typed
    def put(self, name: str, data: bytes) -> bool:
        path = self._path(name)
        if path.exists():
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return True

    @_typed
    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        with open(self._path(name), "rb") as f:
            f.seek(offset)
            return f.read() if length is None else f.read(length)

    @_typed
    def get_into(self, name: str, offset: int, buf: memoryview) -> int:
        """Read into ``buf`` (``readinto``: the page cache is copied once, into the caller's memory)."""
        with open(self._path(name), "rb", buffering=0) as f:
            f.seek(offset)
            return fill(f.readinto, buf)

    def list(self, prefix: str) -> dict[str, int]:
        return {name: st.size for name, st in self.scan(prefix).items()}

    @_typed
    def scan(self, prefix: str) -> dict[str, Stat]:
        base = self._path(prefix) if prefix.endswith("/") else self._path(prefix).parent
        if not base.is_dir():
            return {}
        out = {}
        for p in base.rglob("*"):
            name = p.relative_to(self.root).as_posix()
            if not p.name.startswith(".tmp-") and name.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):  # deleted while listing
                    if p.is_file():
                        st = p.stat()
                        out[name] = Stat(st.st_size, st.st_mtime)
        return out

    @_typed
    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    @_typed
    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def ping(self) -> None:
        if not self.root.is_dir():
            raise StoreError(f"store directory {self.root} is gone")
        try:
            with tempfile.NamedTemporaryFile(dir=self.root, prefix=".tmp-ping-") as f:
                f.write(bytes(PROBE_BYTES))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise from_os_error(e, f"writing to {self.root}") from e


__all__ = ["LocalStore", "NotFound"]
