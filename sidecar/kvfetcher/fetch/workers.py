"""workers: decode chunks and restore them into the KV buffers in worker processes.

Why processes: NVDEC sessions driven from threads of one process do not scale, one session per
process does; and an entropy-coded chunk's restore (nvCOMP, the unpack) in the sidecar's threads
waits on the GIL they share (:meth:`DecodeWorkers.restore_from`: from shared staging, no slab).
So each worker owns its decoders and opens the destination KV buffer itself, once, through the
buffer's IPC handle (CUDA IPC on a GPU, a sealed memfd on a CPU: :mod:`ipc`): decoded
values go straight into the model's memory. The compressed bytes cross the process boundary
through a shared-memory *slab* per worker (one copy in; NVDEC reads them in place) and only a
small typed message goes through the pipe (:mod:`fetch.decode_worker`: the worker's side).
Checksums are computed in the workers, in parallel, so that the coordinator's event loop is not
the limit.

Failure semantics are the executor's: a worker restores a chunk with
:func:`chunk.restore_chunk` (every checksum verified and every segment decoded before a byte is
written), so a chunk that fails leaves the buffer untouched. A worker that dies is replaced; the
chunk it held is reported as failed.

Cold start: a fresh worker has only imported torch. Its first chunk would also pay for the CUDA
context, loading libnvcuvid, the unpack kernels, the model's basis on the device and the buffer's
IPC mapping. :meth:`DecodeWorkers.warm` pays all but the last at start-up, by restoring tiny
chunks (:func:`warmup_object`) into scratch tensors through the same path;
:meth:`DecodeWorkers.open` maps a buffer when the model registers it. (NVDEC decoders are kept
per frame geometry: a real chunk's first one still opens its own decoder.)
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvfetcher.chunk import encode_chunk, restore_chunk
from kvfetcher.codec import basis
from kvfetcher.errors import ContainerError
from kvfetcher.fetch.slab import Slab
from kvfetcher.fetch.decode_worker import (
    Copied,
    CopyOut,
    Failed,
    Forget,
    IntoBuffer,
    IntoScratch,
    Open,
    Restore,
    Restored,
    RestoreMany,
    RestoredMany,
    Stop,
    serve,
)
from kvfetcher.format import container, presets
from kvfetcher.format.mac import ObjectMAC
from kvfetcher.kvbuffer import ChunkRef, Destination

log = logging.getLogger("kvfetcher.fetch.workers")

MIN_SLAB = 64 << 20  # bytes of compressed chunk a worker's slab holds before it grows
WARM_TOKENS = 16  # tokens of a warm-up chunk: an exact row, a trellis body and its sparse rows
WARM_TIMEOUT_S = 120.0  # a warm-up chunk that takes longer is abandoned and its worker replaced


class WorkerError(RuntimeError):
    """A worker failed for a reason that is not the object's fault (crash, CUDA error)."""


class BufferOpenError(WorkerError):
    """The workers cannot map this KV buffer: the caller decodes in its own process instead.

    Why a fallback: opening a CUDA IPC buffer allocated after another one had been mapped has
    failed ("invalid resource handle") for reasons not understood. A worker remembers a buffer it
    failed to open until it is forgotten.
    """


def handle_key(handle: dict) -> str:
    return hashlib.sha256(json.dumps(handle, sort_keys=True).encode()).hexdigest()[:24]


_OBJECT_ERRORS = {c.__name__: c for c in (ContainerError, *ContainerError.__subclasses__())}


def _exception(reply: Failed) -> Exception:
    """The coordinator's exception for a worker's :class:`Failed` reply."""
    if reply.kind == "object":
        return _OBJECT_ERRORS.get(reply.error, ContainerError)(reply.message)
    if reply.kind == "open":
        return BufferOpenError(reply.message)
    return WorkerError(str(reply))


_daemon_flag = threading.Lock()  # (may_start_children changes the process's flag: one at a time)


