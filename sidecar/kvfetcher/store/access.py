"""access: when each stored chunk was last fetched, without a store write per fetch.

A sidecar's store is wrapped in :class:`Recorder`: a fetch reads every chunk's header with a GET at
offset 0, and the recorder notes that chunk's key and the time in memory. Every ``flush_s`` seconds
a background thread writes what it noted as one small object, an *access log*, at
``kv/_meta/access/<writer>/<time_ns>.json`` (under ``kv/``, where the sidecars' scoped credentials
may write and the pool's clean-up reaches). So the hot path costs a dictionary update, and the
store sees one PUT per sidecar per interval however many fetches there were.

Why not S3 object metadata: updating it means a copy of the object (a write per fetch, of the whole
object on some servers) and a HEAD per chunk to read it back, and a local store has none. Why not
object access times: S3 has none, and file systems are commonly mounted ``noatime``. What a sidecar
noted and had not flushed is lost if it dies: its chunks then look as old as their last flushed
fetch, which costs at most an early eviction, never a wrong answer.

The evictor (:mod:`kvfetcher.store.retention`) merges every log into its table of last fetches
(:func:`merge_logs`), writes that table back as one log of its own and deletes the logs it merged
(:func:`compact`), so the logs stay few however long the pool runs.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable

from kvfetcher.store import NotFound, Store, StoreError

log = logging.getLogger("kvfetcher.store.access")

PREFIX = "kv/_meta/access/"
COMPACTED = "evictor"  # the writer name of the evictor's merged table


def chunk_key(name: str) -> str | None:
    """The chunk key of an object name ``kv/<key[:2]>/<key>/<preset>.kvfc`` (None: not a chunk object)."""
    parts = name.split("/")
    if len(parts) != 4 or parts[0] != "kv" or not parts[3].endswith(".kvfc") or parts[2][:2] != parts[1] or len(parts[2]) < 3:
        return None
    return parts[2]


class Recorder:
    """A store that notes, in memory, the chunks whose header it served (a GET at offset 0 of a
    chunk object), and flushes them as an access log every ``flush_s`` seconds from a daemon
    thread. Everything else passes through to ``store`` unchanged."""

    def __init__(self, store: Store, flush_s: float, writer: str | None = None):
        self.store, self.flush_s = store, flush_s
        self.writer = writer or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvf-access-log", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # a sidecar stopped gracefully writes its last records

    def __getattr__(self, name: str):  # put, list, exists, delete, ping, get_into, endpoint, ...
        return getattr(self.store, name)

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        data = self.store.get(name, offset, length)
        if offset == 0 and (key := chunk_key(name)) is not None:
            with self._lock:
                self._seen[key] = time.time()
        return data

    def flush(self) -> int:
        """Write what was noted since the last flush as one access log; the number of chunks in it.
        A failed write keeps them for the next flush."""
        with self._lock:
            seen, self._seen = self._seen, {}
        if not seen:
            return 0
        try:
            write_log(self.store, self.writer, seen)
        except StoreError as e:
            log.warning("access log not written (kept for the next flush): %s", e)
            with self._lock:
                for k, t in seen.items():
                    self._seen[k] = max(t, self._seen.get(k, 0.0))
            return 0
        return len(seen)

    def close(self) -> None:
        """Stop the thread and flush what is left (once)."""
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self.flush()
            atexit.unregister(self.close)

    def _run(self) -> None:
        while not self._stop.wait(self.flush_s):
            self.flush()


def write_log(store: Store, writer: str, fetched: dict[str, float]) -> str:
    """Put one access log of ``writer``: chunk key -> last fetch (Unix seconds). Its name."""
    name = f"{PREFIX}{writer}/{time.time_ns()}.json"
    store.put(name, json.dumps({"fetched": fetched}, separators=(",", ":")).encode())
    return name


def merge_logs(store: Store, used: dict[str, float]) -> list[str]:
    """Merge every access log in ``store`` into ``used`` (chunk key -> last fetch, the later time
    wins); the names of the logs merged. A log that is not one (malformed) is skipped and counted
    as merged, so that :func:`compact` removes it."""
    names = sorted(store.list(PREFIX))
    for name in names:
        try:
            fetched = json.loads(store.get(name))["fetched"]
            for k, t in fetched.items():
                if isinstance(k, str) and isinstance(t, (int, float)) and t > used.get(k, 0.0):
                    used[k] = float(t)
        except NotFound:
            continue
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("skipping malformed access log %s: %s", name, e)
    return names


def compact(store: Store, used: dict[str, float], merged: Iterable[str]) -> None:
    """Replace the logs ``merged`` (already in ``used``) by one log holding all of ``used``.
    Written before anything is deleted: a failure in between leaves a duplicate, never a loss."""
    merged = list(merged)
    if not merged or (len(merged) == 1 and merged[0].startswith(f"{PREFIX}{COMPACTED}/")):
        return  # nothing, or only the last compacted table: nothing new to write
    if used:
        write_log(store, COMPACTED, used)
    for name in merged:
        store.delete(name)
