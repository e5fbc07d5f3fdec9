"""decode_workers: decode chunks and restore them into the KV buffers in worker processes.

Why processes: NVDEC sessions driven from threads of one process do not scale (0.5 GB/s in
total, FACTS.md), while one session per process does — on an H200, 8 processes decoded
4.1 GB/s of fp16-equivalent KV at about 90% NVDEC utilisation
(docs/benchmarks/nvdec_depth_h200.json). So each worker owns its decoders and opens the
destination KV buffer itself, once, through the buffer's IPC handle (CUDA IPC on a GPU,
``/dev/shm`` on a CPU: :mod:`ipc`): decoded values go straight into the model's memory.
The compressed bytes cross the process boundary through a shared-memory *slab* per worker
(one copy in, NVDEC reads them in place) and only a small message goes through the pipe;
checksums are computed in the workers, in parallel. (A first version pickled the bytes
through the pipe and checked CRCs on the coordinator's event loop: the coordinator, not
NVDEC, became the limit — ~2 GB/s at 35% NVDEC utilisation in a first H200 run whose
output was not kept.)

Failure semantics are the pipeline's: a worker verifies every segment's checksum and decodes
every segment of a chunk before it writes a byte, so a chunk that fails leaves the buffer
untouched. A worker that dies is replaced; the chunk it held is reported as failed.

Cold start: a fresh worker has only imported torch. Its first chunk would also pay for the CUDA
context, loading libnvcuvid, the unpack kernels, the model's basis on the device and the buffer's
IPC mapping: on a user's time to first token, and in the cost model's first decode rate.
:meth:`DecodeWorkers.warm` pays all but the last at start-up, by restoring tiny chunks
(:func:`warmup_object`) into scratch tensors through the same path; :meth:`DecodeWorkers.open`
maps a buffer when the model registers it. (NVDEC decoders are kept per frame geometry: a real
chunk's first one still opens its own decoder, ~20 ms, :class:`codec.nvidia.NvdecDecoder`.)
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import mmap
import multiprocessing as mp
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvfetcher.codec import basis
from kvfetcher import codec
from kvfetcher.format import container, presets

log = logging.getLogger("kvfetcher.fetch.workers")

MAX_OPEN_BUFFERS = 8  # handles a worker keeps open (least recently used are dropped)
MIN_SLAB = 64 << 20  # bytes of compressed chunk a worker's slab holds before it grows
WARM_TOKENS = 16  # tokens of a warm-up chunk: an exact row, a trellis body and its sparse rows
WARM_TIMEOUT_S = 120.0  # a warm-up chunk that takes longer is abandoned and its worker replaced


class WorkerError(RuntimeError):
    """A worker failed for a reason that is not the object's fault (crash, CUDA error)."""


class BufferOpenError(WorkerError):
    """The workers cannot map this KV buffer: the caller decodes in its own process instead.

    Seen on an H200 (torch 2.11): after workers had restored into one CUDA IPC buffer, opening a
    second buffer allocated later failed in ``_new_shared_cuda`` with "invalid resource handle"
    (the first always worked; not yet understood). A failed buffer is remembered per worker.
    """


def handle_key(handle: dict) -> str:
    return hashlib.sha256(json.dumps(handle, sort_keys=True).encode()).hexdigest()[:24]


class _Slab:
    """A file in shared memory, mapped: the coordinator writes a chunk's bytes, a worker reads them."""

    def __init__(self, path: str, size: int, create: bool):
        with open(path, "w+b" if create else "r+b") as f:
            if create:
                f.truncate(size)
            self.mm = mmap.mmap(f.fileno(), size)
        self.path, self.size = path, size

    def close(self, unlink: bool = False) -> None:
        self.mm.close()
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class _OpenFailed(Exception):
    pass


class _WorkerState:
    def __init__(self) -> None:
        self.buffers: OrderedDict = OrderedDict()
        self.unopenable: dict[str, str] = {}
        self.slab: _Slab | None = None

    def buffer(self, key: str, handle: dict) -> torch.Tensor:
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

    def view(self, path: str, size: int) -> memoryview:
        if self.slab is None or self.slab.path != path:
            if self.slab is not None:
                self.slab.close()
            self.slab = _Slab(path, size, create=False)
        return memoryview(self.slab.mm)


def _destination(state: _WorkerState, target: tuple, h: container.Header) -> torch.Tensor:
    """What a chunk is written to: the KV buffer a handle names (``("buffer", key, handle)``), or
    for a warm-up a scratch tensor of the chunk's own shape (``("scratch", device)``)."""
    if target[0] == "scratch":
        return torch.empty(h.shape, dtype=h.torch_dtype, device=target[1])
    return state.buffer(target[1], target[2])


