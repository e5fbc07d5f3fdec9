"""pipeline: fetch chunks from a store straight into KV buffers, as overlapping stages.

Per chunk: one ranged GET for the prefix + header (+ side info, usually in the same bytes),
then one ranged GET per video segment; each segment is checksummed and decoded as soon as its
bytes arrive (decoding blocks, so it runs in a thread pool); when *every* segment of the chunk
has verified and decoded, the chunk is unpacked into its destination slots. Up to ``window``
chunks are in flight at once (a bounded buffer: memory stays ``window`` chunks however long the
prefix), so a 100-chunk prefix streams — chunk 0 is being restored while chunk 3 downloads.

Direct path: a chunk stored in the ``native`` layout without a codec (the ``raw`` preset;
:func:`container.is_native`) is the KV buffer's own bytes. Its segments are read with ranged
GETs straight into one host staging buffer (:mod:`staging`: reused, pinned when the destination
is on a GPU), each checksummed by the thread that read it, and once all have verified the chunk
is copied into the destination by one non-blocking host-to-device copy — no
decoder, no worker process, no reshuffle. The chunk counts as written only once that copy has
completed.

Failure semantics: the result is the longest run of *leading* chunks that were written; the
caller recomputes the rest. On the first failure, or at the deadline, or on cancellation, the
chunks still in flight are abandoned — except a write already started, which is awaited, so
nothing touches the buffers after this returns. Nothing unverified is ever written.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvfetcher import codec
from kvfetcher.format import container
from kvfetcher.codec import layout
from kvfetcher.fetch import staging
from kvfetcher.fetch.workers import BufferOpenError, DecodeWorkers, WorkerError
from kvfetcher.kvbuffer import ChunkRef, bytes_per_value, check_shape, contiguous, slot_list
from kvfetcher.store import Store, StoreError, read_into

log = logging.getLogger("kvfetcher.fetch.executor")

HEADER_GUESS = 64 * 1024  # one GET usually covers prefix, header and side information
#: failures that mean the stored object itself is bad (not the link, not a newer writer)
BAD_OBJECT = {"corrupt", "truncated", "foreign", "fingerprint"}


class Destination:
    """Token ``i`` of the prompt goes to slot ``slots[i]`` of the buffer's token axis.

    ``buffer`` is ``[layers, 2, kv_heads, capacity, head_dim]``. Contiguous slots are written in
    place through a view (no copy); scattered slots (a paged cache) through ``index_copy_``.
    ``handle`` is the buffer's IPC handle (:mod:`ipc`), which decode worker processes open to
    write into the same memory.
    """

    def __init__(self, buffer: torch.Tensor, slots: Sequence[int] | None = None, offset: int = 0, tokens: int | None = None,
                 handle: dict | None = None):
        check_shape(buffer)
        self.buffer = buffer
        self.handle = handle
        if tokens is None:
            if slots is None:
                raise ValueError("give the destination's slots or its number of tokens")
            tokens = len(slots)
        self.slots = slot_list(buffer.shape[3], tokens, slots, offset)

    def check(self, h: container.Header, c: ChunkRef) -> None:
        """Refuse a chunk that does not fit: wrong geometry or dtype is a foreign chunk here."""
        L, _, H, _, D = self.buffer.shape
        if tuple(h.shape) != (L, 2, H, c.tokens, D) or h.torch_dtype != self.buffer.dtype:
            raise container.FingerprintMismatchError(
                f"chunk {tuple(h.shape)} {h.dtype} does not fit buffer {tuple(self.buffer.shape)} {self.buffer.dtype}"
            )
        if c.start + c.tokens > len(self.slots):
            raise ValueError(f"no destination slots for tokens {c.start}..{c.start + c.tokens}")

    def _view(self, c: ChunkRef) -> tuple[list[int], torch.Tensor | None]:
        """The chunk's slots, and the buffer view they form when contiguous (else None)."""
        idx = self.slots[c.start : c.start + c.tokens]
        if contiguous(idx):
            return idx, self.buffer[:, :, :, idx[0] : idx[0] + len(idx)]
        return idx, None

    def _scatter(self, idx: list[int], kv: torch.Tensor) -> None:
        self.buffer.index_copy_(3, torch.tensor(idx, device=self.buffer.device), kv.to(self.buffer.device, non_blocking=True))

    def _finish(self) -> None:
        if self.buffer.is_cuda:  # the model (another process) reads once we answer: finish first
            torch.cuda.current_stream(self.buffer.device).synchronize()

    def write(self, c: ChunkRef, frames: torch.Tensor, side: torch.Tensor | None, h: container.Header) -> None:
        """Unpack decoded frames into the chunk's slots: in place into a contiguous view, or
        through ``index_copy_`` for scattered slots (a paged cache)."""
        idx, view = self._view(c)
        frames = frames.to(self.buffer.device)
        if view is not None:
            layout.unpack(frames, side, h.shape, h.torch_dtype, h.layout, out=view, start=h.start)
        else:
            self._scatter(idx, layout.unpack(frames, side, h.shape, h.torch_dtype, h.layout, start=h.start))
        self._finish()

    def write_kv(self, c: ChunkRef, kv: torch.Tensor) -> None:
        """Copy a verified chunk ``[layers, 2, kv_heads, tokens, head_dim]`` (host memory) into its
        slots, as :meth:`write` does. On a GPU the copy is non-blocking from pinned memory and
        waited for, so the chunk is in the buffer when this returns and the host memory may be reused.

        It runs on the calling thread's current stream, not a dedicated one: this runs in the
        sidecar's own process, where nothing else queues on the GPU, and on the H100 a dedicated
        stream failed ("invalid resource handle" at its event) in threads that had run NVDEC."""
        idx, view = self._view(c)
        if view is not None:
            view.copy_(kv, non_blocking=True)
        else:
            self._scatter(idx, kv)
        self._finish()


