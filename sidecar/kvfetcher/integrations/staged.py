"""Host staging: KV moved between the sidecar and a serving engine's paged blocks that the sidecar
cannot map, through a bounded flat buffer in host memory; on a GPU, fetches in engine-decode mode.

The engine process owns the blocks (a CPU cache no other process can map, or a GPU the sidecar
does not see: a device-plugin GPU given to the model container only). :class:`Staging` registers a
flat buffer ``[layers, 2, kv_heads, tokens, head_dim]`` (a memfd, :func:`kvfetcher.ipc.allocate`)
with the sidecar and copies between it and the blocks itself (on a GPU, host-to-device and back, on
its own CUDA stream, the buffer page-locked: :func:`pin_while_alive`). A fetch or store longer than
the buffer goes through it in windows: each window is one sidecar call of the prompt's tokens up to
the window's end, with ``first_token`` at the window's start and ``offset = -first_token`` (the
window's first token in slot 0), so nothing of the prompt's earlier tokens is fetched, written or
read again.

Engine-decode mode (a GPU the sidecar cannot open, the default there): the same memory is
registered a second time as an engine's arena (:class:`~kvfetcher.fetch.plan.EngineDecode`), and a
spare buffer of its size as a second one, so that the sidecar fetches the next window into one while
this process restores the other. A fetch
asks the sidecar to fetch the stored objects, not to decode them: it reads and verifies every part
(CRC-32, and tags with the pool's key) and only then copies the whole object into the arena, and
answers where each lies once none of its writes can still run. The engine then restores each
object into the blocks with the sidecar's own restore (:func:`kvfetcher.chunk.restore_object`:
header and fingerprint checked, every part's CRC-32 checked again on the bytes it decodes, decoded
on this GPU: nvCOMP for ``ans`` and ``zstd``, NVDEC for HEVC where present, then the same unpack).
The engine holds no object key, so the tags are the sidecar's to check; the CRC re-check makes sure
the engine decodes exactly the bytes that were verified (a reply naming other bytes, or an arena
changed since, is refused, and what was not restored is recomputed). Windows follow the arena's
size: a fetch that fills it stops with no reason and the next starts where it ended. The restores,
and a store's copies out of the blocks, run in the engine's restore processes once they are ready
(:mod:`~kvfetcher.integrations.restore_procs`: a thread here shares the GIL with the engine's loop),
else in this process.

Contracts: a fetch writes only tokens ``first .. end`` into the blocks, in whole blocks, and returns
the end of what it wrote in order (the caller recomputes the rest: restore processes may have written
whole objects past an object that failed); nothing writes into the blocks or reads an arena once it
has returned. A store has copied its blocks out before it returns. Both hold the staging's lock: one fetch or store uses it at a time.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch

from kvfetcher import chunk, codec, ipc, kvbuffer
from kvfetcher.api.client import KVClient, SidecarError
from kvfetcher.codec import CodecError
from kvfetcher.errors import ContainerError, GeometryMismatchError
from kvfetcher.fetch.plan import EngineDecode, EngineDecoded, FetchOptions, FetchPlan, FetchReply
from kvfetcher.integrations.restore_procs import RestoreProcs, cuda_paged_handle

log = logging.getLogger("kvfetcher.integrations.staged")

COPY_BYTES = 64 << 20  # a copy between the staging and the blocks moves at most this much at once (its transient device tensor)


def engine_formats(device: torch.device) -> tuple[str, ...]:
    """The bitstream formats this process decodes on ``device`` in engine-decode mode: raw and zstd
    anywhere, ``ans`` with nvCOMP on a GPU, HEVC on a GPU with NVDEC (on a CPU, libavcodec)."""
    if device.type != "cuda":
        return ("raw", "zstd", "hevc")
    return ("raw", "zstd") + (("ans",) if codec.decodable("ans") else ()) + (("hevc",) if codec.capabilities()["nvdec"] else ())


def register(client: KVClient, tensors: torch.Tensor | Sequence[torch.Tensor], layout: kvbuffer.PagedLayout, model: str, tp_rank: int,
             staging_tokens: int, staging: Staging | None = None, engine_decode: bool | None = None,
             engine_procs: int = 0) -> tuple[str, Staging | None, str]:
    """Register paged KV ``tensors`` with the sidecar: straight (CUDA IPC) where the sidecar opens
    them, else (host memory, or a sidecar answering ``no_device``) the host ``staging`` given, or a
    new one of ``staging_tokens`` slots, whose fetches this process decodes (engine-decode mode) when
    ``engine_decode`` says, by default on a GPU; ``engine_decode`` True takes that mode on a GPU the
    sidecar could open too (the restore then runs in this process' CUDA context, not time-sliced
    beside it), with ``engine_procs`` restore processes of its own (:class:`Staging`). The buffer id,
    the staging (None: direct) and why this mode; a refusal other than ``no_device`` raises
    (:class:`SidecarError`, ``OSError``)."""
    if staging is None:
        t0 = tensors if isinstance(tensors, torch.Tensor) else tensors[0]
        if t0.device.type == "cuda" and engine_decode:
            why = "the connector's engine_decode option: this process restores its loads on its GPU"
        elif t0.device.type == "cuda":
            try:
                return client.register_paged(tensors, layout, model, tp_rank), None, "the sidecar opens the GPU KV blocks by CUDA IPC"
            except SidecarError as e:
                if not e.no_device:
                    raise
                why = f"the sidecar cannot open the GPU's memory ({e.detail})"
        else:
            why = "the KV cache is in host memory, which no other process can map"
        here = engine_decode if engine_decode is not None else t0.device.type == "cuda"
        engine = EngineDecode(engine_formats(t0.device), t0.device.type) if here else None
        fresh = staging = Staging(tensors, layout, staging_tokens, engine, engine_procs)
    else:
        fresh, why = None, "host staging, as before"
    try:
        return staging.register(client, model, tp_rank), staging, why
    except BaseException:
        if fresh is not None:
            fresh.close()
        raise


def pin_while_alive(owner: object, tensors: Sequence[torch.Tensor]) -> weakref.finalize:
    """Page-lock the host ``tensors`` (:func:`kvfetcher.ipc.pin`: a GPU then copies from them by DMA,
    not through the driver's pageable path, slow and synchronous) until the returned finalizer is
    called or ``owner`` is collected. It holds the tensors, so their memory stays mapped until it
    has unpinned them; one that CUDA refuses to pin stays pageable (logged)."""
    pinned = []
    for t in tensors:
        if ipc.pin(t):
            pinned.append(t)
        else:
            log.warning("kvfetcher: %d MiB of staging memory could not be page-locked: copies from it to the GPU stay pageable "
                        "(slower)", t.numel() * t.element_size() >> 20)
    done = weakref.finalize(owner, _unpin, pinned)
    done.atexit = False  # (at exit the memory goes with the process)
    return done


def _unpin(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        ipc.unpin(t)


class Staging:
    """A flat host buffer of ``tokens`` token slots for the paged KV ``tensors`` (as
    :class:`kvbuffer.PagedKV` sees them through ``layout``), and the windowed fetches and stores
    through it. ``handle`` is what the sidecar registers (:meth:`KVClient.register`). With
    ``engine`` fetches go through it in engine-decode mode (the module's doc); on a GPU with ``procs``
    restore processes (:class:`~kvfetcher.fetch.workers.DecodeWorkers`, started in the background)
    whole objects are restored in them, straight from the arena into the blocks by CUDA IPC: a thread
    of the engine's process restores at a small fraction of the rate beside vLLM's loop, which holds
    the GIL (``benchmarks/paged_restore/engine_restore``)."""

    def __init__(self, tensors: torch.Tensor | Sequence[torch.Tensor], layout: kvbuffer.PagedLayout, tokens: int,
                 engine: EngineDecode | None = None, procs: int = 0):
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"staging tokens must be a positive integer, not {tokens!r}")
        self.paged = kvbuffer.PagedKV(tensors, layout)
        L, H, D = self.paged.shape
        self.buffer = ipc.allocate((L, 2, H, tokens, D), self.paged.dtype)
        self.tokens, self.handle = tokens, self.buffer.handle
        self.lock = threading.Lock()
        self.stream = torch.cuda.Stream(self.paged.device) if self.paged.device.type == "cuda" else None
        bs = layout.block_size
        per_token = L * 2 * H * D * kvbuffer.bytes_per_value(self.paged.dtype)
        self.copy_tokens = max(bs, COPY_BYTES // per_token // bs * bs)
        self._warned = False
        self.engine, self.model = engine, ""  # the model's fingerprint, once registered
        # engine-decode mode: two arenas, the buffer and one more of its size, so that the sidecar fills one with the next
        # window while this process restores the other; each as (its id once registered, its memory, its bytes)
        self._spare = ipc.allocate((L, 2, H, tokens, D), self.paged.dtype) if engine is not None else None
        self.arenas: list[tuple[str | None, ipc.SharedBuffer, memoryview]] = [
            (None, b, memoryview(b.tensor.view(-1).view(torch.uint8).numpy())) for b in (self.buffer, self._spare) if b is not None]
        self._ahead = ThreadPoolExecutor(1, thread_name_prefix="kvfetcher-window") if engine is not None else None
        self._decoded: dict[str, tuple[int, float]] = {}  # per preset: KV bytes and seconds not yet reported
        self._cold: set[str] = set(getattr(engine, "formats", ()))  # formats whose first decode (set-up) is not reported
        host = [b.tensor for b in (self.buffer, self._spare) if b is not None]
        self._unpin = pin_while_alive(self, host) if self.paged.device.type == "cuda" else None
        self.workers: RestoreProcs | None = None  # engine-decode on a GPU: restores in processes of its own
        if engine is not None and procs > 0 and self.paged.device.type == "cuda":
            self.workers = RestoreProcs(cuda_paged_handle(tensors, layout), procs, engine.formats)

    def register(self, client: KVClient, model: str, tp_rank: int) -> str:
        """Register the buffer with the sidecar (in engine-decode mode a second time, as an arena,
        and the spare as the other arena); the id that stores use."""
        buffer = client.register(self.handle, model, tp_rank)
        if self.engine is not None:
            self.arenas = [(client.register(b.handle, model, tp_rank, self.engine), b, m) for _, b, m in self.arenas]
        self.model = model
        return buffer

    @property
    def arena(self) -> str | None:
        """The first arena's id (engine-decode mode, once registered)."""
        return self.arenas[0][0] if self.engine is not None else None

    def close(self) -> None:
        try:
            if self._ahead is not None:
                self._ahead.shutdown(wait=True)
            if self.workers is not None:
                self.workers.close()
        finally:
            if self._unpin is not None:
                self._unpin()
            for b in (self.buffer, self._spare):
                if b is not None:
                    b.close()

    # --- fetches -----------------------------------------------------------------------------

    def fetch(self, client: KVClient, buffer: str, tokens: Sequence[int], block_ids: Sequence[int], first: int, end: int,
              plan: FetchPlan | None = None, options: FetchOptions | None = None) -> int:
        """Fetch tokens ``first .. end`` of ``tokens`` (``first`` whole blocks) into ``block_ids`` (the
        prompt's blocks from token 0) through the registered staging ``buffer``, window by window
        until one fetches less than it asked for; the end of the tokens written (whole blocks, at
        least ``first``). ``plan`` (made for exactly ``tokens``) is used when one window holds
        them all; other windows look up with ``options`` (``options.deadline_s`` bounds the whole fetch)."""
        if self.engine is not None:
            return self._fetch_objects(client, tokens, block_ids, first, end, plan, options)
        o = options or FetchOptions()
        bs, done, t0 = self.paged.layout.block_size, first, time.monotonic()
        with self._held(o.deadline_s) as held:
            while held and done < end:
                left = None if o.deadline_s is None else o.deadline_s - (time.monotonic() - t0)
                if left is not None and left <= 0:
                    break
                stop = min(len(tokens), done + self.tokens)
                use = plan if stop == len(tokens) else None  # a plan is bound to all of its tokens
                chosen = use is not None and use.preset is not None  # then only the deadline goes with it
                window = FetchOptions(deadline_s=left) if chosen else replace(o, deadline_s=left)
                reply = client.fetch(buffer, tokens[:stop], use, options=window, offset=-done, first_token=done)
                self._check_size(reply.chunk_tokens)
                upto = min(reply.loaded_tokens, end) // bs * bs
                if upto > done:
                    self._to_blocks(block_ids, done, upto)
                if upto <= done or reply.loaded_tokens < reply.requested_tokens:
                    return max(done, upto)
                done = upto
        return done

    def _fetch_objects(self, client: KVClient, tokens: Sequence[int], block_ids: Sequence[int], first: int, end: int,
                       plan: FetchPlan | None, options: FetchOptions | None) -> int:
        """:meth:`fetch` in engine-decode mode: windows of what fits an arena, each restored here
        while the sidecar fills the other arena with the next (a window that fails to restore
        whole ends the fetch, its successor fetched for nothing, and waited for: no write into an
        arena outlives the fetch). The deadline, and a chosen plan's break-even, bound the restores
        here as they bound the sidecar's reads: past them the rest is recomputed."""
        o = options or FetchOptions()
        chosen = plan is not None and plan.preset is not None  # then only the deadline goes with it
        t0 = time.monotonic()
        bounds = [b for b in (o.deadline_s, plan.breakeven_s if chosen else None) if b is not None]
        stop_at = t0 + min(bounds) if bounds else None

        def window(at: int, arena: int, decoded: list[EngineDecoded]) -> FetchReply | None:
            left = None if o.deadline_s is None else o.deadline_s - (time.monotonic() - t0)
            if left is not None and left <= 0:
                return None
            opts = FetchOptions(deadline_s=left) if chosen else replace(o, deadline_s=left)
            return client.fetch(self.arenas[arena][0], tokens, plan, options=opts, first_token=at, decoded=decoded)

        done, i = first, 0
        with self._held(None if stop_at is None else stop_at - t0) as held:
            ahead = self._ahead.submit(window, done, i, self._report()) if held and done < end else None
            try:
                while ahead is not None:
                    reply, ahead = ahead.result(), None
                    if reply is None:  # the deadline passed before the window was asked
                        break
                    nxt = reply.loaded_tokens
                    if reply.reason is None and done < nxt < min(end, reply.requested_tokens):  # the next window, while this one restores
                        ahead = self._ahead.submit(window, nxt, 1 - i, self._report())
                    upto = self._restore(reply, block_ids, done, end, i, stop_at)
                    if ahead is None or upto < nxt:
                        return max(done, upto)
                    done, i = upto, 1 - i
            finally:
                if ahead is not None:
                    ahead.exception()  # (a window fetched ahead for nothing: its writes end before the arena is used again)
        return done

    @contextmanager
    def _held(self, wait_s: float | None):
        """The buffer's lock (a store through it holds it while it copies out), waited for at most
        ``wait_s`` seconds (None: as long as it takes); yields whether it is held: a fetch whose
        deadline passes first loads nothing."""
        held = self.lock.acquire(timeout=-1 if wait_s is None else max(0.0, wait_s))
        if not held:
            log.warning("kvfetcher: the staging buffer stayed busy (a store copying out) past the fetch's deadline: recomputing")
        try:
            yield held
        finally:
            if held:
                self.lock.release()

    def _restore(self, reply: FetchReply, block_ids: Sequence[int], first: int, end: int, arena: int,
                 stop_at: float | None = None) -> int:
        """Restore the reply's objects (whole chunks ending by ``end``, in arena number ``arena``) into
        the blocks, tokens from ``first`` on, in order until one fails or ``stop_at`` (monotonic
        seconds) has passed; the end of the tokens written (at least ``first``). Whole objects go
        to the restore processes when they are ready, the one straddling ``first`` is restored here."""
        n = reply.chunk_tokens
        objects = [o for o in reply.objects or () if o[0] + n <= end]
        if not objects or not n:
            return first
        dest = kvbuffer.PagedDestination(self.paged, block_ids, objects[-1][0] + n, first_token=first)
        _, shared, memory = self.arenas[arena]
        head = [o for o in objects if o[0] < first]  # (the chunk straddling ``first``: only its tail is written)
        done = self._restore_here(dest, head, first, n, memory, stop_at)
        rest = [o for o in objects if o[0] >= first]
        if not rest or head and done == first:
            return done
        if self.workers is not None and self.workers.ready():
            t = time.perf_counter()
            done, restored = self.workers.restore(dest, rest, done, n, memory, shared, self.model, stop_at)
            for h, kv_bytes in restored:  # (they ran side by side: each is reported its share of the wall time)
                self._decoded_one(h, kv_bytes, (time.perf_counter() - t) / len(restored))
            if self.workers.ready():
                return done
            rest = [o for o in rest if o[0] >= done]
        return self._restore_here(dest, rest, done, n, memory, stop_at)

    def _restore_here(self, dest: kvbuffer.PagedDestination, objects: list, first: int, n: int, memory: memoryview,
                      stop_at: float | None) -> int:
        """Restore ``objects`` in this thread, in order, from token ``first`` (the end written)."""
        done = first
        with self._on_stream():
            for start, offset, size in objects:
                if stop_at is not None and time.monotonic() > stop_at:
                    log.warning("kvfetcher: restoring stored objects here ran past the fetch's deadline or break-even at "
                                "token %d: recomputing from there", start)
                    break
                if start > done or offset < 0 or offset + size > len(memory):
                    log.warning("kvfetcher: the sidecar named a stored object the buffer does not hold in order (token %d, bytes %d+%d)",
                                start, offset, size)
                    break
                t = time.perf_counter()
                try:
                    h, kv_bytes = chunk.restore_object(dest, kvbuffer.ChunkRef("", size, start, n), memory[offset : offset + size],
                                                       self.model, device=self.paged.device)
                except (ContainerError, GeometryMismatchError, CodecError, ValueError) as e:
                    log.warning("kvfetcher: a stored object for tokens %d.. did not restore here, recomputing from there: %s", start, e)
                    break
                self._decoded_one(h, kv_bytes, time.perf_counter() - t)
                done = start + n
        return done

    def _decoded_one(self, h, kv_bytes: int, seconds: float) -> None:
        """Count one object's restore for the next report (not a format's first: it paid the decoder's set-up)."""
        fmt = h.codec.format
        if fmt in self._cold:
            self._cold.discard(fmt)
            return
        b, s = self._decoded.get(h.preset, (0, 0.0))
        self._decoded[h.preset] = (b + kv_bytes, s + seconds)

    def _report(self) -> list[EngineDecoded]:
        """The restores since the last report, per preset (sent with the next fetch)."""
        out, self._decoded = [EngineDecoded(p, b, s) for p, (b, s) in self._decoded.items()], {}
        return out

    def _to_blocks(self, block_ids: Sequence[int], start: int, end: int) -> None:
        """Copy tokens ``start .. end`` from the staging (token ``start`` in slot 0) into their blocks,
        finished when this returns."""
        with self._on_stream():
            for a in range(start, end, self.copy_tokens):
                b = min(end, a + self.copy_tokens)
                kv = self.buffer.tensor[:, :, :, a - start : b - start]
                self.paged.write(self.paged.blocks_of(block_ids, a, b - a), kv)
            self._sync()

    # --- stores -----------------------------------------------------------------------------

    def store(self, client: KVClient, buffer: str, tokens: Sequence[int], block_ids: Sequence[int], chunk_tokens: int,
              first_token: int = 0) -> int:
        """Store ``tokens`` (whole chunks of ``chunk_tokens``) from ``block_ids`` through the staging
        ``buffer``, in windows of whole chunks from ``first_token`` (whole chunks: those before it
        are stored already and not copied out), until the sidecar drops one (the store queue is
        full: later chunks would follow a gap); the chunks it took (queued, or stored already).
        Every block has been copied out when this returns."""
        window = self.tokens // chunk_tokens * chunk_tokens
        if not window:
            self._check_size(chunk_tokens)
            return 0
        taken = 0
        with self.lock:
            for a in range(first_token, len(tokens) // chunk_tokens * chunk_tokens, window):
                b = min(len(tokens), a + window)
                self._from_blocks(block_ids, a, b)
                rep = client.store(buffer, tokens[:b], offset=-a, first_token=a)
                taken = rep.queued_chunks + rep.skipped_chunks
                if rep.dropped_chunks or rep.dropped:
                    break
        return taken

    def _from_blocks(self, block_ids: Sequence[int], start: int, end: int) -> None:
        """Copy tokens ``start .. end`` from their blocks into the staging (token ``start`` in slot 0):
        in the restore processes where they are ready, else here."""
        pieces = [(self.paged.blocks_of(block_ids, a, min(end, a + self.copy_tokens) - a), a - start)
                  for a in range(start, end, self.copy_tokens)]
        if self.workers is not None and self.workers.ready() and self.workers.copy_out(pieces, self.buffer, self.tokens):
            return
        bs = self.paged.layout.block_size
        with self._on_stream():  # (read_into has finished each piece's copy when it returns)
            for blocks, at in pieces:
                self.paged.read_into(blocks, self.buffer.tensor[:, :, :, at : at + len(blocks) * bs])

    # --- helpers ---------------------------------------------------------------------------

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def _sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def _check_size(self, chunk_tokens: int | None) -> None:
        if chunk_tokens and self.tokens < chunk_tokens and not self._warned:
            self._warned = True
            log.warning("kvfetcher: the staging buffer of %d tokens holds no whole chunk of %d tokens: nothing fetches or stores "
                        "through it; raise staging_tokens", self.tokens, chunk_tokens)