def _restore(state: _WorkerState, msg: tuple) -> tuple[int, dict]:
    """In a worker: verify and decode one chunk fully, then write it to its slots.

    Returns the KV bytes written and seconds per step (for the coordinator's statistics)."""
    from kvfetcher.fetch import executor as pipeline  # the worker's own import; pipeline imports nothing from here at call time

    target, header, slab, spans, slots = msg
    t0 = time.perf_counter()
    h = container.parse_header(header)
    buf = _destination(state, target, h)
    ref = pipeline.ChunkRef("", 0, 0, len(slots))
    dest = pipeline.Destination(buf, slots=slots)
    dest.check(h, ref)
    mem = state.view(*slab)
    parts = [mem[a:b] for a, b in spans]  # side information first if the chunk has any
    side_data = None
    try:
        for seg, data in zip(([h.side] if h.side else []) + list(h.segments), parts, strict=True):
            container.check(seg, data)
        side_data = parts.pop(0) if h.side else None
        t1 = time.perf_counter()
        dec = codec.decoder(h.codec.format, buf.device)
        in_place = getattr(dec, "name", "") in ("nvdec", "raw")  # these read the slab in place; libav wants bytes
        frames = [container.decode_segment(h, seg, d if in_place else bytes(d), dec, buf.device) for seg, d in zip(h.segments, parts)]
        side = container.side_tensor(h, bytes(side_data)) if side_data is not None else None
    finally:
        del parts, side_data  # no view of the slab may outlive the request (it can be remapped)
        mem.release()
    t2 = time.perf_counter()
    dest.write(ref, frames[0] if len(frames) == 1 else torch.cat(frames), side, h)
    t3 = time.perf_counter()
    n = buf[:, :, :, :1].numel() * len(slots) * buf.element_size()
    return n, {"prepare_s": t1 - t0, "decode_s": t2 - t1, "write_s": t3 - t2}