@contextmanager
def may_start_children() -> Iterator[None]:
    """Let this process start processes although it is daemonic (vLLM starts its tensor-parallel
    workers so, and a vLLM engine starts restore processes: ``integrations.restore_procs``).
    multiprocessing refuses, lest a killed daemon leave its children orphaned; decode workers are
    daemonic themselves and exit when their pipe to this process closes."""
    with _daemon_flag:
        me = mp.current_process()
        daemonic = me.daemon
        if daemonic:
            me.daemon = False
        try:
            yield
        finally:
            if daemonic:
                me.daemon = True


class _Worker:
    """One worker process and its end of the pipe, seen from the coordinator."""

    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child,), daemon=True, name="kvf-decode-worker")
        with may_start_children():
            self.proc.start()
        child.close()
        self.stopped = False
        self.lock = threading.Lock()  # one request at a time (slab, send, reply)
        self.send_lock = threading.Lock()  # one writer on the pipe: a one-way message need not wait for a reply
        self.slab: Slab | None = None

    def _slab_for(self, size: int) -> Slab:
        """This worker's slab, grown (a new memfd; the worker remaps on the next request) if too small."""
        if self.slab is None or self.slab.size < size:
            old = self.slab
            self.slab = Slab(max(MIN_SLAB, 1 << (size - 1).bit_length()))  # a new fd: a path the worker has not mapped
            if old is not None:  # the worker maps the old one until its next request: closing it is safe
                old.close()
        return self.slab

    def call(self, target: IntoBuffer | IntoScratch, header: bytes, blobs: Sequence[bytes], where: Sequence[int],
             timeout: float | None = None, auth: ObjectMAC | None = None, trusted: bool = True) -> Restored | Failed:
        """Restore one chunk (``blobs``: its parts, side information first) into ``where`` of ``target``
        (slots, or blocks of a paged buffer); the worker's reply (``auth``, ``trusted``: :class:`Restore`).
        Past ``timeout`` seconds the worker is given up on (WorkerError): replace it."""
        with self.lock:
            slab = self._slab_for(sum(len(b) for b in blobs))
            spans, at = [], 0
            for b in blobs:
                slab.mm[at : at + len(b)] = b
                spans.append((at, at + len(b)))
                at += len(b)
            return self._ask(Restore(target, header, (slab.path, slab.size), tuple(spans), tuple(int(s) for s in where), auth, trusted),
                             timeout)

    def ask(self, req: Restore | RestoreMany | CopyOut, timeout: float | None = None) -> Restored | RestoredMany | Copied | Failed:
        """The worker's answer to ``req``, whose shared memory it maps itself (no copy here)."""
        with self.lock:
            return self._ask(req, timeout)

    def _ask(self, req: Restore | RestoreMany | CopyOut, timeout: float | None) -> Restored | RestoredMany | Copied | Failed:
        try:
            with self.send_lock:
                self.conn.send(req)
            if timeout is not None and not self.conn.poll(timeout):
                raise WorkerError(f"decode worker {self.proc.pid} did not answer within {timeout:g} s")
            return self.conn.recv()
        except (EOFError, OSError, BrokenPipeError) as e:
            raise WorkerError(f"decode worker {self.proc.pid} died: {e}") from e

    def post(self, msg: Open | Forget | Stop) -> None:
        """A one-way message: queued behind a request in flight, without waiting for it."""
        with self.send_lock:
            try:
                self.conn.send(msg)
            except (OSError, BrokenPipeError, ValueError):
                pass  # a dead worker (replaced at its next request), or a stopped one

    def ready(self) -> None:
        if not self.conn.poll(120):
            raise WorkerError("decode worker did not start within 120 s")
        self.conn.recv()

    def stop(self) -> None:
        """Stop the process and close its pipe and slab; once (a second call does nothing)."""
        with self.send_lock:
            if self.stopped:
                return
            self.stopped = True
        self.post(Stop())
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
        self.conn.close()
        if self.slab is not None:
            self.slab.close()
            self.slab = None


@dataclass
class Warmup:
    """What :meth:`DecodeWorkers.warm` did, per worker, and what failed."""

    seconds: list[float]  # wall time of each worker's warm-up, seen from the coordinator
    restored: list[int]  # warm-up chunks each worker restored
    errors: list[str]


