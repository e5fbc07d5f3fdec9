"""decode_worker: a decode worker process — the messages on its pipe and its loop.

The coordinator (:mod:`fetch.workers`) writes a chunk's stored bytes into the worker's *slab*, a
memfd of the coordinator (:class:`Slab`), and sends a small :class:`Restore`; the worker restores the chunk with
:func:`chunk.restore_chunk` (every checksum verified and every segment decoded before a byte is
written) into the KV buffer an IPC handle names, which it maps once and keeps, and answers
:class:`Restored` or :class:`Failed`. :class:`Open`, :class:`Forget` and :class:`Stop` are
one-way. One definition of each message serves both ends of the pipe.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import torch

from kvfetcher.chunk import restore_chunk
from kvfetcher.fetch.slab import Slab
from kvfetcher.errors import ContainerError
from kvfetcher.format import container
from kvfetcher.format.mac import ObjectMAC
from kvfetcher.kvbuffer import ChunkRef, Destination, PagedDestination, PagedKV

log = logging.getLogger("kvfetcher.fetch.decode_worker")

MAX_OPEN_BUFFERS = 8  # handles a worker keeps open (least recently used are dropped)
#: shared memories a worker keeps mapped (least recently used are unmapped): a sidecar's slab, an
#: engine's two arenas, or the reader processes' staging buffers that entropy-coded chunks are
#: restored from (a fetch's window of them, in a few size classes), mapped once rather than per chunk
MAX_SLABS = 64
#: the largest mapping a worker page-locks (:class:`_Mapping`): staging buffers and a sidecar's slab
#: are MBs to a few hundred; an engine's arenas can be GBs, whose pinning would hold up their first restore
PIN_MAX_BYTES = 256 << 20


@dataclass(frozen=True)
class IntoBuffer:
    """Restore into the KV buffer an IPC ``handle`` names (``key``: :func:`workers.handle_key`)."""

    key: str
    handle: dict


@dataclass(frozen=True)
class IntoScratch:
    """Restore into a fresh tensor of the chunk's own shape on ``device`` (a warm-up)."""

    device: str


@dataclass(frozen=True)
class Restore:
    """Restore one chunk: its prefix + header bytes, its parts at ``spans`` of the slab file
    (side information first), written to ``where`` in ``target`` (slots of a flat buffer, blocks of
    a paged one: ``Destination.where``); with ``auth`` its header and parts must verify under it.
    ``trusted``: its bytes may go to a decoder that does not validate its input (``chunk.decode_verified``).
    Answered by :class:`Restored` or :class:`Failed`."""

    target: IntoBuffer | IntoScratch
    header: bytes
    slab: tuple[str, int]  # path and size of the worker's slab (Slab.path)
    spans: tuple[tuple[int, int], ...]
    where: tuple[int, ...]
    auth: ObjectMAC | None = None
    trusted: bool = True


@dataclass(frozen=True)
class RestoreMany:
    """Restore chunks in order, each a :class:`Restore` of ``target`` from ``memory`` given as its
    (header, spans, where), until one fails or ``stop_at`` (``time.monotonic`` seconds, the same
    clock in every process) has passed: one message for many chunks. Answered by :class:`RestoredMany`."""

    target: IntoBuffer
    memory: tuple[str, int]
    items: tuple[tuple[bytes, tuple[tuple[int, int], ...], tuple[int, ...]], ...]
    stop_at: float | None = None


@dataclass(frozen=True)
class RestoredMany:
    """The KV bytes of each chunk restored, in order, and why the next was not (None: every one
    was, or ``stop_at`` had passed)."""

    kv_bytes: tuple[int, ...]
    failed: Failed | None = None


@dataclass(frozen=True)
class CopyOut:
    """Copy the KV of each piece's blocks of the paged buffer ``target`` names into token slots from
    the piece's ``start`` on of a flat ``[layers, 2, kv_heads, slots, head_dim]`` buffer of its dtype
    in shared ``memory`` (a path and a size, as :class:`Slab` names one). Answered by :class:`Copied`
    or :class:`Failed`."""

    target: IntoBuffer
    pieces: tuple[tuple[tuple[int, ...], int], ...]  # (blocks, start)
    memory: tuple[str, int]
    slots: int


@dataclass(frozen=True)
class Copied:
    """The blocks' KV is in the shared buffer: its bytes."""

    nbytes: int


@dataclass(frozen=True)
class Open:
    """Map a buffer now (one-way); a failure is remembered and reported for its chunks."""

    key: str
    handle: dict