def _serve(conn) -> None:
    """Worker main loop: one request at a time; answers ("ok", bytes, times) or an error tuple."""
    torch.set_num_threads(1)
    state = _WorkerState()
    conn.send(("ready", torch.cuda.is_available()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        if msg[0] == "forget":
            state.buffers.pop(msg[1], None)
            state.unopenable.pop(msg[1], None)
            continue
        if msg[0] == "open":
            try:
                state.buffer(msg[1], msg[2])
            except _OpenFailed as e:  # remembered: every chunk for this buffer will say so
                log.warning("decode worker %d cannot open buffer %s: %s", os.getpid(), msg[1], e)
            continue
        try:
            conn.send(("ok", *_restore(state, msg[1])))
        except container.ContainerError as e:
            conn.send(("container", type(e).__name__, str(e)))
        except _OpenFailed as e:
            conn.send(("open", str(e)))
        except Exception as e:  # CUDA / decoder failure: not the object's fault
            log.exception("decode worker %d failed", os.getpid())
            conn.send(("error", f"{type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True, name="kvf-decode-worker")
        self.proc.start()
        child.close()
        self.lock = threading.Lock()  # one request at a time (slab, send, reply)
        self.send_lock = threading.Lock()  # one writer on the pipe: a one-way message need not wait for a reply
        self.slab: _Slab | None = None

    def _slab_for(self, size: int) -> _Slab:
        """This worker's slab, grown (a new file; the worker remaps on the next request) if too small."""
        from kvfetcher.ipc import shm_dir

        if self.slab is None or self.slab.size < size:
            old = self.slab
            path = str(shm_dir() / f"kvfetcher-slab-{uuid.uuid4().hex}")
            self.slab = _Slab(path, max(MIN_SLAB, 1 << (size - 1).bit_length()), create=True)
            if old is not None:  # the worker maps the old one until its next request: unlinking is safe
                old.close(unlink=True)
        return self.slab

    def call(self, target: tuple, header: bytes, blobs: Sequence[bytes], slots: list[int], timeout: float | None = None) -> tuple:
        """Restore one chunk into ``target`` (see :func:`_destination`); the worker's reply.
        Past ``timeout`` seconds the worker is given up on (WorkerError): replace it."""
        with self.lock:
            slab = self._slab_for(sum(len(b) for b in blobs))
            spans, at = [], 0
            for b in blobs:
                slab.mm[at : at + len(b)] = b
                spans.append((at, at + len(b)))
                at += len(b)
            try:
                with self.send_lock:
                    self.conn.send(("restore", (target, header, (slab.path, slab.size), spans, slots)))
                if timeout is not None and not self.conn.poll(timeout):
                    raise WorkerError(f"decode worker {self.proc.pid} did not answer within {timeout:g} s")
                return self.conn.recv()
            except (EOFError, OSError, BrokenPipeError) as e:
                raise WorkerError(f"decode worker {self.proc.pid} died: {e}") from e

    def post(self, msg: tuple) -> None:
        """A one-way message (open, forget): queued behind a request in flight, without waiting for it."""
        with self.send_lock:
            try:
                self.conn.send(msg)
            except (OSError, BrokenPipeError):
                pass  # a dead worker: replaced at its next request

    def ready(self) -> None:
        if not self.conn.poll(120):
            raise WorkerError("decode worker did not start within 120 s")
        self.conn.recv()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
        if self.slab is not None:
            self.slab.close(unlink=True)
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
    from kvfetcher.chunk import encode_chunk  # chunk needs the encoders, which the workers never import

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


_ERRORS = {c.__name__: c for c in (container.ContainerError, *container.ContainerError.__subclasses__())}


class DecodeWorkers:
    """A pool of ``procs`` decode processes (``spawn``: CUDA cannot be forked).

    ``restore`` is a coroutine; up to ``procs`` chunks decode at once, one per process.
    ``stats`` sums the workers' seconds per step (prepare: open, parse, checksums; decode; write).

    On sharing the GPU with the model: NVDEC is a separate engine, but every worker's frame copies
    and unpack kernels run in a CUDA context of its own. Time-sliced with the model's context, 8
    workers slowed an 8B decode loop by 39-43% on an H100; as clients of one CUDA MPS server, side
    by side, by 9-10% (4 workers: 6%), and capping the workers' MPS share of the SMs made it worse
    (docs/benchmarks/interference_matrix_h100.md). Run the node's GPUs under MPS.
    """

    def __init__(self, procs: int) -> None:
        if procs < 1:
            raise ValueError(f"decode workers need at least one process, not {procs}")
        self.procs = procs
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._idle: asyncio.Queue[_Worker] | None = None
        self._idle_loop: asyncio.AbstractEventLoop | None = None
        self._threads = ThreadPoolExecutor(procs, thread_name_prefix="kvf-decode-call")
        self._start_lock = threading.Lock()
        self.stats: dict[str, float] = {"chunks": 0, "prepare_s": 0.0, "decode_s": 0.0, "write_s": 0.0}

    def start(self) -> None:
        """Start the processes and wait until each has imported torch (seconds; do it at start-up)."""
        with self._start_lock:
            if self._workers:
                return
            self._workers = [_Worker(self._ctx) for _ in range(self.procs)]
            for w in self._workers:
                w.ready()

    async def restore(self, handle: dict, header: bytes, side: bytes | None, segments: Sequence[bytes], slots: Sequence[int]) -> int:
        """Verify and decode one chunk in a worker, then write it to ``slots`` of the buffer ``handle`` names.

        ``header`` is the object's prefix and header; ``side`` and ``segments`` its (unverified) parts."""
        loop = asyncio.get_running_loop()
        if not self._workers:
            await loop.run_in_executor(self._threads, self.start)
        if self._idle_loop is not loop:  # an asyncio queue belongs to one event loop
            self._idle, self._idle_loop = asyncio.Queue(), loop
            for w in self._workers:
                self._idle.put_nowait(w)
        idle = self._idle
        assert idle is not None
        w = await idle.get()
        try:
            blobs = ([side] if side is not None else []) + list(segments)
            reply = await loop.run_in_executor(self._threads, w.call, ("buffer", handle_key(handle), handle), bytes(header), blobs,
                                               [int(s) for s in slots])
        except WorkerError:
            w = self._replace(w)
            raise
        finally:
            idle.put_nowait(w)
        if reply[0] == "ok":
            self.stats["chunks"] += 1
            for k, v in reply[2].items():
                self.stats[k] += v
            return reply[1]
        if reply[0] == "container":
            raise _ERRORS.get(reply[1], container.ContainerError)(reply[2])
        if reply[0] == "open":
            raise BufferOpenError(reply[1])
        raise WorkerError(reply[1])

    def _replace(self, dead: _Worker) -> _Worker:
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
            w.post(("open", handle_key(handle), handle))

    def forget(self, handle: dict) -> None:
        """Drop a buffer the model unregistered (workers would otherwise keep it mapped)."""
        for w in self._workers:
            w.post(("forget", handle_key(handle)))

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
            except container.ContainerError as e:
                refused.append(f"{type(e).__name__}: {e}")
                log.warning("warm-up object refused (%s)", refused[-1])
        done = list(self._threads.map(functools.partial(self._warm_one, device, chunks), range(self.procs)))
        return Warmup([d[0] for d in done], [d[1] for d in done], refused + [e for d in done for e in d[2]])

    def _warm_one(self, device: str, chunks: list[tuple], i: int) -> tuple[float, int, list[str]]:
        """Worker ``i`` restores every warm-up chunk: (seconds, chunks restored, errors)."""
        t, restored, errors = time.perf_counter(), 0, []
        for header, blobs, slots in chunks:
            w = self._workers[i]
            try:
                reply = w.call(("scratch", device), header, blobs, slots, timeout=WARM_TIMEOUT_S)
            except WorkerError as e:
                self._replace(w)
                reply = ("error", str(e))
            if reply[0] == "ok":
                restored += 1
            else:
                errors.append(f"worker {i}: " + ": ".join(map(str, reply[1:])))
                log.warning("decode worker warm-up failed (%s)", errors[-1])
        return time.perf_counter() - t, restored, errors

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []
        self._threads.shutdown(wait=False)
