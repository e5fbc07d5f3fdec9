"""index: what a sidecar knows is stored, so that a lookup never waits on the store.

:class:`StoredIndex` maps a chunk key to its stored representations (preset -> object size) and
remembers keys found absent. It is filled from this sidecar's own writes and from listings of the
store (the lookup's background listing, a fetch's listing); it holds at most ``max_keys`` keys,
least recently used dropped first.

Contract: :meth:`StoredIndex.run` answers from memory only. A key found absent stays absent for
``negative_ttl_s`` seconds, after which the next lookup asks the store again: a chunk another
sidecar stores becomes visible here at most ``negative_ttl_s`` plus one listing after it was
written (immediately when this sidecar wrote it). A known representation stays known until a read
finds it missing (:meth:`forget`). Not thread-safe: the sidecar's event loop owns it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence

#: a key's entry: its representations (preset -> size), or the monotonic time its absence expires
_Entry = dict[str, int] | float


class StoredIndex:
    def __init__(self, max_keys: int = 1 << 20, negative_ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        if max_keys < 1 or not negative_ttl_s >= 0:
            raise ValueError(f"an index needs max_keys >= 1 and negative_ttl_s >= 0, not {max_keys}, {negative_ttl_s}")
        self.max_keys, self.negative_ttl_s, self.clock = max_keys, negative_ttl_s, clock
        self._keys: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def run(self, chunk_keys: Sequence[str]) -> tuple[list[dict[str, int]], bool]:
        """The leading run of ``chunk_keys`` known stored (each its representations), and whether
        that run is known to end there: True when it covers every key or stops at a key known
        absent; False when it stops at a key the index does not know (or no longer trusts absent)."""
        run, now = [], self.clock()
        for key in chunk_keys:
            entry = self._keys.get(key)
            if isinstance(entry, dict):
                self._keys.move_to_end(key)
                run.append(entry)
                continue
            return run, entry is not None and entry > now
        return run, True

    def listed(self, chunk_keys: Sequence[str], run: Sequence[Mapping[str, int]]) -> None:
        """Record a listing of ``chunk_keys`` from its first key: ``run`` is the leading run found
        stored; the key after it, if any, was found absent."""
        for key, reps in zip(chunk_keys, run):
            self._put(key, dict(reps))
        if len(run) < len(chunk_keys):
            self._put(chunk_keys[len(run)], self.clock() + self.negative_ttl_s)

    def stored(self, key: str, preset: str, size: int) -> None:
        """This sidecar wrote (or found) ``preset`` of chunk ``key``, of ``size`` bytes."""
        entry = self._keys.get(key)
        self._put(key, {**(entry if isinstance(entry, dict) else {}), preset: size})

    def forget(self, keys: Iterable[str]) -> None:
        """What is known of ``keys`` is no longer true (an object went missing or was deleted)."""
        for key in keys:
            self._keys.pop(key, None)

    def _put(self, key: str, entry: _Entry) -> None:
        self._keys[key] = entry
        self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
