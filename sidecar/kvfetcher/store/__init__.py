"""store: where chunk objects live, behind one small, blocking interface.

Backends: :class:`~.local.LocalStore` (a directory; the embedded default) and
:class:`~.s3.S3Store` (any S3-compatible service through the ``minio`` SDK). Both write
atomically (no partial object is ever visible), treat re-storing an existing object as a
no-op, and serve byte ranges. Calls block; the fetch pipeline runs them in a thread pool.

``get_into`` (optional) reads a range straight into a caller's buffer — the fetch pipeline's
direct path lands raw KV in reusable (pinned) host memory without an intermediate ``bytes``;
:func:`read_into` falls back to ``get`` plus one copy for a store without it.
"""

from __future__ import annotations

import errno
from collections.abc import Mapping
from typing import NamedTuple, Protocol
from urllib.parse import urlparse

import numpy as np

from kvfetcher import config
from kvfetcher.errors import Reason


class StoreError(RuntimeError):
    """A store operation failed; ``reason`` is the metrics label."""

    reason = Reason.STORE_ERROR


class NotFound(StoreError):
    reason = Reason.MISSING


class Unavailable(StoreError):
    """The store cannot be reached (down, refused, timed out)."""

    reason = Reason.STORE_DOWN


class StoreFull(StoreError):
    """The store has no room for a write (disk full, quota)."""

    reason = Reason.STORE_FULL


class ReadOnly(StoreError):
    """The store refuses writes (read-only file system, no permission)."""

    reason = Reason.STORE_READ_ONLY


_OS_ERRORS: dict[int, type[StoreError]] = {
    errno.ENOENT: NotFound, errno.ENOSPC: StoreFull, errno.EDQUOT: StoreFull, errno.EFBIG: StoreFull,
    errno.EROFS: ReadOnly, errno.EACCES: ReadOnly, errno.EPERM: ReadOnly,
}


def from_os_error(e: OSError, what: str) -> StoreError:
    """The typed :class:`StoreError` of an ``OSError`` raised while doing ``what``: a store never
    lets an ``OSError`` out, so every caller handles one exception type with a reason."""
    return _OS_ERRORS.get(e.errno, StoreError)(f"{what}: {e.strerror or e}")


class Stat(NamedTuple):
    """An object's size and last modification (Unix seconds) as a listing gives them."""

    size: int
    modified: float


class Store(Protocol):
    #: names the endpoint for the throughput estimator (one estimate per endpoint)
    endpoint: str

    def put(self, name: str, data: bytes) -> bool:
        """Store ``data`` atomically; False (and nothing written) if ``name`` already exists."""
        ...

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[offset, offset + length)`` (to the end when ``length`` is None); may be short at the end."""
        ...

    def list(self, prefix: str) -> dict[str, int]:
        """Objects under ``prefix``: name -> size."""
        ...

    def scan(self, prefix: str) -> dict[str, Stat]:
        """Objects under ``prefix`` with their sizes and modification times (the evictor's listing)."""
        ...

    def exists(self, name: str) -> bool: ...

    def delete(self, name: str) -> None: ...

    def ping(self) -> None:
        """Raise a :class:`StoreError` unless the store answers and, where the backend can tell
        cheaply, accepts writes (readiness: :class:`StoreFull`, :class:`ReadOnly`)."""
        ...

    # Optional: ``get_into(name, offset, buf) -> int`` reads bytes ``[offset, offset + len(buf))``
    # into the writable buffer ``buf`` and returns how many it read (fewer at the object's end).
    # Not part of the Protocol, so that stores without it still satisfy it; see read_into.


def fill(readinto, buf: memoryview) -> int:
    """Call ``readinto`` until ``buf`` is full or the stream ends; the number of bytes read."""
    n = 0
    while n < len(buf):
        k = readinto(buf[n:])
        if not k:
            break
        n += k
    return n


def read_into(store: Store, name: str, offset: int, buf: memoryview) -> int:
    """Read ``[offset, offset + len(buf))`` of ``name`` into ``buf``; the number of bytes read.

    Uses the store's ``get_into`` where it has one (no intermediate copy), else ``get`` and a copy.
    """
    direct = getattr(store, "get_into", None)
    if direct is not None:
        return direct(name, offset, buf)
    data = store.get(name, offset, len(buf))
    n = min(len(data), len(buf))
    # numpy copies without the GIL (a memoryview assignment holds it: the event loop would stall)
    np.frombuffer(buf, dtype=np.uint8, count=n)[:] = np.frombuffer(data, dtype=np.uint8, count=n)
    return n


def from_env(env: Mapping[str, str] | None = None, *, record_access: bool = False) -> Store:
    """The store the environment names (default: the process environment): S3 when
    ``KVFETCHER_S3_ENDPOINT`` is set, else the local directory ``KVFETCHER_STORE_DIR``. With
    ``record_access`` (a serving sidecar's store) and ``KVFETCHER_ACCESS_LOG_S`` above 0 it records
    the chunks it serves in access logs (:mod:`.access`) for the evictor."""
    endpoint = config.S3_ENDPOINT.read(env)
    store = _s3(endpoint, config.S3_BUCKET.read(env), env) if endpoint else _local(config.STORE_DIR.read(env))
    flush_s = config.ACCESS_LOG_S.read(env)
    if record_access and flush_s > 0:
        from kvfetcher.store.access import Recorder

        return Recorder(store, flush_s)
    return store


def from_url(url: str, env: Mapping[str, str] | None = None) -> Store:
    """The store at ``url``: ``http(s)://host[:port]/bucket`` (S3, with the credentials and TLS
    settings of the environment's ``KVFETCHER_S3_*``), ``file:///dir`` or a directory path."""
    u = urlparse(url)
    if u.scheme in ("http", "https"):
        bucket = u.path.strip("/")
        if not bucket or "/" in bucket:
            raise ValueError(f"an S3 store URL names one bucket, http(s)://host[:port]/bucket: {url!r}")
        return _s3(f"{u.scheme}://{u.netloc}", bucket, env)
    if u.scheme in ("", "file"):
        return _local(u.path if u.scheme else url)
    raise ValueError(f"unknown store URL scheme {u.scheme!r} in {url!r} (http, https, file or a path)")


def _s3(endpoint: str, bucket: str, env: Mapping[str, str] | None) -> Store:
    from kvfetcher.store.s3 import S3Store  # the minio SDK only where S3 is used

    return S3Store(
        endpoint,
        bucket,
        config.S3_ACCESS_KEY.read(env),
        config.S3_SECRET_KEY.read(env),
        region=config.S3_REGION.read(env),
        ca_file=config.S3_CA_FILE.read(env),
        verify_tls=not config.S3_INSECURE.read(env),
        read_timeout_s=config.DEADLINE_S.read(env),  # a stalled read ends with the request it serves
    )


def _local(path: str) -> Store:
    from kvfetcher.store.local import LocalStore

    return LocalStore(path)


__all__ = ["Stat", "Store", "StoreError", "NotFound", "Unavailable", "StoreFull", "ReadOnly", "fill", "from_env", "from_os_error", "from_url", "read_into"]
