"""writer: a bounded queue of prefixes to store, and the background task that encodes and uploads them.

A store request never blocks the model on encoding or upload: admission is by chunks. The caller
skips the leading chunks already stored, asks :meth:`Writer.room` how many more fit the bound
(``config.store_queue_chunks`` and ``store_queue_bytes``), hands over a private copy of the leading chunks that fit
(``kvbuffer.Destination.read``: from a flat buffer's slots or a paged buffer's blocks) and
counts the rest as dropped (:meth:`Writer.dropped`, in chunks) — a lost store costs a future
recompute, a blocked model costs latency now. One task writes the queue in order: every configured
preset the chunk's model may use (:meth:`Writer.presets_for`: never one that needs a calibration
the model lacks) of every chunk, skipping objects already stored, ``config.store_encoders`` groups of
``config.store_encode_batch`` consecutive chunks encoding at once (a group's planes coded together)
while others upload. With an
object key configured every object is written with its tags, bound to its name (:mod:`format.mac`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvfetcher import codec, keys
from kvfetcher.chunk import ToEncode, encode_chunks
from kvfetcher.codec import ENTROPY_FORMATS, nvcomp
from kvfetcher.config import Config
from kvfetcher.errors import Reason
from kvfetcher.format import mac, presets
from kvfetcher.metrics import Metrics
from kvfetcher.store import Store, StoreError

log = logging.getLogger("kvfetcher.save")

#: models whose refused presets are remembered (clients name their models)
MAX_MODELS = 256
#: the encode thread's niceness (and that of the threads its encoders start, e.g. x265's pool): a
#: store competes for the CPU with the serving engine beside it, and must lose
ENCODE_NICE = 10


def _lower_priority() -> None:
    """Give this thread (and the threads it starts) :data:`ENCODE_NICE` unless it is nicer already, where
    the OS allows per-thread niceness (Linux); elsewhere leave it as it is."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(ENCODE_NICE, os.getpriority(os.PRIO_PROCESS, tid)))
    except (AttributeError, OSError):
        pass


def _encode(chunks: list[ToEncode], device: str | None, *args, **kw) -> list[bytes]:
    """:func:`encode_chunks` of ``chunks`` (views of their job's KV), each made contiguous and moved
    to ``device`` first (:func:`_to_device`): in an encode thread, since a chunk's copy (tens of MB)
    on the event loop would hold up every lookup meanwhile."""
    own = [dataclasses.replace(c, kv=c.kv.contiguous() if device is None else _to_device(c.kv, device)) for c in chunks]
    return encode_chunks(own, *args, **kw)


def _to_device(kv: torch.Tensor, device: str) -> torch.Tensor:
    """``kv`` on ``device``; from host memory through page-locked memory (torch's host allocator
    keeps it for the next chunk), as :func:`kvbuffer.to_host` the other way: one host copy, then the
    copy engine at full rate (a pageable tensor would be copied twice)."""
    if kv.device.type != "cpu":
        return kv.contiguous().to(device)
    stage = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
    stage.copy_(kv)
    return stage.to(device)  # (blocking: the page-locked memory is free again when it returns)


@dataclass
class Job:
    ns: keys.Namespace
    keys: list[str]  # one per chunk of ``kv``
    kv: torch.Tensor  # [layers, 2, heads, tokens, head_dim], a private copy
    first: int = 0  # the prompt's chunk index of ``keys[0]`` (its tokens' positions matter to RoPE)
    parent: str = ""  # the key of the chunk before ``keys[0]`` ("" for a prompt's first chunk)
    queued_at: float = field(default_factory=time.perf_counter)