@dataclass(frozen=True)
class Forget:
    """Drop a buffer and any remembered failure to open it (one-way)."""

    key: str


@dataclass(frozen=True)
class Stop:
    """Exit the worker's loop (one-way)."""


@dataclass(frozen=True)
class Ready:
    """The worker has started (its first message)."""

    cuda: bool


@dataclass(frozen=True)
class Restored:
    """The chunk is in its slots: KV bytes written, seconds per step (``prepare_s``, ``decode_s``, ``write_s``)."""

    kv_bytes: int
    seconds: dict[str, float]


@dataclass(frozen=True)
class Failed:
    """The chunk was not written. ``kind``: ``object`` (the stored object is bad; ``error`` names
    its :class:`ContainerError` class), ``open`` (the buffer cannot be mapped) or ``worker``."""

    kind: Literal["object", "open", "worker"]
    error: str  # the exception's class name
    message: str

    def __str__(self) -> str:
        return f"{self.error}: {self.message}"


class _OpenFailed(Exception):
    pass


@dataclass
class _Mapping:
    """A shared memory a worker keeps mapped: its slab, the file's inode when mapped, and where CUDA
    page-locked the mapping (:func:`kvfetcher.ipc.pin`) a host tensor over it that the GPU copies
    from by DMA (an entropy decode's payload, in place: no copy through a bounce buffer)."""

    slab: Slab
    inode: int | None
    host: torch.Tensor | None

    def close(self) -> None:
        """Unpin and unmap; no view of the slab may be alive."""
        if self.host is not None:
            from kvfetcher import ipc

            ipc.unpin(self.host)
            self.host = None
        self.slab.close()


class _WorkerState:
    """What a worker keeps between requests: the buffers it mapped (and those it could not), its slabs."""

    def __init__(self) -> None:
        self.buffers: OrderedDict = OrderedDict()
        self.unopenable: dict[str, str] = {}
        self.slabs: OrderedDict[str, _Mapping] = OrderedDict()  # path -> its mapping, least recently used first

    def buffer(self, key: str, handle: dict) -> torch.Tensor | PagedKV:
        from kvfetcher import ipc

        if key in self.unopenable:
            raise _OpenFailed(self.unopenable[key])
        buf = self.buffers.get(key)
        if buf is None:
            try:
                buf = self.buffers[key] = ipc.open_handle(handle)
            except Exception as e:
                self.unopenable[key] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
                raise _OpenFailed(self.unopenable[key]) from e
            while len(self.buffers) > MAX_OPEN_BUFFERS:
                self.buffers.popitem(last=False)
        self.buffers.move_to_end(key)
        return buf

    def forget(self, key: str) -> None:
        self.buffers.pop(key, None)
        self.unopenable.pop(key, None)

    def destination(self, target: IntoBuffer | IntoScratch, h: container.Header, where: tuple[int, ...]) -> Destination:
        """The chunk's destination: ``where`` in the buffer ``target`` names, or a scratch tensor."""
        buf = torch.empty(h.shape, dtype=h.torch_dtype, device=target.device) if isinstance(target, IntoScratch) else \
            self.buffer(target.key, target.handle)
        if isinstance(buf, PagedKV):
            return PagedDestination(buf, where, len(where) * buf.layout.block_size)
        return Destination(buf, slots=where)

    def view(self, path: str, size: int) -> tuple[memoryview, torch.Tensor | None]:
        """The shared memory ``path`` names, mapped once (the :data:`MAX_SLABS` latest stay mapped: a
        sidecar's slab, grown now and then; an engine's two arenas, used in turn): a view of it, and
        the page-locked host tensor over it where CUDA pinned it (:class:`_Mapping`)."""
        for known, m in list(self.slabs.items()):
            if _inode(known) != m.inode:  # its owner closed it (a sidecar's slab that grew), or its fd number names another file now
                m.close()
                del self.slabs[known]
        m = self.slabs.get(path)
        if m is None or m.slab.size != size:
            if m is not None:
                m.close()
            m = self.slabs[path] = _map(path, size)
            while len(self.slabs) > MAX_SLABS:
                self.slabs.popitem(last=False)[1].close()
        self.slabs.move_to_end(path)
        return memoryview(m.slab.mm), m.host


