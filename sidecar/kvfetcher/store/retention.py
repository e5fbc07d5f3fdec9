"""retention: which stored chunks to keep — a pure index of the stored prefix tree — and
:func:`enforce`, which applies it to a store.

The policy. Every stored chunk is a block of a prefix tree (its parent is the chunk before it in
its prompt). A fetch reads a prefix's chunks from the first and stops at the first one missing, so
a block whose parent is gone is worth nothing, and removing a block that still has a stored child
would waste the child. Hence:

- only *leaves* (blocks with no stored child) are candidates; a parent becomes one when its last
  child goes, so eviction never makes a hole in the middle of a prefix;
- among leaves, the least recently used goes first (``used``: the last fetch, or the creation),
  the deepest first among equal times; *dead* blocks (an orphan whose parent is not stored, an
  object that cannot be read) go before all others;
- over ``max_bytes`` leaves go until the total fits; past ``ttl_s`` every leaf not used within
  ``ttl_s`` goes, and so, in turn, its parents that became leaves and are as old.

A block's size is the sum of all its representations (one object per preset); removing it removes
them all. :class:`Index` keeps the leaves in a heap with lazy invalidation (an entry is stale when
its block changed since it was pushed), so each operation is O(log n) amortised. It imports no
torch: the trace replay (``benchmarks/fleet``) drives it with a simulated clock.

Enforcement (:func:`enforce`, :class:`Evictor`) rebuilds the index from a store listing, the
chunks' headers (parent link and depth, read once per chunk and cached) and the sidecars' access
logs (:mod:`kvfetcher.store.access`), then deletes the victims' objects, children before parents.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from kvfetcher.store import NotFound, Stat, Store, StoreError, access

DEAD, LIVE = 0, 1  # heap ranks: dead blocks go first
#: an orphan younger than this is not dead yet: a listing that is not a snapshot may see a chunk
#: written after its parent but not the parent (or the parent's header read may have raced)
ORPHAN_GRACE_S = 600.0
HEADER_BYTES = 8192  # one ranged GET usually covers a chunk's prefix and header
HEADER_READERS = 16  # header GETs in flight while indexing new chunks


@dataclass
class Block:
    """One stored chunk: all of its representations together."""

    key: str
    parent: str | None  # the previous chunk's key; None for a prompt's first chunk (or unknown)
    depth: int  # chunks before it in its prompt
    size: int  # bytes of all its representations
    created: float
    used: float  # last fetched, else ``created``
    dead: bool = False
    children: int = 0  # stored children

    def rank(self) -> tuple:
        return (DEAD if self.dead else LIVE, self.used, -self.depth)


class Index:
    """The stored prefix tree and its eviction order (see the module doc)."""

    def __init__(self) -> None:
        self.blocks: dict[str, Block] = {}
        self.total = 0  # bytes of all blocks
        self._heap: list[tuple] = []  # (rank..., key) of leaves, some stale

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, key: str) -> bool:
        return key in self.blocks

    def add(self, key: str, parent: str | None, size: int, created: float, *, used: float | None = None,
            depth: int = 0, dead: bool = False) -> Block:
        """Index a block (parents before their children: a parent not indexed is not linked).
        Adding a key again changes only its size (a representation was added or removed)."""
        b = self.blocks.get(key)
        if b is not None:
            self.total += size - b.size
            b.size = size
            return b
        b = Block(key, parent, depth, size, created, max(created, used or created), dead)
        self.blocks[key] = b
        self.total += size
        p = self.blocks.get(parent) if parent else None
        if p is not None:
            p.children += 1
        self._push(b)
        return b

    def touch(self, key: str, t: float) -> None:
        """Record a fetch of ``key`` at ``t`` (an earlier time than the last one changes nothing)."""
        b = self.blocks.get(key)
        if b is not None and t > b.used:
            b.used = t
            if b.children == 0:
                self._push(b)

    def _push(self, b: Block) -> None:
        heapq.heappush(self._heap, (*b.rank(), b.key))
        if len(self._heap) > 4 * len(self.blocks) + 64:  # mostly stale: rebuild from the leaves
            self._heap = [(*x.rank(), x.key) for x in self.blocks.values() if x.children == 0]
            heapq.heapify(self._heap)

    def _current(self, entry: tuple) -> Block | None:
        b = self.blocks.get(entry[-1])
        return b if b is not None and b.children == 0 and entry[:-1] == b.rank() else None

    def peek(self) -> Block | None:
        """The next block to evict (None: the index is empty)."""
        while self._heap:
            b = self._current(self._heap[0])
            if b is not None:
                return b
            heapq.heappop(self._heap)
        return None

    def remove(self, key: str) -> Block:
        """Drop a leaf (``ValueError`` for a block that still has a stored child)."""
        b = self.blocks[key]
        if b.children:
            raise ValueError(f"{key} still has {b.children} stored children")
        del self.blocks[key]
        self.total -= b.size
        p = self.blocks.get(b.parent) if b.parent else None
        if p is not None:
            p.children -= 1
            if p.children == 0:
                self._push(p)
        return b

    def due(self, b: Block, max_bytes: int | None, horizon: float | None) -> bool:
        """Whether the leaf ``b`` must go: it is dead, unused since ``horizon``, or the total is over ``max_bytes``."""
        return b.dead or (horizon is not None and b.used < horizon) or (max_bytes is not None and self.total > max_bytes)

    def victims(self, max_bytes: int | None = None, ttl_s: float | None = None, now: float | None = None) -> Iterator[Block]:
        """Remove and yield, in order, the blocks that must go: dead ones, those not used within
        ``ttl_s`` before ``now``, then the least recently used until the total is at most ``max_bytes``."""
        horizon = None if ttl_s is None else (time.time() if now is None else now) - ttl_s
        while (b := self.peek()) is not None and self.due(b, max_bytes, horizon):
            yield self.remove(b.key)


@dataclass
class EvictionReport:
    """What one :func:`enforce` run found and did."""

    chunks: int = 0  # chunks listed
    bytes: int = 0  # their bytes, all representations
    evicted_chunks: int = 0
    evicted_bytes: int = 0
    evicted_objects: int = 0
    dead_chunks: int = 0  # evicted for being unreachable or unreadable
    expired_chunks: int = 0  # evicted for being past the TTL
    kept_chunks: int = 0
    kept_bytes: int = 0
    access_logs: int = 0  # sidecar access logs merged
    headers_read: int = 0
    errors: list[str] = field(default_factory=list)  # failures that stopped or skipped part of the run
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Meta:
    """What a chunk's header says about its place in the tree (immutable: the key names the content)."""

    parent: str | None
    depth: int
    readable: bool = True