def _parts(obj: bytes) -> tuple[bytes, list[bytes], list[int]]:
    """A whole stored object as a worker request takes it: header, parts (side first), slots."""
    h = container.parse_header(obj)
    container.check_size(h, len(obj))
    parts = ([h.side] if h.side else []) + list(h.segments)
    return obj[: h.header_size], [container.slice_segment(obj, h, s) for s in parts], list(range(h.shape[3]))


@functools.lru_cache(maxsize=16)
def warmup_object(preset: str, shape: tuple[int, int, int, int] | None = None, dtype: torch.dtype = torch.float16,
                  fingerprint: str | None = None) -> bytes:
    """A valid stored chunk of ``preset`` (synthetic values) to warm workers with.

    Without ``shape`` a tiny one: for a preset with a shipped basis, of the basis's shape and model
    tag, so that the basis and sparse paths run (for another model's chunks they would not, but they
    cost little to warm). With ``shape`` (layers, kv_heads, tokens, head_dim), ``dtype`` and the
    model's ``fingerprint``, a chunk exactly like that model's: the same frame geometry (NVDEC
    decoders are kept per geometry) and the same unpack variant (the fused kernel is compiled per
    head size and chunk length, with or without the basis)."""
    p = presets.get(preset, fingerprint)
    if shape is None:
        layers, heads, tokens, head_dim, fingerprint = 2, 2, WARM_TOKENS, 64, "kvfetcher-warmup"
        if p.layout.basis is not None and p.layout.basis in basis.available():
            layers, heads, head_dim = basis.load(p.layout.basis).shape
            fingerprint = p.layout.basis.rsplit("-", 1)[0]
    else:
        layers, heads, tokens, head_dim = shape
    kv = torch.randn((layers, 2, heads, tokens, head_dim), generator=torch.Generator().manual_seed(0)).to(dtype)
    # a later chunk (start > 0): no exact sink row, as almost every fetched chunk
    return encode_chunk(kv, p, fingerprint or "kvfetcher-warmup", start=tokens if shape else 0,
                        rope_theta=10000.0 if p.pre_rope else None)


def restore_here(obj: bytes, device: str | torch.device) -> int:
    """Restore a whole stored object in this process into a scratch tensor on ``device`` (never a
    KV buffer), as a fetch decoding in the sidecar's threads would: its decoders and kernels (the
    fused unpack compiles per geometry) are then ready. Returns the KV bytes written."""
    h = container.parse_header(obj)
    container.check_size(h, len(obj))
    dest = Destination(torch.empty(h.shape, dtype=h.torch_dtype, device=device), slots=list(range(h.shape[3])))
    side = container.slice_segment(obj, h, h.side) if h.side else None
    return restore_chunk(dest, ChunkRef("", 0, 0, h.shape[3]), h, side, [container.slice_segment(obj, h, s) for s in h.segments])