def chunks_in_flight(window: int, workers: DecodeWorkers | None = None) -> int:
    """Chunks a fetch keeps in flight (each raw one holds a staging buffer): ``window``, or
    enough to keep every decode worker busy."""
    return window if workers is None else max(window, 2 * workers.procs)


@functools.lru_cache(maxsize=None)
def _copy_threads() -> ThreadPoolExecutor:
    """Threads for the direct path's host-to-device copies, apart from the decode threads: on the
    H100 torch's stream work failed ("invalid resource handle") in threads that had run NVDEC."""
    return ThreadPoolExecutor(4, thread_name_prefix="kvf-copy")


def _read_verified(store: Store, name: str, offset: int, part: memoryview, have: int, seg: container.Segment) -> int:
    """Fill ``part`` (a segment whose first ``have`` bytes are there) from ``name`` at ``offset``,
    then check its length and CRC-32; returns the bytes read. Blocking: runs in an I/O thread."""
    n = read_into(store, name, offset + have, part[have:]) if have < len(part) else 0
    container.check(seg, part[: have + n])
    return n


@dataclass
class Outcome:
    loaded_tokens: int  # leading tokens now in the buffers
    requested_tokens: int
    error: str | None = None  # reason of the failure that stopped the fetch (None: all loaded)
    detail: str | None = None
    bytes_read: int = 0
    kv_bytes: int = 0  # bytes of KV restored
    seconds: float = 0.0
    read_busy_s: float = 0.0  # time with at least one GET in flight
    decode_busy_s: float = 0.0  # time with at least one decode in flight
    header_latency_s: list[float] = field(default_factory=list)
    bad_object: str | None = None  # an object that is corrupt, truncated or foreign: drop it
    direct_chunks: int = 0  # chunks restored by the direct path (native raw: read, checksum, one copy)


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