def _map(path: str, size: int) -> _Mapping:
    """Map ``path`` and, in a worker already using CUDA (one that restores into a GPU: never a CUDA
    context for pinning alone), page-lock the mapping if it is at most :data:`PIN_MAX_BYTES` (a
    failure leaves it pageable)."""
    from kvfetcher import ipc

    slab = Slab(size, path)
    host = torch.frombuffer(slab.mm, dtype=torch.uint8) if torch.cuda.is_initialized() and 0 < size <= PIN_MAX_BYTES else None
    return _Mapping(slab, _inode(path), host if host is not None and ipc.pin(host) else None)


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def parts_at(mem: memoryview, host: torch.Tensor | None, spans, side: bool) -> tuple[memoryview | None, list]:
    """(side information, segments) of a chunk at ``spans`` of a mapping (:meth:`_WorkerState.view`):
    the segments as slices of its page-locked tensor where there is one (an entropy decode copies
    them to the GPU from in place), else of its view."""
    spans = list(spans)
    first = mem[slice(*spans.pop(0))] if side else None
    return first, [mem[a:b] if host is None else host[a:b] for a, b in spans]


def _restore(state: _WorkerState, req: Restore) -> Restored:
    """In a worker: restore one chunk from the slab into its target (:func:`chunk.restore_chunk`)."""
    t0 = time.perf_counter()
    h = container.parse_header(req.header, req.auth)
    dest = state.destination(req.target, h, req.where)
    mem, host = state.view(*req.slab)
    side, parts = parts_at(mem, host, req.spans, h.side is not None)
    times: dict[str, float] = {"prepare_s": time.perf_counter() - t0}
    try:
        n = restore_chunk(dest, ChunkRef("", 0, 0, dest.tokens), h, side, parts, times=times, auth=req.auth, trusted=req.trusted)
    finally:
        del parts, side, host  # no view of the slab may outlive the request (it can be remapped)
        mem.release()
    return Restored(n, times)


def _copy_out(state: _WorkerState, req: CopyOut) -> Copied:
    """In a worker: each piece's blocks copied into the shared flat buffer (:meth:`PagedKV.read_into`)."""
    kv = state.buffer(req.target.key, req.target.handle)
    if not isinstance(kv, PagedKV):
        raise _OpenFailed("a copy-out reads a paged buffer")
    L, H, D = kv.shape
    mem, _ = state.view(*req.memory)
    nbytes = 0
    try:
        flat = torch.frombuffer(mem, dtype=kv.dtype, count=L * 2 * H * req.slots * D).view(L, 2, H, req.slots, D)
        bs = kv.layout.block_size
        for blocks, start in req.pieces:
            out = flat[:, :, :, start : start + len(blocks) * bs]
            kv.read_into(list(blocks), out)
            nbytes += out.numel() * out.element_size()
        del flat
    finally:
        mem.release()
    return Copied(nbytes)


def _restore_many(state: _WorkerState, req: RestoreMany) -> RestoredMany:
    done: list[int] = []
    for header, spans, where in req.items:
        if req.stop_at is not None and time.monotonic() > req.stop_at:
            break
        reply = _answer(state, Restore(req.target, header, req.memory, spans, where))
        if isinstance(reply, Failed):
            return RestoredMany(tuple(done), reply)
        done.append(reply.kv_bytes)
    return RestoredMany(tuple(done))


def _answer(state: _WorkerState, req: Restore | CopyOut) -> Restored | Copied | Failed:
    try:
        return _copy_out(state, req) if isinstance(req, CopyOut) else _restore(state, req)
    except ContainerError as e:
        return Failed("object", type(e).__name__, str(e))
    except _OpenFailed as e:
        return Failed("open", "BufferOpenError", str(e))
    except Exception as e:  # CUDA / decoder failure: not the object's fault
        log.exception("decode worker %d failed", os.getpid())
        return Failed("worker", type(e).__name__, str(e))


def serve(conn) -> None:
    """Worker main loop: one message at a time; a :class:`Restore`, :class:`RestoreMany` or :class:`CopyOut` is answered, the others are not."""
    torch.set_num_threads(1)
    state = _WorkerState()
    conn.send(Ready(torch.cuda.is_available()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        match msg:
            case Restore() | CopyOut():
                conn.send(_answer(state, msg))
            case RestoreMany():
                conn.send(_restore_many(state, msg))
            case Open(key, handle):
                try:
                    state.buffer(key, handle)
                except _OpenFailed as e:  # remembered: every chunk for this buffer will say so
                    log.warning("decode worker %d cannot open buffer %s: %s", os.getpid(), key, e)
            case Forget(key):
                state.forget(key)
            case Stop():
                return
            case _:
                raise TypeError(f"not a decode worker message: {msg!r}")
