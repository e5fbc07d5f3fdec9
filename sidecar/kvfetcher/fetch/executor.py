"""executor: fetch chunks from a store straight into KV buffers, as overlapping stages.

Per chunk: one ranged GET for the prefix + header (+ side information, usually in the same
bytes), then one ranged GET per segment still missing; an entropy-coded chunk of a known size of at
most :data:`WHOLE_OBJECT_BYTES` is read in one GET instead, header and parts, into its staging buffer
(the header, checked, then says where its parts lie there). Once every part is there the chunk is
restored (:mod:`chunk`): by a decode worker process (:mod:`fetch.workers`), or here — verified and
decoded in one call in the decode pool, then written. Up to ``window`` chunks are in flight at
once (memory stays ``window`` chunks however long the prefix), so a long prefix streams: chunk 0
is being restored while chunk 3 downloads.

Direct path: a chunk stored in the ``native`` layout without a codec (the ``raw`` preset;
:func:`container.is_native`) is the KV buffer's own bytes. Its segments are read with ranged
GETs straight into one host staging buffer (:mod:`fetch.staging`: reused, pinned when the
destination is on a GPU), each checksummed by the thread that read it, and once all have
verified the chunk is copied into the destination by one non-blocking host-to-device copy — no
decoder, no worker process, no reshuffle (into a paged destination: that copy, then one scatter
into its blocks on the device), in a write thread (``write_pool``). The chunk counts as written only
once that copy has completed. Each segment is also checked for NaN and infinities there.

Entropy-coded chunks (``zstd``, ``ans``) are staged the same way: side information and segment
read into one staging buffer, each part checksummed by the thread that read it. Where decode
workers can map that buffer (the reader processes' shared staging) and the KV buffer, one of them
restores the chunk from it in place (nvCOMP on the GPU's SMs, then the unpack), each worker with a
GIL of its own; otherwise it is decoded in the decode pool straight from that buffer (one copy to
the GPU, the decode), then unpacked into the buffer by a decode thread too (docs/architecture.md
says why not by the write pool).

Engine-decode mode: into an :class:`~kvfetcher.kvbuffer.ObjectArena` (a host buffer of an engine
that decodes itself) a chunk is not decoded: its parts are read and checked as above, then the
whole object (header and payload) is copied to its place in the arena, as a write is.

Authentication: with ``object_key`` (:mod:`format.mac`), every object's header tag is verified
for the name it was read from before its header is trusted, and every part's tag with its CRC-32
(by the thread that read it, a decode worker, or the decode pool) before anything is decoded.
Without it, whoever can write the store can craft an object with right CRC-32s: unless the caller
trusts the store (``trust_store``), its bytes go only to decoders that validate their input
(:func:`codec.decoder`'s ``trusted``; ``ans`` is then not read).

Failure semantics: the result is the longest run of *leading* chunks that were written; the
caller recomputes the rest. On the first failure, at the deadline or on cancellation, the chunks
still in flight are abandoned — except a write already started, which is awaited, so nothing
touches the buffers after :func:`fetch` returns. Nothing unverified is ever written. The failure's
reason is an :class:`errors.Reason`; an object that is itself bad (:data:`errors.BAD_OBJECT`) is
named in :attr:`Outcome.bad_object` so that the caller can delete it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvfetcher import chunk, config, keys
from kvfetcher.codec import ENTROPY_FORMATS, CodecError
from kvfetcher.errors import BAD_OBJECT, ContainerError, Reason, TruncatedError
from kvfetcher.fetch import staging
from kvfetcher.fetch.readers import ReadProcs
from kvfetcher.fetch.workers import BufferOpenError, DecodeWorkers, WorkerError
from kvfetcher.format import container
from kvfetcher.format.mac import ObjectMAC
from kvfetcher.format.presets import PRESETS
from kvfetcher.kvbuffer import ChunkRef, Destination, ObjectArena
from kvfetcher.store import Store, StoreError, read_into

log = logging.getLogger("kvfetcher.fetch.executor")

HEADER_GUESS = 64 * 1024  # one GET usually covers prefix, header and side information
#: an entropy-coded object of at most this size (as listed) is read whole in one GET: one request a
#: chunk rather than three (header, side information, segment), the header no longer a round trip of its own
WHOLE_OBJECT_BYTES = 64 << 20


@dataclass
class Outcome:
    loaded_tokens: int  # leading tokens now in the buffers
    requested_tokens: int
    error: Reason | None = None  # reason of the failure that stopped the fetch (None: all loaded)
    detail: str | None = None
    bytes_read: int = 0
    kv_bytes: int = 0  # bytes of KV restored
    seconds: float = 0.0
    read_busy_s: float = 0.0  # time with at least one GET in flight
    decode_busy_s: float = 0.0  # time with at least one decode in flight
    header_latency_s: list[float] = field(default_factory=list)
    bad_object: str | None = None  # an object that is corrupt, truncated or foreign: drop it
    bad_size: int | None = None  # its size as the plan listed it (not dropped if it changed since)
    direct_chunks: int = 0  # chunks restored by the direct path (native raw: read, checksum, one copy)
    timeline: list[tuple[int, str, float]] = field(default_factory=list)  # (chunk, stage it reached, seconds into the fetch): STAGES


#: the stages of a chunk's :attr:`Outcome.timeline`, in order: the window admitted it, its header was
#: checked, every part was read and checked, it was decoded (not for the direct path, nor where a
#: worker process decodes and writes at once), a thread started its write (a write thread; a decode
#: thread for an entropy-coded chunk's unpack; not for a worker process's), its write completed
STAGES = ("admitted", "header", "read", "decoded", "started", "written")


def stage_summary(timeline: Sequence[tuple[int, str, float]], wall_s: float) -> dict[str, dict[str, float]]:
    """Per stage of :data:`STAGES`, what the chunks of a fetch's ``timeline`` spent reaching it from the
    stage they reached before (the first: from the fetch's start): the median milliseconds a chunk,
    and ``in_flight``, the chunks in that step on average over the ``wall_s`` seconds of the fetch.
    A step whose ``in_flight`` is its concurrency (the window, the reads, the decode threads, the write
    threads) bounds the fetch; one far below it does not."""
    by_chunk: dict[int, dict[str, float]] = {}
    for i, stage, t in timeline:
        by_chunk.setdefault(i, {})[stage] = t
    spans: dict[str, list[float]] = {}
    for marks in by_chunk.values():
        prev = 0.0
        for stage in STAGES:
            if stage in marks:
                spans.setdefault(stage, []).append(marks[stage] - prev)
                prev = marks[stage]
    return {stage: {"median_ms": round(1e3 * sorted(v)[len(v) // 2], 3), "in_flight": round(sum(v) / wall_s, 2) if wall_s > 0 else 0.0}
            for stage in STAGES if (v := spans.get(stage))}


def chunks_in_flight(window: int, workers: DecodeWorkers | None = None) -> int:
    """Chunks a fetch keeps in flight (each raw one holds a staging buffer): ``window``, or
    enough to keep every decode worker busy."""
    return window if workers is None else max(window, 2 * workers.procs)


async def fetch(
    store: Store,
    chunks: Sequence[ChunkRef],
    dest: Destination,
    *,
    fingerprint: str,
    io_pool: Executor,
    decode_pool: Executor,
    device: torch.device | str = "cpu",
    deadline_s: float | None = None,
    window: int = 4,
    io_concurrency: int = 8,
    workers: DecodeWorkers | None = None,
    staging_pool: staging.StagingPool | None = None,
    object_key: bytes | None = None,
    accepted_keys: tuple[bytes, ...] = (),
    readers: ReadProcs | None = None,
    write_pool: Executor | None = None,
    trust_store: bool = True,
) -> Outcome:
    """Load ``chunks`` (consecutive, from the first) into ``dest``; see the module doc for failures.

    With ``workers`` (and ``dest.handle``), each chunk is restored by a worker process instead of
    ``decode_pool`` threads; the window grows to keep them all busy. Native raw chunks take the
    direct path whatever ``workers`` is, staged in ``staging_pool`` (default: the process's
    shared pool). ``object_key`` (:func:`format.mac.key_from`): refuse every object whose tags do
    not verify under it (or one of ``accepted_keys``, a rotation's previous keys) for the name it is read
    from (None: CRC-32 only). With ``readers`` the staged reads (raw and entropy-coded segments)
    run in its reader processes, into its shared staging buffers (``staging_pool`` is then ignored).
    ``write_pool``: the threads that write the direct path's verified chunks into ``dest`` (their
    copies and scatters), never threads that run NVDEC (default: ``KVFETCHER_WRITE_THREADS``' default number of them).
    ``trust_store``: without ``object_key``, whether the store's bytes may reach decoders that do not
    validate their input (a sidecar passes False: whoever can write its store could craft them).
    """
    if workers is not None and dest.handle is None:
        raise ValueError("decode workers need the destination buffer's IPC handle")
    job = _Fetch(store, chunks, dest, fingerprint=fingerprint, io_pool=io_pool, decode_pool=decode_pool, device=device,
                 window=chunks_in_flight(window, workers), io_concurrency=io_concurrency, workers=workers,
                 staging_pool=readers.staging if readers else staging_pool or staging.shared(), object_key=object_key,
                 accepted_keys=accepted_keys, read=readers.read_into if readers else None, write_pool=write_pool,
                 trusted=object_key is not None or trust_store)
    return await job.run(deadline_s)


class _Busy:
    """Union of the intervals during which a stage had work in flight (for throughput)."""

    def __init__(self) -> None:
        self.active, self.total, self._since = 0, 0.0, 0.0

    def __enter__(self) -> None:
        if self.active == 0:
            self._since = time.perf_counter()
        self.active += 1

    def __exit__(self, *exc) -> None:
        self.active -= 1
        if self.active == 0:
            self.total += time.perf_counter() - self._since


async def _timed(busy: _Busy, aw):
    with busy:
        return await aw


def _reason(e: Exception) -> Reason:
    """The reason a fetch reports for the exception that stopped it."""
    if isinstance(e, (ContainerError, StoreError)):
        return e.reason
    if isinstance(e, (WorkerError, CodecError)):  # (CodecError: no decoder here, e.g. ans without a GPU)
        return Reason.DECODER
    if isinstance(e, ValueError):
        return Reason.INVALID
    return Reason.INTERNAL


@functools.lru_cache(maxsize=None)
def _write_threads() -> ThreadPoolExecutor:
    """The default ``write_pool``: threads apart from the decode threads, since torch's stream work
    has failed ("invalid resource handle") in threads that had run NVDEC."""
    return ThreadPoolExecutor(config.WRITE_THREADS.default, thread_name_prefix="kvf-write")


def _read_verified(read, name: str, offset: int, part: memoryview, have: int, seg: container.Segment,
                   h: container.Header, auth: ObjectMAC | None, finite: bool) -> int:
    """Fill ``part`` (a native segment of ``h`` whose first ``have`` bytes are there) from ``name`` at
    ``offset`` with ``read`` (as :func:`kvfetcher.store.read_into` of the store), then check its
    length, CRC-32, tag (with ``auth``) and, with ``finite``, that it holds no NaN or infinity;
    returns the bytes read. Blocking: runs in an I/O thread."""
    n = read(name, offset + have, part[have:]) if have < len(part) else 0
    container.check(seg, part[: have + n], auth)
    if finite:
        container.check_finite(part, h.torch_dtype)
    return n


def _write_native(dest: Destination, c: ChunkRef, kv: torch.Tensor) -> None:
    """Copy a verified native chunk (host memory) into its place. For a GPU buffer it is staged on
    the device and checked finite there (the host checks each segment only for a CPU buffer: on
    the GPU the check costs nothing next to the copy), so no NaN or infinity reaches the buffer;
    then written in place, or scattered on the device into a paged buffer's blocks. On a GPU all of
    it runs on the write thread's own stream, so that a write waits for its own chunk only, not for
    the other threads' copies queued on a shared stream."""
    if dest.device.type != "cuda":
        dest.write_kv(c, kv)
        return
    with torch.cuda.stream(chunk.thread_stream(dest.device)):
        kv = kv.to(dest.device, non_blocking=True)
        container.check_finite(kv, kv.dtype)
        dest.write_kv(c, kv)


def _give_when_done(started: list[concurrent.futures.Future], give) -> None:
    """Call ``give`` once every future of ``started`` is done (now, if they all are)."""
    left = [f for f in started if not f.done()]
    if not left:
        give()
        return
    count, lock = [len(left)], threading.Lock()

    def one_done(_f) -> None:
        with lock:
            count[0] -= 1
            last = count[0] == 0
        if last:
            give()

    for f in left:
        f.add_done_callback(one_done)


def _submit(started: list[concurrent.futures.Future], executor: Executor, fn, *args) -> asyncio.Future:
    """Run ``fn`` in ``executor``, remembering its thread future in ``started``."""
    f = executor.submit(fn, *args)
    started.append(f)
    return asyncio.wrap_future(f)


@dataclass
class _Whole:
    """A chunk read whole into a staging buffer taken from the pool: ``buf`` holds the object from
    its first byte; ``head`` its prefix and header bytes."""

    buf: torch.Tensor
    pinned: bool
    head: bytes


class _Fetch:
    """One fetch: its settings, its stages' semaphores, the writes under way and the outcome so far.

    Invariant: every call that may write into ``dest`` goes through :meth:`_write`, which records
    it; :meth:`run` awaits them all before it returns.
    """

    def __init__(self, store: Store, chunks: Sequence[ChunkRef], dest: Destination, *, fingerprint: str, io_pool: Executor,
                 decode_pool: Executor, device: torch.device | str, window: int, io_concurrency: int,
                 workers: DecodeWorkers | None, staging_pool: staging.StagingPool, object_key: bytes | None = None,
                 accepted_keys: tuple[bytes, ...] = (), read=None, write_pool: Executor | None = None, trusted: bool = True):
        self.store, self.chunks, self.dest, self.fingerprint = store, chunks, dest, fingerprint
        self.read = read or functools.partial(read_into, store)  # a staged part's bytes: (name, offset, buf) -> n
        self.io_pool, self.decode_pool, self.device = io_pool, decode_pool, device
        self.write_pool = write_pool or _write_threads()
        self.workers, self.staging, self.object_key, self.accepted_keys = workers, staging_pool, object_key, accepted_keys
        self.trusted = trusted  # the stored bytes may reach decoders that do not validate their input
        self.window, self.io = asyncio.Semaphore(window), asyncio.Semaphore(io_concurrency)
        self.reads, self.decodes = _Busy(), _Busy()
        self.out = Outcome(0, sum(c.tokens for c in chunks))
        self.written: set[int] = set()  # chunks whose write completed
        self.writes: list[asyncio.Future] = []
        self.t0 = 0.0  # when run started (perf_counter)

    async def run(self, deadline_s: float | None) -> Outcome:
        self.t0 = time.perf_counter()  # the timeline's zero
        tasks = [asyncio.create_task(self._load(i, c)) for i, c in enumerate(self.chunks)]
        try:
            async with asyncio.timeout(deadline_s):
                for t in tasks:
                    await t
        except TimeoutError:
            self.out.error, self.out.detail = Reason.DEADLINE, f"deadline of {deadline_s:.3f} s passed"
        except Exception as e:
            self._failed(e)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # A write already handed to a thread or a worker cannot be stopped: wait for it, so that
            # nothing touches the buffers once we have answered. (Those chunks were fully verified.)
            await asyncio.gather(*self.writes, return_exceptions=True)
        n = 0
        while n < len(self.chunks) and n in self.written:
            n += 1
        self.out.loaded_tokens = sum(c.tokens for c in self.chunks[:n])
        self.out.seconds = time.perf_counter() - self.t0
        self.out.read_busy_s, self.out.decode_busy_s = self.reads.total, self.decodes.total
        return self.out

    def _failed(self, e: Exception) -> None:
        reason = _reason(e)
        if reason is Reason.INTERNAL:  # a bug or an unforeseen backend failure: still fall back, loudly
            log.exception("fetch failed")
        self.out.error, self.out.detail = reason, f"{type(e).__name__}: {e}" if reason is Reason.INTERNAL else str(e)
        if reason in BAD_OBJECT:
            self.out.bad_object, self.out.bad_size = getattr(e, "object_name", None), getattr(e, "object_size", None)

    async def _load(self, i: int, c: ChunkRef) -> None:
        try:
            async with self.window:
                self._mark(i, "admitted")
                h, head = await (self._whole(c) if self._reads_whole(c) else self._header(c))
                self._mark(i, "header")
                if isinstance(self.dest, ObjectArena):
                    await self._object(i, c, h, head)
                elif container.is_native(h):
                    await self._direct(i, c, h, head)
                elif h.codec.format in ENTROPY_FORMATS:
                    await self._entropy(i, c, h, head)
                else:
                    await self._coded(i, c, h, head)
        except ContainerError as e:
            e.object_name, e.object_size = c.name, c.size  # type: ignore[attr-defined]  # so the caller can drop a bad object
            raise

    def _mark(self, i: int, stage: str) -> None:
        """Chunk ``i`` reached ``stage`` (:data:`STAGES`) now (from any thread)."""
        self.out.timeline.append((i, stage, time.perf_counter() - self.t0))

    def _writer(self, i: int, fn):
        """``fn`` (a write of chunk ``i``, for the pool that runs it) marking the chunk ``started`` as it begins."""
        def write(*args):
            self._mark(i, "started")
            return fn(*args)
        return write

    def _auth(self, c: ChunkRef) -> ObjectMAC | None:
        """What the chunk's tags must verify under: the key and the name the object is read from."""
        return ObjectMAC(self.object_key, c.name, self.accepted_keys) if self.object_key else None

    async def _get(self, name: str, offset: int, length: int) -> bytes:
        async with self.io:
            with self.reads:
                data = await asyncio.get_running_loop().run_in_executor(self.io_pool, self.store.get, name, offset, length)
        self.out.bytes_read += len(data)
        return data

    def _write(self, i: int, w: asyncio.Future) -> asyncio.Future:
        """Record a write of chunk ``i`` under way (awaited before returning; counted once it
        succeeded); returns it shielded, so that abandoning the chunk does not abandon the write."""
        w.add_done_callback(lambda f: self.written.add(i) if not f.cancelled() and f.exception() is None else None)
        self.writes.append(w)
        return asyncio.shield(w)

    async def _header(self, c: ChunkRef) -> tuple[container.Header, bytes]:
        """The chunk's header, checked against the model and the destination, and the bytes read so far."""
        t = time.perf_counter()
        head = await self._get(c.name, 0, min(HEADER_GUESS, c.size) if c.size else HEADER_GUESS)
        self.out.header_latency_s.append(time.perf_counter() - t)
        need = container.header_length(head[: container.PREFIX_SIZE])
        if len(head) < need:
            head += await self._get(c.name, len(head), need - len(head))
        return self._checked(c, head), head

    def _checked(self, c: ChunkRef, head: bytes) -> container.Header:
        """The header at the start of ``head``, checked against the model, the destination and the listed size."""
        h = container.parse_header(head, self._auth(c))
        container.check_fingerprint(h, self.fingerprint)
        self.dest.check(h, c)
        if c.size and c.size != h.total_size:
            raise TruncatedError(f"{c.name} is {c.size} bytes, its header promises {h.total_size}")
        return h

    def _reads_whole(self, c: ChunkRef) -> bool:
        """Whether chunk ``c`` is read in one GET (:data:`WHOLE_OBJECT_BYTES`): its size is known and
        small enough, and its name says an entropy-coded preset (its header decides: any other is read
        as usual), restored from a staging buffer (not into an engine's arena)."""
        try:
            preset = PRESETS.get(keys.preset_of(c.name))
        except ValueError:
            return False
        return (0 < c.size <= WHOLE_OBJECT_BYTES and preset is not None and preset.codec.format in ENTROPY_FORMATS
                and not isinstance(self.dest, ObjectArena))

    async def _whole(self, c: ChunkRef) -> tuple[container.Header, bytes | _Whole]:
        """Chunk ``c`` read in one GET into a staging buffer (its parts unverified); its header
        checked as :meth:`_header` checks it, and the object (:class:`_Whole`), or, for a chunk that
        is not entropy-coded after all, the header's bytes alone (its parts are read as usual)."""
        pinned = self.dest.device.type == "cuda"
        buf = self.staging.take(c.size, pinned)
        obj = memoryview(buf.numpy())[: c.size]
        started: list[concurrent.futures.Future] = []  # the read, which may outlive an abandoned fetch
        try:
            async with self.io:  # (no first-byte latency to learn: the whole object's transfer)
                with self.reads:
                    n = await _submit(started, self.io_pool, self.read, c.name, 0, obj)
            self.out.bytes_read += n
            if n != c.size:
                raise TruncatedError(f"{c.name} was listed at {c.size} bytes, a read of it gave {n}")
            head = bytes(obj[: container.header_length(bytes(obj[: container.PREFIX_SIZE]))])
            h = self._checked(c, head)
        except BaseException:
            _give_when_done(started, lambda: self.staging.give(buf, pinned))
            raise
        if h.codec.format in ENTROPY_FORMATS:  # (then :meth:`_load` hands it to :meth:`_entropy`)
            return h, _Whole(buf, pinned, head)
        self.staging.give(buf, pinned)
        return h, head

    async def _part(self, c: ChunkRef, h: container.Header, head: bytes, seg: container.Segment) -> bytes:
        """A part's stored bytes, unverified: what the header read brought, and a ranged GET for the rest."""
        a = h.header_size + seg.offset
        have = head[a : a + seg.length]
        if len(have) < seg.length:
            have += await self._get(c.name, a + len(have), seg.length - len(have))
        return have

    async def _coded(self, i: int, c: ChunkRef, h: container.Header, head: bytes) -> None:
        """A coded chunk: every part read, then restored by a worker, or here if there is none or
        the workers cannot map the buffer (from the same bytes: nothing is read twice)."""
        parts = await asyncio.gather(*(self._part(c, h, head, s) for s in ([h.side] if h.side else []) + list(h.segments)))
        side, segments = (parts[0], parts[1:]) if h.side else (None, parts)
        self._mark(i, "read")
        if self.workers is not None and h.codec.format not in ENTROPY_FORMATS and not self.dest.skip(c):  # workers write whole chunks
            restore = self.workers.restore(self.dest.handle, head[: h.header_size], side, segments, self.dest.where(c), self._auth(c),
                                           self.trusted)
            if await self._by_worker(i, self._write(i, asyncio.ensure_future(_timed(self.decodes, restore)))):
                return
        loop = asyncio.get_running_loop()
        with self.decodes:  # abandoned at a failure, this writes nothing: only the write below is awaited
            verify = functools.partial(chunk.verify_and_decode, h, side, segments, self.device, auth=self._auth(c), trusted=self.trusted)
            decoded = await loop.run_in_executor(self.decode_pool, verify)
        self._mark(i, "decoded")
        # Everything of this chunk verified and decoded: only now touch the KV buffers.
        n = await self._write(i, loop.run_in_executor(self.decode_pool, self._writer(i, decoded.write), self.dest, c))
        self._mark(i, "written")
        self.out.kv_bytes += n

    async def _direct(self, i: int, c: ChunkRef, h: container.Header, head: bytes) -> None:
        """A native raw chunk: segments read into one staging buffer, each checksummed, then one copy."""
        async with self._staged(c, h, head, h.segments, finite=self.dest.device.type != "cuda") as (host, started):
            kv = host.view(h.torch_dtype).view(h.shape)
            self._mark(i, "read")
            # Every segment verified: only now touch the KV buffers.
            await _timed(self.decodes, self._write(i, _submit(started, self.write_pool, self._writer(i, _write_native), self.dest, c, kv)))
            self._mark(i, "written")
        self.out.kv_bytes += host.numel()
        self.out.direct_chunks += 1

    async def _entropy(self, i: int, c: ChunkRef, h: container.Header, head: bytes | _Whole) -> None:
        """An entropy-coded chunk: its parts read into one staging buffer (or there already: a
        :class:`_Whole`), restored from it by a decode worker where one can map it (:meth:`_in_workers`),
        else decoded from it in the decode pool (the buffer's last use), then written. Every part is
        checked once before its decode: as it is read, or, for a :class:`_Whole` a worker restores,
        by that worker (and by the decode pool if the worker cannot map the KV buffer after all)."""
        parts = ([h.side] if h.side else []) + list(h.segments)
        in_workers = self._in_workers(c)
        checked = not (in_workers and isinstance(head, _Whole))  # else the worker checks them (it always does)
        async with self._staged(c, h, head, parts, finite=False, check=checked) as (host, started):
            self._mark(i, "read")
            if in_workers:
                header = head.head if isinstance(head, _Whole) else head[: h.header_size]
                restore = _submit(started, self.workers.threads, self._writer(i, self._restore_staged), c, header, parts, host)
                if await self._by_worker(i, _timed(self.decodes, self._write(i, restore))):
                    return
            part = lambda s: host[s.offset : s.offset + s.length]  # noqa: E731
            side = memoryview(part(h.side).numpy()) if h.side else None
            segments = [part(s) for s in h.segments]
            decode = (functools.partial(chunk.decode_verified, h, side, segments, self.device, trusted=self.trusted) if checked else
                      functools.partial(chunk.verify_and_decode, h, side, segments, self.device, auth=self._auth(c), trusted=self.trusted))
            with self.decodes:  # abandoned at a failure, this writes nothing: only the write below is awaited
                decoded = await _submit(started, self.decode_pool, decode)
            self._mark(i, "decoded")
        # Everything of this chunk verified and decoded: only now touch the KV buffers (the unpack, in a decode thread).
        write = self._writer(i, decoded.write)
        n = await self._write(i, asyncio.get_running_loop().run_in_executor(self.decode_pool, write, self.dest, c))
        self._mark(i, "written")
        self.out.kv_bytes += n

    async def _by_worker(self, i: int, restore) -> bool:
        """Await a decode worker's restore of chunk ``i`` (a write, :meth:`_write`) and count it;
        False if the workers cannot map the KV buffer: the caller decodes the chunk here instead."""
        try:
            n = await restore
        except BufferOpenError as e:
            log.warning("decode workers cannot open the KV buffer (%s); decoding in this process", e)
            return False
        self._mark(i, "written")
        self.out.kv_bytes += n
        return True

    def _in_workers(self, c: ChunkRef) -> bool:
        """Whether a decode worker restores this entropy-coded chunk straight from its staging buffer:
        there are workers, they can map that buffer (the reader processes' shared staging) and the
        KV buffer (it has an IPC handle), and the chunk is written whole."""
        return self.workers is not None and self.staging.shared and self.dest.handle is not None and not self.dest.skip(c)

    def _restore_staged(self, c: ChunkRef, header: bytes, parts: Sequence[container.Segment], host: torch.Tensor) -> int:
        """In a caller thread of the workers: one of them restores the chunk (its prefix and
        ``header`` bytes) from ``host``, the shared staging buffer its ``parts`` were read into
        (verified again there, decoded, written)."""
        at = self.staging.place(memoryview(host.numpy()))
        spans = [(at.at + s.offset, at.at + s.offset + s.length) for s in parts]
        return self.workers.restore_from(self.dest.handle, (at.path, at.size), header, spans,
                                         self.dest.where(c), self._auth(c), self.trusted)

    async def _object(self, i: int, c: ChunkRef, h: container.Header, head: bytes) -> None:
        """A chunk for the engine to decode (engine-decode mode): its parts read into one staging
        buffer and checked there, then the whole object written to its place in the arena."""
        parts = ([h.side] if h.side else []) + list(h.segments)
        async with self._staged(c, h, head, parts, finite=False) as (host, started):
            self._mark(i, "read")
            # Every part verified: only now touch the arena.
            put = _submit(started, self.write_pool, self._writer(i, self.dest.put), c, head[: h.header_size], host)
            await _timed(self.decodes, self._write(i, put))
            self._mark(i, "written")

    @contextlib.asynccontextmanager
    async def _staged(self, c: ChunkRef, h: container.Header, head: bytes | _Whole, parts: Sequence[container.Segment], finite: bool,
                      check: bool = True):
        """Read ``parts`` of ``c`` to their offsets in one staging buffer (pinned for a GPU buffer;
        with a :class:`_Whole`, the object's own, where they are already), each checked by the
        thread that read it (:func:`_read_verified`); yields that buffer's payload bytes and the list
        of thread futures on it, where work on it must be registered (:func:`_submit`): it goes back
        to the pool only once none of them can touch it. Without ``check`` (only with a
        :class:`_Whole`) the parts are yielded unchecked: the caller must check them before any use."""
        assert check or isinstance(head, _Whole), "parts read here are always checked"
        nbytes = h.total_size - h.header_size
        if isinstance(head, _Whole):
            buf, pinned, at = head.buf, head.pinned, h.header_size
        else:
            pinned = self.dest.device.type == "cuda"
            buf, at = self.staging.take(nbytes, pinned), 0
        host = buf[at : at + nbytes]
        mem = memoryview(host.numpy())
        started: list[concurrent.futures.Future] = []  # thread work on ``host``
        reads = [asyncio.ensure_future(self._read_segment(c, h, head, mem, s, started, finite)) for s in (parts if check else ())]
        try:
            await asyncio.gather(*reads)
            yield host, started
        finally:
            for t in reads:  # a cancelled read submits nothing more
                t.cancel()
            # a read, copy or decode abandoned at a failure or deadline may still run in a thread and
            # own ``buf``: it goes back to the pool once the last of them is done
            _give_when_done(started, lambda: self.staging.give(buf, pinned))

    async def _read_segment(self, c: ChunkRef, h: container.Header, head: bytes | _Whole, mem: memoryview, seg: container.Segment,
                            started: list[concurrent.futures.Future], finite: bool) -> None:
        """Land one part in its place of the staging buffer ``mem``, read and checked in one thread hop
        (with a :class:`_Whole`, there already: only checked)."""
        a, part = h.header_size + seg.offset, mem[seg.offset : seg.offset + seg.length]
        if isinstance(head, _Whole):
            await _submit(started, self.io_pool, _read_verified, self.read, c.name, a, part, len(part), seg, h, self._auth(c), finite)
            return
        have = head[a : a + seg.length]  # what the header read already brought, if anything
        part[: len(have)] = have
        async with self.io:
            with self.reads:  # (the CRC reads bytes still in cache)
                n = await _submit(started, self.io_pool, _read_verified, self.read, c.name, a, part, len(have), seg, h,
                                  self._auth(c), finite)
        self.out.bytes_read += n
