"""reader_proc: a reader process's side of :mod:`kvfetcher.fetch.readers` (no torch: it starts fast).

It opens the store with the opener it is given, then answers :class:`Read` messages (a range of
an object into a place of a shared staging buffer) with :class:`Done` or :class:`Failed` until it
is sent ``None``. Buffers are mapped by path once and recognised by inode: a path may name
another memfd later.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from kvfetcher import store as stores
from kvfetcher.fetch.slab import Slab


@dataclass(frozen=True)
class Place:
    """Where bytes go in a :class:`SharedStaging` buffer: the memfd's path and inode (a path can
    name another memfd later), its size and an offset in it."""

    path: str
    inode: int
    size: int
    at: int


@dataclass(frozen=True)
class Read:
    name: str
    offset: int
    length: int
    into: Place


@dataclass(frozen=True)
class Done:
    n: int


@dataclass(frozen=True)
class Failed:
    error: str  # the StoreError subclass's name (or another exception's)
    message: str


def serve(conn, opener: Callable[[], stores.Store]) -> None:
    """A reader process: open the store, then answer :class:`Read` messages until ``None``."""
    store = opener()
    maps: dict[tuple[str, int], Slab] = {}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        try:
            conn.send(Done(_read(store, maps, msg)))
        except Exception as e:  # noqa: BLE001 — every failure goes back to the caller, typed by name
            conn.send(Failed(type(e).__name__, str(e)))


def _read(store: stores.Store, maps: dict[tuple[str, int], Slab], r: Read) -> int:
    key = (r.into.path, r.into.inode)
    if key not in maps:
        slab = Slab(r.into.size, r.into.path)
        if os.stat(r.into.path).st_ino != r.into.inode:  # the path names another memfd now
            slab.close()
            raise stores.StoreError(f"staging buffer {r.into.path} is gone")
        if len(maps) >= 64:  # buffers come and go: keep the mappings bounded
            for s in maps.values():
                s.close()
            maps.clear()
        maps[key] = slab
    view = memoryview(maps[key].mm)[r.into.at : r.into.at + r.length]
    try:
        return stores.read_into(store, r.name, r.offset, view)
    finally:
        view.release()