class Writer:
    """The store queue (bounded by ``config.store_queue_chunks`` and ``store_queue_bytes``) and its writing task. HEADs run
    in ``meta_pool``, PUTs in ``data_pool``; ``stored(key, preset, size)`` hears of every object written."""

    def __init__(self, store: Store, config: Config, metrics: Metrics, data_pool: Executor, meta_pool: Executor,
                 stored: Callable[[str, str, int], None] = lambda key, preset, size: None,
                 settled: Callable[[str], Awaitable[None]] | None = None):
        self.store, self.config, self.metrics, self.stored = store, config, metrics, stored
        self.settled = settled  # awaited before a job's presets are chosen where one is refused: the model's calibration look
        self.data_pool, self.meta_pool = data_pool, meta_pool
        self.encode_pool = ThreadPoolExecutor(config.store_encoders, thread_name_prefix="kvf-encode", initializer=_lower_priority)
        self._queue: asyncio.Queue[Job] | None = None
        self._task: asyncio.Task | None = None
        self.pending_chunks = 0
        self.pending_bytes = 0
        self.object_key = mac.key_from(config.object_key)  # None: objects are written without tags
        fmts = {p: presets.get(p).codec.format for p in config.presets}
        if any(f == "ans" for f in fmts.values()) and not codec.decodable("ans"):
            raise ValueError(f"preset(s) {[p for p, f in fmts.items() if f == 'ans']} need a CUDA GPU with nvCOMP")
        # where entropy-coded presets are packed and coded: this process's GPU, if nvCOMP runs on it
        self.gpu_presets = {p for p, f in fmts.items() if f in ENTROPY_FORMATS} if nvcomp.available() else set()
        self._refused: dict[str, set[str]] = {}  # model -> presets refused for it (logged)

    def presets_for(self, model: str) -> tuple[str, ...]:
        """The configured presets model ``model`` may store; the others are skipped, and each
        refusal is logged once with its reason (e.g. no calibration of the model)."""
        usable = presets.usable(self.config.presets, model)
        if model not in self._refused and len(self._refused) >= MAX_MODELS:
            self._refused.clear()  # clients name models: remembered within a bound (a refusal may be logged again)
        for name in set(self.config.presets) - set(usable) - self._refused.setdefault(model, set()):
            self._refused[model].add(name)
            log.warning("not storing %s: %s", name, presets.refusal(name, model))
        return usable

    async def _presets(self, model: str) -> tuple[str, ...]:
        """:meth:`presets_for`, where a preset is refused once ``settled(model)`` is done (a
        calibration being fetched may allow it)."""
        if self.settled is not None and len(presets.usable(self.config.presets, model)) < len(self.config.presets):
            await self.settled(model)
        return self.presets_for(model)

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._run())

    def reserve(self, chunks: int, chunk_bytes: int) -> int:
        """Hold room in the queue for up to ``chunks`` chunks of ``chunk_bytes`` each, of one store: how
        many it got (the rest do not fit its bounds in chunks and in bytes). Each held chunk is then
        queued by :meth:`submit` or given back by :meth:`release`; held between the two, room is never
        promised twice to stores copying their KV meanwhile."""
        room = min(self.config.store_queue_chunks - self.pending_chunks,
                   (self.config.store_queue_bytes - self.pending_bytes) // max(1, chunk_bytes))
        held = max(0, min(chunks, room))
        self._pending(held, held * chunk_bytes)
        return held

    def release(self, chunks: int, chunk_bytes: int) -> None:
        """Give back held room that will not be queued (the store's copy failed)."""
        self._pending(-chunks, -chunks * chunk_bytes)

    def _pending(self, chunks: int, nbytes: int) -> None:
        self.pending_chunks += chunks
        self.pending_bytes += nbytes
        self.metrics.store_queue_depth.set(self.pending_chunks)

    def dropped(self, chunks: int) -> None:
        """Count ``chunks`` chunks of one request that did not fit."""
        self.metrics.store_dropped_chunks.inc(chunks)
        self.metrics.fallbacks.labels(Reason.STORE_QUEUE_FULL).inc()

    def submit(self, job: Job) -> None:
        """Queue ``job``, whose chunks :meth:`reserve` held. Never waits."""
        assert self._queue is not None, "Writer.start() was not called"
        self._queue.put_nowait(job)

    async def flush(self) -> None:
        """Wait until every queued job has been written (or has failed)."""
        assert self._queue is not None
        await self._queue.join()

    async def close(self, drain_s: float) -> None:
        """Give queued jobs ``drain_s`` to finish, then stop."""
        if self._queue is not None and self.pending_chunks:
            try:
                async with asyncio.timeout(drain_s):
                    await self._queue.join()
            except TimeoutError:
                log.warning("shutting down with %d chunks not stored", self.pending_chunks)
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.encode_pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self) -> None:
        assert self._queue is not None
        while True:
            job = await self._queue.get()
            try:
                await self._write(job)
            except StoreError as e:
                self.metrics.errors.labels(e.reason).inc()
                log.warning("store failed (%s): %s", e.reason, e)
            except Exception:
                self.metrics.errors.labels(Reason.INTERNAL).inc()
                log.exception("store failed")
            finally:
                self._pending(-len(job.keys), -job.kv.numel() * job.kv.element_size())
                self._queue.task_done()

    async def _write(self, job: Job) -> None:
        """Every object of ``job``, ``config.store_encode_batch`` consecutive chunks at a time:
        ``config.store_encoders`` such groups encoding at once and as many more being checked or
        uploaded. The first failure stops the job (raised once the objects under way are done); the
        objects before it stay written."""
        loop = asyncio.get_running_loop()
        encoding = asyncio.Semaphore(self.config.store_encoders)
        in_flight = asyncio.Semaphore(2 * self.config.store_encoders)
        failed: list[BaseException] = []
        tasks: list[asyncio.Task] = []

        async def one(group: range, preset: str) -> None:
            try:
                await self._write_objects(loop, job, group, preset, encoding)
            except Exception as e:
                failed.append(e)
            finally:
                in_flight.release()

        try:
            n, b = len(job.keys), self.config.store_encode_batch
            for group, preset in itertools.product([range(a, min(a + b, n)) for a in range(0, n, b)], await self._presets(job.ns.model)):
                await in_flight.acquire()
                if failed:
                    break
                tasks.append(asyncio.create_task(one(group, preset)))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            raise
        if failed:
            raise failed[0]

    async def _write_objects(self, loop: asyncio.AbstractEventLoop, job: Job, group: range, preset: str,
                             encoding: asyncio.Semaphore) -> None:
        """Consecutive chunks' objects in one preset: those not stored yet encoded together (holding
        ``encoding``), then uploaded side by side; any failure raised once the group's uploads are done."""
        N = self.config.chunk_tokens
        names = [keys.object_name(job.keys[i], preset) for i in group]
        stored = await asyncio.gather(*(loop.run_in_executor(self.meta_pool, self.store.exists, name) for name in names))
        todo = [(i, name) for i, name, there in zip(group, names, stored) if not there]  # (stored by us or another sidecar: skipped)
        if not todo:
            return
        chunks = [ToEncode(job.kv[:, :, :, i * N : (i + 1) * N],  # a view: copied in the encode thread
                           (job.first + i) * N,
                           {"parent": job.keys[i - 1] if i else job.parent},  # in every object: the evictor rebuilds the prefix tree from it
                           mac.ObjectMAC(self.object_key, name) if self.object_key else None) for i, name in todo]
        encode = functools.partial(_encode, chunks, "cuda" if preset in self.gpu_presets else None, preset, job.ns.model,
                                   rope_theta=self.config.rope_theta)
        async with encoding:
            t = time.perf_counter()
            objs = await loop.run_in_executor(self.encode_pool, encode)
        puts = await asyncio.gather(*(loop.run_in_executor(self.data_pool, self.store.put, name, obj) for (_, name), obj in zip(todo, objs)),
                                    return_exceptions=True)
        for (i, _), c, obj, put in zip(todo, chunks, objs, puts):
            if put is True:
                self.stored(job.keys[i], preset, len(obj))
                self.metrics.bytes_written.inc(len(obj))
                self.metrics.compression_ratio.labels(preset).set(c.kv.numel() * c.kv.element_size() / len(obj))
            self.metrics.store_seconds.observe(time.perf_counter() - t)
        for put in puts:
            if isinstance(put, BaseException):
                raise put
