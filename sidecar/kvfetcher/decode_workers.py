"""decode_workers: decode chunks and restore them into the KV buffers in worker processes.

Why processes: NVDEC sessions driven from threads of one process do not scale (0.5 GB/s in
total, FACTS.md), while one session per process does — on an H200, 8 processes decoded
4.1 GB/s of fp16-equivalent KV at about 90% NVDEC utilisation
(docs/benchmarks/nvdec_depth_h200.json). So each worker owns its decoders and opens the
destination KV buffer itself, once, through the buffer's IPC handle (CUDA IPC on a GPU,
``/dev/shm`` on a CPU: :mod:`ipc`): decoded values go straight into the model's memory and
only the already verified compressed bytes cross the process boundary (one pipe write).

The coordinator (:func:`pipeline.fetch`) keeps the failure semantics: it checks every
segment's checksum before sending, and a worker decodes every segment of a chunk before it
writes a byte, so a chunk that fails leaves the buffer untouched. A worker that dies is
replaced; the chunk it held is reported as failed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import multiprocessing as mp
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from . import codecs, container

log = logging.getLogger("kvfetcher.decode_workers")

MAX_OPEN_BUFFERS = 8  # handles a worker keeps open (least recently used are dropped)


class WorkerError(RuntimeError):
    """A worker failed for a reason that is not the object's fault (crash, CUDA error)."""


def handle_key(handle: dict) -> str:
    return hashlib.sha256(json.dumps(handle, sort_keys=True).encode()).hexdigest()[:24]


def _restore(buffers: OrderedDict, msg: tuple) -> int:
    """In a worker: decode one chunk fully, then write it to its slots. Returns KV bytes written."""
    from . import ipc, pipeline  # the worker's own imports; pipeline imports nothing from here

    key, handle, header, side, segments, slots = msg
    buf = buffers.get(key)
    if buf is None:
        buf = buffers[key] = ipc.open_handle(handle)
        while len(buffers) > MAX_OPEN_BUFFERS:
            buffers.popitem(last=False)
    buffers.move_to_end(key)
    h = container.parse_header(header)
    ref = pipeline.ChunkRef("", 0, 0, len(slots))
    dest = pipeline.Destination(buf, slots=slots)
    dest.check(h, ref)
    dec = codecs.decoder(h.codec.format, buf.device)
    parts = [container.decode_segment(h, seg, data, dec, buf.device) for seg, data in zip(h.segments, segments, strict=True)]
    frames = parts[0] if len(parts) == 1 else torch.cat(parts)
    dest.write(ref, frames, container.side_tensor(h, side) if h.side else None, h)
    return buf[:, :, :, :1].numel() * len(slots) * buf.element_size()


def _serve(conn) -> None:
    """Worker main loop: one request at a time; answers ("ok", n) or an error tuple."""
    torch.set_num_threads(1)
    buffers: OrderedDict = OrderedDict()
    conn.send(("ready", torch.cuda.is_available()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        if msg[0] == "forget":
            buffers.pop(msg[1], None)
            continue
        try:
            conn.send(("ok", _restore(buffers, msg[1])))
        except container.ContainerError as e:
            conn.send(("container", type(e).__name__, str(e)))
        except Exception as e:  # CUDA / decoder failure: not the object's fault
            conn.send(("error", f"{type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True, name="kvf-decode-worker")
        self.proc.start()
        child.close()
        self.lock = threading.Lock()

    def call(self, msg) -> tuple:
        with self.lock:
            try:
                self.conn.send(("restore", msg))
                return self.conn.recv()
            except (EOFError, OSError, BrokenPipeError) as e:
                raise WorkerError(f"decode worker {self.proc.pid} died: {e}") from e

    def ready(self) -> None:
        if not self.conn.poll(120):
            raise WorkerError("decode worker did not start within 120 s")
        self.conn.recv()

    def alive(self) -> bool:
        return self.proc.is_alive()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


_ERRORS = {c.__name__: c for c in (container.ContainerError, container.ForeignObjectError, container.FutureVersionError,
                                   container.TruncatedError, container.CorruptError, container.FingerprintMismatchError)}


class DecodeWorkers:
    """A pool of ``procs`` decode processes (``spawn``: CUDA cannot be forked).

    ``restore`` is a coroutine; up to ``procs`` chunks decode at once, one per process.
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

    def start(self) -> None:
        """Start the processes and wait until each has imported torch (seconds; do it at start-up)."""
        with self._start_lock:
            if self._workers:
                return
            self._workers = [_Worker(self._ctx) for _ in range(self.procs)]
            for w in self._workers:
                w.ready()

    async def restore(self, handle: dict, header: bytes, side: bytes | None, segments: Sequence[bytes], slots: Sequence[int]) -> int:
        """Decode one verified chunk in a worker and write it to ``slots`` of the buffer ``handle`` names."""
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
            msg = (handle_key(handle), handle, bytes(header), side, list(segments), [int(s) for s in slots])
            reply = await loop.run_in_executor(self._threads, w.call, msg)
        except WorkerError:
            w = self._replace(w)
            raise
        finally:
            idle.put_nowait(w)
        if reply[0] == "ok":
            return reply[1]
        if reply[0] == "container":
            raise _ERRORS.get(reply[1], container.ContainerError)(reply[2])
        raise WorkerError(reply[1])

    def _replace(self, dead: _Worker) -> _Worker:
        log.error("decode worker %s died; starting another", dead.proc.pid)
        dead.stop()
        w = _Worker(self._ctx)
        w.ready()
        self._workers[self._workers.index(dead)] = w
        return w

    def forget(self, handle: dict) -> None:
        """Drop a buffer the model unregistered (workers would otherwise keep it mapped)."""
        for w in self._workers:
            with w.lock:
                try:
                    w.conn.send(("forget", handle_key(handle)))
                except (OSError, BrokenPipeError):
                    pass

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []
        self._threads.shutdown(wait=False)
