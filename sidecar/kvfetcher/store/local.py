"""A directory as a store: the embedded default, and the simplest correct backend.

Atomicity: each object is written to a temporary file in the same directory, flushed, and
renamed over its name (``os.replace`` is atomic on POSIX), so readers see all or nothing.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from kvfetcher.store import NotFound, StoreError, fill


class LocalStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.endpoint = f"file://{self.root}"

    def _path(self, name: str) -> Path:
        p = (self.root / name).resolve()
        if not p.is_relative_to(self.root.resolve()):
            raise StoreError(f"object name {name!r} escapes the store")
        return p

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
            os.unlink(tmp)
            raise
        return True

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        try:
            with open(self._path(name), "rb") as f:
                f.seek(offset)
                return f.read() if length is None else f.read(length)
        except FileNotFoundError:
            raise NotFound(f"no object {name!r}") from None

    def get_into(self, name: str, offset: int, buf: memoryview) -> int:
        """Read into ``buf`` (``readinto``: the page cache is copied once, into the caller's memory)."""
        try:
            with open(self._path(name), "rb", buffering=0) as f:
                f.seek(offset)
                return fill(f.readinto, buf)
        except FileNotFoundError:
            raise NotFound(f"no object {name!r}") from None

    def list(self, prefix: str) -> dict[str, int]:
        base = self._path(prefix) if prefix.endswith("/") else self._path(prefix).parent
        if not base.is_dir():
            return {}
        out = {}
        for p in base.rglob("*"):
            name = p.relative_to(self.root).as_posix()
            if p.is_file() and not p.name.startswith(".tmp-") and name.startswith(prefix):
                out[name] = p.stat().st_size
        return out

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def ping(self) -> None:
        if not self.root.is_dir():
            raise StoreError(f"store directory {self.root} is gone")