class DecodeWorkers:
    """A pool of ``procs`` decode processes (``spawn``: CUDA cannot be forked).

    ``restore`` is a coroutine; up to ``procs`` chunks decode at once, one per process.
    ``stats`` sums the workers' seconds per step of the chunks they restored for fetches (prepare:
    parse, open the buffer, map the slab; decode: checksums and decoding; write: unpack).

    On sharing the GPU with the model: NVDEC is a separate engine, but every worker's frame copies
    and unpack kernels run in a CUDA context of its own, which time-slices with the model's unless
    both are clients of one CUDA MPS server. Run the node's GPUs under MPS.
    """

    def __init__(self, procs: int) -> None:
        if procs < 1:
            raise ValueError(f"decode workers need at least one process, not {procs}")
        self.procs = procs
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._idle: asyncio.Queue[_Worker] | None = None
        self._idle_loop: asyncio.AbstractEventLoop | None = None
        #: threads for callers that wait on a worker (:meth:`restore_from`): one per worker
        self.threads = ThreadPoolExecutor(procs, thread_name_prefix="kvf-decode-call")
        self._stats_lock = threading.Lock()
        self._start_lock = threading.Lock()  # held while processes start, are replaced or close
        self._closed = False
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()  # idle workers' places, for callers in threads (_blocking)
        self.stats: dict[str, float] = {"chunks": 0, "prepare_s": 0.0, "decode_s": 0.0, "write_s": 0.0}

    def start(self) -> None:
        """Start the processes and wait until each has imported torch (seconds; do it at start-up)."""
        with self._start_lock:
            if self._closed:
                raise WorkerError("the decode workers were closed")
            if self._workers:
                return
            self._workers = [_Worker(self._ctx) for _ in range(self.procs)]
            for i, w in enumerate(self._workers):
                w.ready()
                self._free.put(i)

    async def restore(self, handle: dict, header: bytes, side: bytes | None, segments: Sequence[bytes], where: Sequence[int],
                      auth: ObjectMAC | None = None, trusted: bool = True) -> int:
        """Restore one chunk in a worker (:func:`chunk.restore_chunk`) into ``where`` (slots, or blocks
        of a paged buffer: ``Destination.where``) of the buffer ``handle`` names; the KV bytes written.

        ``header`` is the object's prefix and header; ``side`` and ``segments`` its (unverified) parts;
        with ``auth`` the worker verifies every tag under it; ``trusted`` as :class:`Restore` takes it.
        Raises the object's :class:`ContainerError`, :class:`BufferOpenError` or :class:`WorkerError`."""
        loop = asyncio.get_running_loop()
        if not self._workers:
            await loop.run_in_executor(self.threads, self.start)
        if self._idle_loop is not loop:  # an asyncio queue belongs to one event loop
            self._idle, self._idle_loop = asyncio.Queue(), loop
            for w in self._workers:
                self._idle.put_nowait(w)
        idle = self._idle
        assert idle is not None
        w = await idle.get()
        try:
            blobs = ([side] if side is not None else []) + list(segments)
            call = functools.partial(w.call, IntoBuffer(handle_key(handle), handle), bytes(header), blobs, where, auth=auth,
                                     trusted=trusted)
            reply = await loop.run_in_executor(self.threads, call)
        except WorkerError:
            w = self._replace(w)
            raise
        finally:
            idle.put_nowait(w)
        if isinstance(reply, Failed):
            raise _exception(reply)
        self._count(reply)
        return reply.kv_bytes

    def restore_many_at(self, handle: dict, memory: tuple[str, int], items: Sequence[tuple[bytes, Sequence[tuple[int, int]], Sequence[int]]],
                        stop_at: float | None = None) -> tuple[list[int], Exception | None]:
        """For a caller's thread: one worker restores chunks in order (:class:`RestoreMany`), each
        given as its header, the spans of its parts (side information first) in shared ``memory``
        (a memfd's path and size, as :class:`Slab` names one, which the worker maps itself) and its
        slots or blocks, until one fails or ``stop_at`` passes; blocks until it has. The KV bytes of
        each restored and the exception of the one that failed (None: none did)."""
        req = RestoreMany(IntoBuffer(handle_key(handle), handle), memory,
                          tuple((bytes(h), tuple(map(tuple, spans)), tuple(int(w) for w in where)) for h, spans, where in items), stop_at)
        reply = self._blocking(req)
        return list(reply.kv_bytes), None if reply.failed is None else _exception(reply.failed)

    def copy_out_at(self, handle: dict, pieces: Sequence[tuple[Sequence[int], int]], memory: tuple[str, int], slots: int) -> int:
        """Have a worker copy the KV of each piece's blocks of the paged buffer ``handle`` names into
        token slots from the piece's start on of a flat buffer of ``slots`` slots in shared ``memory``
        (:class:`CopyOut`); blocks until it has. The bytes copied; :class:`BufferOpenError` or
        :class:`WorkerError`."""
        pieces = tuple((tuple(int(b) for b in blocks), int(start)) for blocks, start in pieces)
        return self._blocking(CopyOut(IntoBuffer(handle_key(handle), handle), pieces, memory, slots)).nbytes

    def restore_from(self, handle: dict, memory: tuple[str, int], header: bytes, spans: Sequence[tuple[int, int]],
                     where: Sequence[int], auth: ObjectMAC | None = None, trusted: bool = True) -> int:
        """For a caller's thread (one of :attr:`threads`): a worker restores one chunk whose parts
        (side information first, unverified) lie at ``spans`` of shared ``memory`` (a memfd's path and
        size, as :class:`Slab` names one, which the worker maps itself: no copy) into ``where`` of the
        buffer ``handle`` names; blocks until it has. The KV bytes written; raises as :meth:`restore`."""
        reply = self._blocking(Restore(IntoBuffer(handle_key(handle), handle), bytes(header), memory,
                                       tuple((int(a), int(b)) for a, b in spans), tuple(int(w) for w in where), auth, trusted))
        self._count(reply)
        return reply.kv_bytes

    def _count(self, reply: Restored) -> None:
        with self._stats_lock:
            self.stats["chunks"] += 1
            for k, v in reply.seconds.items():
                self.stats[k] += v

    def _blocking(self, req: Restore | RestoreMany | CopyOut) -> Restored | RestoredMany | Copied:
        """``req`` answered by the next free worker (a dead one is replaced), for a caller's thread."""
        self.start()
        i = self._free.get()
        try:
            w = self._workers[i]
            reply = w.ask(req)
        except WorkerError:
            self._replace(w)  # (or WorkerError: closed meanwhile)
            raise
        except IndexError:  # closed meanwhile
            raise WorkerError("the decode workers were closed") from None
        finally:
            self._free.put(i)
        if isinstance(reply, Failed):
            raise _exception(reply)
        return reply

    def _replace(self, dead: _Worker) -> _Worker:
        """A new worker in ``dead``'s place (WorkerError once the pool is closed)."""
        with self._start_lock:
            if self._closed:
                raise WorkerError("the decode workers were closed")
            log.error("decode worker %s died; starting another", dead.proc.pid)
            dead.stop()
            w = _Worker(self._ctx)
            w.ready()
            self._workers[self._workers.index(dead)] = w
            return w

    def open(self, handle: dict) -> None:
        """Have every worker map a buffer the model registered, now, not on the first fetch into it.
        A worker that cannot remembers why (as a fetch would have found), and says so for every chunk."""
        for w in self._workers:
            w.post(Open(handle_key(handle), handle))

    def forget(self, handle: dict) -> None:
        """Drop a buffer the model unregistered (workers would otherwise keep it mapped)."""
        for w in self._workers:
            w.post(Forget(handle_key(handle)))

    def warm(self, device: str, objects: Sequence[bytes]) -> Warmup:
        """Restore each stored object in every worker, into a scratch tensor on ``device`` (never a KV
        buffer), through a real chunk's path: the first fetch then finds the CUDA context, NVDEC, the
        unpack kernels and the bases ready. Best effort: failures are logged and returned, a worker that
        dies or hangs is replaced. Blocking (seconds on a GPU); call it at start-up, before any restore."""
        self.start()
        chunks, refused = [], []
        for obj in objects:
            try:
                chunks.append(_parts(obj))
            except ContainerError as e:
                refused.append(f"{type(e).__name__}: {e}")
                log.warning("warm-up object refused (%s)", refused[-1])
        done = list(self.threads.map(functools.partial(self._warm_one, device, chunks), range(self.procs)))
        return Warmup([d[0] for d in done], [d[1] for d in done], refused + [e for d in done for e in d[2]])

    def _warm_one(self, device: str, chunks: list[tuple], i: int) -> tuple[float, int, list[str]]:
        """Worker ``i`` restores every warm-up chunk: (seconds, chunks restored, errors)."""
        t, restored, errors = time.perf_counter(), 0, []
        for header, blobs, slots in chunks:
            w = self._workers[i]
            try:
                reply = w.call(IntoScratch(device), header, blobs, slots, timeout=WARM_TIMEOUT_S)
            except WorkerError as e:
                self._replace(w)
                reply = Failed("worker", type(e).__name__, str(e))
            if isinstance(reply, Restored):
                restored += 1
            else:
                errors.append(f"worker {i}: {reply}")
                log.warning("decode worker warm-up failed (%s)", errors[-1])
        return time.perf_counter() - t, restored, errors

    def close(self) -> None:
        """Stop every worker; nothing starts after (a :meth:`start` under way finishes first)."""
        with self._start_lock:
            self._closed = True
            workers, self._workers, self._free = self._workers, [], queue.SimpleQueue()
        for w in workers:
            w.stop()
        self.threads.shutdown(wait=False)