def _read_meta(store: Store, name: str) -> _Meta:
    """The parent link and depth of the chunk whose object is ``name``, from its header."""
    from kvfetcher.format import container  # torch: only enforcement reads headers, never the policy

    head = store.get(name, 0, HEADER_BYTES)
    try:
        need = container.header_length(head[: container.PREFIX_SIZE])
        if len(head) < need:
            head += store.get(name, len(head), need - len(head))
        h = container.parse_header(head)  # tags are not checked: a parent link decides only an eviction order
    except container.FutureVersionError:  # a newer sidecar's chunk (a rolling upgrade): kept, as a root
        return _Meta(None, 0)
    except container.ContainerError:  # no reader can use it: an older layout, damage
        return _Meta(None, 0, readable=False)
    parent = h.meta.get("parent")
    return _Meta(parent if isinstance(parent, str) and parent else None, h.start // max(1, h.shape[3]))


def chunk_objects(store: Store) -> dict[str, dict[str, Stat]]:
    """Every chunk in ``store``: key -> its objects (one per representation) with size and time."""
    chunks: dict[str, dict[str, Stat]] = {}
    for name, st in store.scan("kv/").items():
        if (key := access.chunk_key(name)) is not None:
            chunks.setdefault(key, {})[name] = st
    return chunks


class Evictor:
    """Enforcement against one store. Keeps what never changes between runs (each chunk's parent
    link and depth: a key names its content) and the merged fetch times, so that a long-running
    evictor reads each chunk's header once."""

    def __init__(self, store: Store):
        self.store = store
        self.meta: dict[str, _Meta] = {}
        self.used: dict[str, float] = {}

    def enforce(self, max_bytes: int | None, ttl_s: float | None, now: float | None = None) -> EvictionReport:
        """One run: list, learn new chunks' headers, merge the access logs, delete what must go,
        compact the logs. A store error ends the run, reported in ``errors``; so does a header that
        could not be read, before anything is deleted (that chunk's parent is unknown and might look
        like a leaf)."""
        t0, now = time.perf_counter(), time.time() if now is None else now
        report = EvictionReport()
        try:
            objects = chunk_objects(self.store)
            logs = access.merge_logs(self.store, self.used)
            report.access_logs = len(logs)
            self._learn(objects, report)
            index = self._index(objects, now)
            report.chunks, report.bytes = report.kept_chunks, report.kept_bytes = len(index), index.total
            if not report.errors:
                self._evict(index, objects, report, max_bytes, None if ttl_s is None else now - ttl_s)
            for key in set(self.used) - set(objects):  # gone otherwise (e.g. a bad object dropped by a fetch)
                del self.used[key]
            access.compact(self.store, self.used, logs)
        except StoreError as e:  # children go before parents: stopping anywhere leaves no hole
            report.errors.append(f"{type(e).__name__}: {e}")
        report.seconds = time.perf_counter() - t0
        return report

    def _evict(self, index: Index, objects: dict[str, dict[str, Stat]], report: EvictionReport,
               max_bytes: int | None, horizon: float | None) -> None:
        """Delete every representation of each block due, in the index's order."""
        while (b := index.peek()) is not None and index.due(b, max_bytes, horizon):
            for name in objects[b.key]:  # a fetch in between sees the chunk or a clean miss
                self.store.delete(name)
                report.evicted_objects += 1
            index.remove(b.key)
            self.used.pop(b.key, None)
            report.evicted_chunks, report.evicted_bytes = report.evicted_chunks + 1, report.evicted_bytes + b.size
            report.dead_chunks += b.dead
            report.expired_chunks += not b.dead and horizon is not None and b.used < horizon
            report.kept_chunks, report.kept_bytes = len(index), index.total

    def _learn(self, objects: dict[str, dict[str, Stat]], report: EvictionReport) -> None:
        """Read the header of every chunk not seen before (one representation each, in parallel)."""
        for key in set(self.meta) - set(objects):
            del self.meta[key]
        new = [(k, min(reps)) for k, reps in objects.items() if k not in self.meta]

        def read(item: tuple[str, str]) -> tuple[str, _Meta | None]:
            key, name = item
            try:
                return key, _read_meta(self.store, name)
            except NotFound:  # deleted since the listing
                return key, None
            except StoreError as e:
                report.errors.append(f"header of {name}: {e}")
                return key, None

        if new:
            with ThreadPoolExecutor(HEADER_READERS, thread_name_prefix="kvf-evict") as pool:
                for key, m in pool.map(read, new):
                    if m is not None:
                        self.meta[key] = m
                        report.headers_read += 1

    def _index(self, objects: dict[str, dict[str, Stat]], now: float) -> Index:
        """The index of the listed chunks whose header is known, parents first."""
        index = Index()
        for key in sorted((k for k in objects if k in self.meta), key=lambda k: self.meta[k].depth):
            m, reps = self.meta[key], objects[key].values()
            created = min(st.modified for st in reps)
            parent = index.blocks.get(m.parent) if m.parent else None
            # unreachable: under a dead parent, or an orphan (its parent is not stored) old enough
            dead = not m.readable or (parent.dead if parent else m.parent is not None and created < now - ORPHAN_GRACE_S)
            index.add(key, m.parent, sum(st.size for st in reps), created, used=self.used.get(key), depth=m.depth, dead=dead)
        return index


def enforce(store: Store, max_bytes: int | None, ttl_s: float | None, now: float | None = None) -> EvictionReport:
    """Evict from ``store`` what :class:`Index` says must go to fit ``max_bytes`` and ``ttl_s``
    (None: no bound) at ``now`` (default: the clock); see the module doc. Safe beside sidecars that
    fetch and store: a chunk's objects go only once it has no stored child, so a fetch sees either
    the chunk or a clean miss of it and everything after."""
    return Evictor(store).enforce(max_bytes, ttl_s, now)