async def _timed(busy: _Busy, coro):
    with busy:
        return await coro


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
) -> Outcome:
    """Load ``chunks`` (consecutive, from the first) into ``dest``; see the module doc for failures.

    With ``workers`` (and ``dest.handle``), each verified chunk is decoded and written by a
    worker process instead of ``decode_pool`` threads; the window grows to keep them all busy.
    Native raw chunks take the direct path whatever ``workers`` is, staged in ``staging_pool``
    (default: the process's shared pool).
    """
    pool = staging_pool or staging.shared()
    loop = asyncio.get_running_loop()
    if workers is not None:
        if dest.handle is None:
            raise ValueError("decode workers need the destination buffer's IPC handle")
    window = chunks_in_flight(window, workers)
    t0 = time.perf_counter()
    out = Outcome(0, sum(c.tokens for c in chunks))
    reads, decodes = _Busy(), _Busy()
    window_sem, io_sem = asyncio.Semaphore(window), asyncio.Semaphore(io_concurrency)
    written: set[int] = set()
    writes: list[asyncio.Future] = []

    def track(i: int, w: asyncio.Future) -> None:
        """A write of chunk ``i`` under way: awaited before returning, counted once it succeeded."""
        w.add_done_callback(lambda f: written.add(i) if not f.cancelled() and f.exception() is None else None)
        writes.append(w)

    async def get(name: str, offset: int, length: int) -> bytes:
        async with io_sem:
            with reads:
                data = await loop.run_in_executor(io_pool, store.get, name, offset, length)
        out.bytes_read += len(data)
        return data

    async def decode(fn, *args):
        with decodes:
            return await loop.run_in_executor(decode_pool, fn, *args)

    async def load(i: int, c: ChunkRef) -> None:
        try:
            await load_verified(i, c)
        except container.ContainerError as e:
            e.object_name = c.name  # type: ignore[attr-defined]  # so the caller can drop a bad object
            raise

    async def load_verified(i: int, c: ChunkRef) -> None:
        async with window_sem:
            t = time.perf_counter()
            head = await get(c.name, 0, min(HEADER_GUESS, c.size) if c.size else HEADER_GUESS)
            out.header_latency_s.append(time.perf_counter() - t)
            need = container.header_length(head[: container.PREFIX_SIZE])
            if len(head) < need:
                head += await get(c.name, len(head), need - len(head))
            h = container.parse_header(head)
            container.check_fingerprint(h, fingerprint)
            dest.check(h, c)
            if c.size and c.size != h.total_size:
                raise container.TruncatedError(f"{c.name} is {c.size} bytes, its header promises {h.total_size}")

            if container.is_native(h):
                await load_direct(i, c, h, head)
                return

            got: dict[int, bytes] = {}  # segment offset -> bytes read (a fallback reuses them)

            async def unverified(seg: container.Segment) -> bytes:
                if seg.offset in got:
                    return got[seg.offset]
                a = h.header_size + seg.offset
                have = head[a : a + seg.length]  # what the first read already brought, if anything
                if len(have) < seg.length:
                    have += await get(c.name, a + len(have), seg.length - len(have))
                got[seg.offset] = have
                return have

            async def segment_bytes(seg: container.Segment) -> bytes:
                have = await unverified(seg)  # checksums off the event loop (GB of CRC would stall it)
                return await loop.run_in_executor(io_pool, container.verify, seg, have)

            if workers is not None:  # verify + decode + write in a worker process, all or nothing
                seg_data = await asyncio.gather(*(unverified(s) for s in h.segments))
                side_data = await unverified(h.side) if h.side else None
                slots = dest.slots[c.start : c.start + c.tokens]
                w = asyncio.ensure_future(_timed(decodes, workers.restore(dest.handle, head[: h.header_size], side_data, seg_data, slots)))
                track(i, w)
                try:
                    restored = await asyncio.shield(w)  # (not `+= await`: that reads kv_bytes before awaiting)
                except BufferOpenError as e:  # workers cannot map this buffer: decode here instead
                    log.warning("decode workers cannot open the KV buffer (%s); decoding in this process", e)
                else:
                    out.kv_bytes += restored
                    return

            dec = codec.decoder(h.codec.format, device)  # here, not before: workers decode in their own

            async def frames_of(seg: container.Segment) -> torch.Tensor:
                data = await segment_bytes(seg)
                return await decode(container.decode_segment, h, seg, data, dec, device)

            side = container.side_tensor(h, await segment_bytes(h.side)) if h.side else None
            parts = await asyncio.gather(*(frames_of(s) for s in h.segments))
            frames = parts[0] if len(parts) == 1 else torch.cat(parts)
            # Everything of this chunk verified and decoded: only now touch the KV buffers.
            w = loop.run_in_executor(decode_pool, dest.write, c, frames, side, h)
            track(i, w)
            await asyncio.shield(w)
            out.kv_bytes += h.shape[0] * 2 * h.shape[2] * h.shape[3] * h.shape[4] * bytes_per_value(h.torch_dtype)

    async def load_direct(i: int, c: ChunkRef, h: container.Header, head: bytes) -> None:
        """Native raw chunk: segments into one staging buffer, checksummed, then one copy."""
        nbytes = h.total_size - h.header_size
        pinned = dest.buffer.is_cuda
        host = pool.take(nbytes, pinned)
        mem = memoryview(host.numpy())
        started: list[concurrent.futures.Future] = []  # thread work on ``host``

        def run(executor: Executor, fn, *args) -> asyncio.Future:
            f = executor.submit(fn, *args)
            started.append(f)
            return asyncio.wrap_future(f)

        async def segment(seg: container.Segment) -> None:
            a, part = h.header_size + seg.offset, mem[seg.offset : seg.offset + seg.length]
            have = head[a : a + seg.length]  # what the header read already brought, if anything
            part[: len(have)] = have
            async with io_sem:
                with reads:  # read + checksum in one thread hop (the CRC reads bytes still in cache)
                    n = await run(io_pool, _read_verified, store, c.name, a, part, len(have), seg)
            out.bytes_read += n  # (not ``+= await``: that reads the count before awaiting)

        parts = [asyncio.ensure_future(segment(s)) for s in h.segments]
        try:
            await asyncio.gather(*parts)
            # Every segment verified: only now touch the KV buffers.
            kv = host.view(h.torch_dtype).view(h.shape)
            w = run(_copy_threads(), dest.write_kv, c, kv)
            track(i, w)
            await _timed(decodes, asyncio.shield(w))
            out.kv_bytes += nbytes
            out.direct_chunks += 1
        finally:
            for t in parts:  # a cancelled segment submits nothing more
                t.cancel()
            if all(f.done() for f in started):
                pool.give(host, pinned)
            # else a read or copy abandoned at a failure or deadline still runs in a thread and
            # owns ``host`` (its memoryview keeps it alive): never reuse it, let it be freed after

    tasks = [asyncio.create_task(load(i, c)) for i, c in enumerate(chunks)]
    try:
        async with asyncio.timeout(deadline_s):
            for t in tasks:
                await t
    except TimeoutError:
        out.error, out.detail = "deadline", f"deadline of {deadline_s:.3f} s passed"
    except container.ContainerError as e:
        out.error, out.detail = e.reason, str(e)
        if e.reason in BAD_OBJECT:
            out.bad_object = getattr(e, "object_name", None)
    except StoreError as e:
        out.error, out.detail = e.reason, str(e)
    except WorkerError as e:
        out.error, out.detail = "decoder", str(e)
    except ValueError as e:
        out.error, out.detail = "invalid", str(e)
    except Exception as e:  # a bug or an unforeseen backend failure: still fall back, loudly
        log.exception("fetch failed")
        out.error, out.detail = "internal", f"{type(e).__name__}: {e}"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # A write already handed to a thread cannot be stopped: wait for it, so nothing touches
        # the buffers once we have answered. (Those chunks were fully verified.)
        await asyncio.gather(*writes, return_exceptions=True)
    n = 0
    while n < len(chunks) and n in written:
        n += 1
    out.loaded_tokens = sum(c.tokens for c in chunks[:n])
    out.seconds = time.perf_counter() - t0
    out.read_busy_s, out.decode_busy_s = reads.total, decodes.total
    return out
