"""service: what one sidecar does — lookup, fetch, store — independent of HTTP.

It owns the registered KV buffers, the store, the throughput estimator, the metrics, and the
store queue. ``server`` puts it behind aiohttp; tests and the demo may also call it directly.

Store requests never block the model: the handler copies the prefix's KV out of the shared
buffer (a memory copy) and queues it; a worker encodes and uploads in the background. When the
queue is full the request is dropped and counted — a lost store costs a future recompute, a
blocked model costs latency now.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from kvfetcher.fetch import choice, executor as pipeline, staging
from kvfetcher import ipc, keys, kvbuffer
from kvfetcher.chunk import encode_chunk
from kvfetcher.fetch.workers import DecodeWorkers, warmup_object
from kvfetcher.config import Config
from kvfetcher.metrics import Metrics
from kvfetcher.format.presets import PRESETS, measured
from kvfetcher.store import Store, StoreError

log = logging.getLogger("kvfetcher.service")

#: measured size ratio vs fp16 per preset (for the no-lookup shortcut; 1.0 where never measured)
_RATIOS = {p: (measured(p) or {}).get("ratio_vs_fp16", 1.0) for p in PRESETS}
LOOKUP_PARALLEL = 16  # LISTs in flight during a lookup


@dataclass
class Buffer:
    tensor: torch.Tensor  # [layers, 2, kv_heads, capacity, head_dim], aliasing the model's memory
    ns: keys.Namespace
    handle: dict | None = None  # what decode worker processes open to write into the same memory


@dataclass
class _StoreJob:
    ns: keys.Namespace
    keys: list[str]
    kv: torch.Tensor  # [layers, 2, heads, tokens, head_dim], a private copy
    queued_at: float = field(default_factory=time.perf_counter)


class RequestError(ValueError):
    """The request itself is wrong (unknown buffer, bad slots...): the client's fault, a 400."""


class Sidecar:
    def __init__(self, store: Store, config: Config | None = None, metrics: Metrics | None = None):
        self.store = store
        self.config = config or Config()
        self.config.validate()
        self.metrics = metrics or Metrics()
        self.estimator = choice.Estimator(gpu=torch.cuda.is_available())
        self.buffers: dict[str, Buffer] = {}
        self.io_pool = ThreadPoolExecutor(self.config.io_workers, thread_name_prefix="kvf-io")
        self.decode_pool = ThreadPoolExecutor(self.config.decode_workers, thread_name_prefix="kvf-decode")
        self.encode_pool = ThreadPoolExecutor(1, thread_name_prefix="kvf-encode")
        self.workers = DecodeWorkers(self.config.decode_procs) if self.config.decode_procs else None
        self._queue: asyncio.Queue[_StoreJob] | None = None
        self._pending_chunks = 0
        self._worker: asyncio.Task | None = None
        self._warming: asyncio.Future | None = None  # the latest registered buffer's warm-up

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self.workers is not None:  # seconds of process start-up and warm-up: not on a request's path
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.workers.start)
            if self.config.warm_up:
                await loop.run_in_executor(None, self.warm_workers)
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._store_worker())

    def warm_buffer(self, buf: Buffer) -> None:
        """What a first fetch into ``buf`` would otherwise set up on its path: staging buffers for
        the direct path's raw chunks (a fetch's window of them; pinned for a GPU buffer), then the
        decode workers (:meth:`warm_workers`). Best effort, blocking; ``register`` runs it in the
        background."""
        served = self.config.allowed_presets or self.config.presets
        if any(PRESETS[p].layout.mode == "native" for p in served):
            try:
                n = pipeline.chunks_in_flight(self.config.window, self.workers)
                staging.shared().reserve(self._chunk_kv_bytes(buf), buf.tensor.is_cuda, n)
            except Exception:  # e.g. pinned memory refused: the first raw fetch allocates instead
                log.exception("staging reservation failed")
                self.metrics.errors.labels("warm_up").inc()
        if self.workers is not None:
            self.warm_workers(buf)

    def warm_workers(self, buf: Buffer | None = None) -> None:
        """Restore a chunk of every preset this sidecar may fetch in each decode worker, so that the
        first fetch neither waits for CUDA and NVDEC set-up nor teaches the cost model a cold decode rate:
        at start a tiny one; for a registered buffer ``buf`` one of its model's chunk geometry (NVDEC
        decoders and the fused unpack are per geometry). Best effort: failures are logged and counted,
        and the sidecar serves anyway. Blocking; ``start`` and ``register`` call it (the latter in the
        background), an in-process caller that adds a buffer itself may too."""
        assert self.workers is not None
        served = self.config.allowed_presets or self.config.presets
        names = [p for p in served if PRESETS[p].layout.mode != "native"]  # native chunks take the direct path, no worker
        if not names:
            return
        try:
            if buf is None:
                objects = [warmup_object(p) for p in names]
            else:
                L, _, H, _, D = buf.tensor.shape
                objects = [warmup_object(p, (L, H, self.config.chunk_tokens, D), buf.tensor.dtype, buf.ns.model) for p in names]
            w = self.workers.warm(self.config.device, objects)
        except Exception:
            log.exception("decode worker warm-up failed")
            self.metrics.errors.labels("warm_up").inc()
            return
        if w.errors:
            self.metrics.errors.labels("warm_up").inc(len(w.errors))
        self.metrics.warm_up_seconds.set(max(w.seconds))
        log.warning("decode workers warmed on %s with %s in %s s%s", self.config.device, ",".join(names),
                    " ".join(f"{x:.2f}" for x in w.seconds), f"; {len(w.errors)} failed: {w.errors[0]}" if w.errors else "")

    async def close(self, drain_s: float = 10.0) -> None:
        """Stop; queued stores get ``drain_s`` to finish (within a pod's termination grace)."""
        if self._queue is not None and self._pending_chunks:
            try:
                async with asyncio.timeout(drain_s):
                    await self._queue.join()
            except TimeoutError:
                log.warning("shutting down with %d chunks not stored", self._pending_chunks)
        if self._worker:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        if self._warming is not None:  # the decode workers are still in use until it ends
            await asyncio.gather(self._warming, return_exceptions=True)
        for pool in (self.io_pool, self.decode_pool, self.encode_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        if self.workers is not None:
            self.workers.close()

    async def ready(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self.io_pool, self.store.ping)

    # --- buffers ---------------------------------------------------------------------------

    def register(self, handle: dict, model: str, tp_rank: int = 0) -> str:
        try:
            t = ipc.open_handle(handle)
        except (KeyError, TypeError) as e:
            raise RequestError(f"malformed buffer handle: {e}") from e
        except ValueError as e:
            raise RequestError(str(e)) from e
        if t.dim() != 5 or t.shape[1] != 2:
            raise RequestError(f"KV buffer must be [layers, 2, kv_heads, capacity, head_dim], got {tuple(t.shape)}")
        ns = keys.Namespace(model=model, dtype=kvbuffer.dtype_name(t.dtype), tp_rank=tp_rank, tenant=self.config.tenant)
        bid = uuid.uuid4().hex
        self.buffers[bid] = Buffer(t, ns, handle)
        if self.config.warm_up:
            if self.workers is not None:  # mapped now (CUDA IPC), not on the first fetch into it
                self.workers.open(handle)
            try:  # staging, and its model's chunks decoded once, in the background (seconds of encoding on the CPU)
                self._warming = asyncio.get_running_loop().run_in_executor(None, self.warm_buffer, self.buffers[bid])
            except RuntimeError:  # no event loop (a direct caller): nothing to run it in the background of
                pass
        return bid

    def unregister(self, bid: str) -> None:
        buf = self.buffers.pop(bid, None)
        if buf is not None and buf.handle is not None and self.workers is not None:
            self.workers.forget(buf.handle)

    def _buffer(self, bid: str) -> Buffer:
        try:
            return self.buffers[bid]
        except KeyError:
            raise RequestError(f"unknown buffer {bid!r}: register it first") from None

    def _chunk_kv_bytes(self, buf: Buffer) -> int:
        L, _, H, _, D = buf.tensor.shape
        return L * 2 * H * self.config.chunk_tokens * D * buf.tensor.element_size()

    # --- lookup ----------------------------------------------------------------------------

    async def _representations(self, chunk_keys: Sequence[str]) -> tuple[list[dict[str, int]], float]:
        """For the leading run of stored chunks: preset -> object size (one LIST per chunk); and the
        seconds the listing took."""
        loop = asyncio.get_running_loop()
        sem = asyncio.Semaphore(LOOKUP_PARALLEL)

        async def one(key: str) -> dict[str, int]:
            async with sem:
                listing = await loop.run_in_executor(self.io_pool, self.store.list, keys.chunk_prefix(key))
            reps = {}
            for name, size in listing.items():
                try:
                    reps[keys.preset_of(name)] = size
                except ValueError:
                    continue
            return reps

        t = time.perf_counter()
        found = await asyncio.gather(*(one(k) for k in chunk_keys))
        elapsed = time.perf_counter() - t
        self.estimator.observe_lookup(self.store.endpoint, elapsed, -(-len(chunk_keys) // LOOKUP_PARALLEL))
        self.metrics.lookup_seconds.observe(elapsed)
        run = []
        for reps in found:
            if not any(p in PRESETS for p in reps):
                break
            run.append(reps)
        return run, elapsed

    def namespace(self, model: str, dtype: str, tp_rank: int = 0) -> keys.Namespace:
        """A namespace without a registered buffer: for a scheduler that only asks (vLLM's split)."""
        if dtype not in kvbuffer.DTYPES:
            raise RequestError(f"unsupported dtype {dtype!r}; supported: {sorted(kvbuffer.DTYPES)}")
        return keys.Namespace(model=model, dtype=dtype, tp_rank=tp_rank, tenant=self.config.tenant)

    async def lookup(self, ns: keys.Namespace | str, tokens: Sequence[int]) -> dict:
        """How many leading tokens are stored, for a buffer id or a namespace."""
        ns = self._buffer(ns).ns if isinstance(ns, str) else ns
        ck = keys.chunk_keys(ns, tokens, self.config.chunk_tokens)
        self.metrics.lookups.inc()
        try:
            reps, _ = await self._representations(ck)
        except StoreError as e:
            self.metrics.errors.labels(e.reason).inc()
            return {"tokens": 0, "chunk_tokens": self.config.chunk_tokens, "error": e.reason, "detail": str(e)}
        hit = len(reps) * self.config.chunk_tokens
        self.metrics.hit_tokens.inc(hit)
        return {"tokens": hit, "chunk_tokens": self.config.chunk_tokens, "representations": [sorted(r) for r in reps]}

    # --- fetch -----------------------------------------------------------------------------

    async def fetch(self, bid: str, tokens: Sequence[int], **kw) -> dict:
        """Load as many leading tokens as pays off; the reply says how many were loaded and
        which requested tokens (``not_loaded``, a ``[start, end)`` range) the model must recompute.

        ``tokens`` are the prompt tokens the caller wants loaded (whole chunks are loaded, so at
        most ``len(tokens)`` rounded down to a chunk). Keywords: see :meth:`_fetch`.
        """
        reply = await self._fetch(bid, tokens, **kw)
        reply["not_loaded"] = [reply["loaded_tokens"], reply["requested_tokens"]]
        return reply

    async def _fetch(
        self,
        bid: str,
        tokens: Sequence[int],
        *,
        slots: Sequence[int] | None = None,
        offset: int = 0,
        deadline_s: float | None = None,
        recompute_tps: float | None = None,
        presets: Sequence[str] | None = None,
        ttft_budget_s: float | None = None,
    ) -> dict:
        t0 = time.perf_counter()
        budget = self.config.ttft_budget_s if ttft_budget_s is None else ttft_budget_s
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0):
            raise RequestError(f"ttft_budget_s must be positive seconds, not {budget!r}")
        deadline_s = deadline_s if deadline_s is not None else self.config.deadline_s
        buf = self._buffer(bid)
        n_req = len(tokens) // self.config.chunk_tokens * self.config.chunk_tokens
        try:
            dest = pipeline.Destination(buf.tensor, slots=slots, offset=offset, tokens=n_req, handle=buf.handle)
        except ValueError as e:
            raise RequestError(str(e)) from e
        reply = {"requested_tokens": n_req, "loaded_tokens": 0, "chunk_tokens": self.config.chunk_tokens}
        rates = self.estimator.rates(self.store.endpoint, recompute_tps or self.config.recompute_tps)
        formats = {p: PRESETS[p].codec.format for p in PRESETS}
        allowed = set(presets or PRESETS) & set(self.config.allowed_presets or PRESETS)
        n_chunks = n_req // self.config.chunk_tokens
        lookup_s = choice.lookup_seconds(n_chunks, rates, LOOKUP_PARALLEL)
        if choice.hopeless(n_chunks, self.config.chunk_tokens, self._chunk_kv_bytes(buf), _RATIOS, formats, rates, allowed, budget_s=budget,
                           lookup_s=lookup_s):
            self.metrics.decisions.labels(choice.RECOMPUTE).inc()
            reply["decision"] = {"preset": choice.RECOMPUTE, "chunks": 0, "predicted_s": 0.0, "options": {}}
            return self._fallback(reply, "cost_model", "recompute predicted faster than any stored preset could be; store not asked")
        ck = keys.chunk_keys(buf.ns, tokens[:n_req], self.config.chunk_tokens)
        try:
            async with asyncio.timeout(deadline_s):  # the deadline covers the listing too
                reps, reply["lookup_s"] = await self._representations(ck)
        except StoreError as e:
            return self._fallback(reply, e.reason, str(e), error=True)
        except TimeoutError:
            return self._fallback(reply, "deadline", f"listing the prefix took longer than {deadline_s} s", error=True)
        d = choice.choose(reps, self.config.chunk_tokens, self._chunk_kv_bytes(buf), formats, rates, allowed, budget)
        self.metrics.decisions.labels(d.preset).inc()
        reply["decision"] = {"preset": d.preset, "chunks": d.chunks, "predicted_s": d.predicted_s, "options": d.options}
        if d.preset == choice.RECOMPUTE:
            return self._fallback(reply, "miss" if not reps else "cost_model", "recompute predicted faster" if reps else "nothing stored")
        chunk_refs = [
            kvbuffer.ChunkRef(keys.object_name(k, d.preset), reps[i][d.preset], i * self.config.chunk_tokens, self.config.chunk_tokens)
            for i, k in enumerate(ck[: d.chunks])
        ]
        quiet = self._warming is None or self._warming.done()  # else the warm-up shares the decode workers
        out = await pipeline.fetch(
            self.store,
            chunk_refs,
            dest,
            fingerprint=buf.ns.model,
            io_pool=self.io_pool,
            decode_pool=self.decode_pool,
            device=buf.tensor.device,
            deadline_s=max(0.0, deadline_s - (time.perf_counter() - t0)),
            window=self.config.window,
            workers=self.workers,
        )
        self._observe(d, out, learn=quiet)
        reply.update(
            loaded_tokens=out.loaded_tokens,
            bytes_read=out.bytes_read,
            kv_bytes=out.kv_bytes,
            seconds=out.seconds,
        )
        reply["decision"]["actual_s"] = out.seconds
        self.metrics.fetch_seconds.observe(time.perf_counter() - t0)
        if out.bad_object:  # else it would block every later fetch, and a re-store would be a no-op
            await self._drop(out.bad_object)
        if out.error:
            return self._fallback(reply, out.error, out.detail, error=True)
        return reply

    async def _drop(self, name: str) -> None:
        """Delete an object that failed verification, so that the next store writes it anew."""
        try:
            await asyncio.get_running_loop().run_in_executor(self.io_pool, self.store.delete, name)
            log.warning("deleted bad object %s", name)
            self.metrics.errors.labels("bad_object_deleted").inc()
        except StoreError as e:
            self.metrics.errors.labels(e.reason).inc()

    def _observe(self, d: choice.Decision, out: pipeline.Outcome, learn: bool = True) -> None:
        """Metrics of a fetch, and what it teaches the estimator. ``learn`` False: a fetch that ran
        beside a buffer's background warm-up (the decode workers shared between both) teaches only
        its latency: its rates are those of shared, partly cold workers, not a later fetch's. What a
        cold rate costs, on an H100 (70B shape): a balanced fetch in unwarmed workers taught 0.6 GB/s
        where 4.4 were restored later, and ``auto`` then fetched 128K tokens raw over 25 Gbit/s, 38%
        slower than balanced (docs/benchmarks/auto70b_estimator_h100.md)."""
        m, ep = self.metrics, self.store.endpoint
        m.bytes_read.inc(out.bytes_read)
        m.loaded_tokens.inc(out.loaded_tokens)
        if out.error is None:
            fmt = PRESETS[d.preset].codec.format
            if out.header_latency_s:
                self.estimator.observe_latency(ep, min(out.header_latency_s))
            if self.estimator.settled(fmt) and learn:  # not the process' first fetch of this format (see choice.Estimator.settled)
                self.estimator.observe_read(ep, out.bytes_read, out.read_busy_s, fmt)
                self.estimator.observe_decode(d.preset, out.kv_bytes, out.decode_busy_s)
                if out.loaded_tokens == d.tokens:  # the whole planned fetch: its time is comparable
                    fit = self.estimator.observe_fit(ep, d.preset, fmt, out.bytes_read, out.kv_bytes, out.seconds)
                    m.fit.labels(d.preset).set(fit.scale)
                    m.fit_overhead.labels(d.preset).set(fit.overhead_s)
            if out.decode_busy_s > 0:
                m.decode_rate.labels(d.preset).set(out.kv_bytes / out.decode_busy_s)
            m.predicted_seconds.observe(d.predicted_s)
            m.actual_seconds.observe(out.seconds)
            m.last_predicted.labels(d.preset).set(d.predicted_s)
            m.last_actual.labels(d.preset).set(out.seconds)
        m.bandwidth.labels(ep).set(self.estimator.bandwidth(ep))

    def _fallback(self, reply: dict, reason: str, detail: str | None, error: bool = False) -> dict:
        self.metrics.fallbacks.labels(reason).inc()
        if error:
            self.metrics.errors.labels(reason).inc()
            log.warning("fetch fell back to recompute (%s): %s", reason, detail)
        reply.update(error=reason if error else None, reason=reason, detail=detail)
        return reply

    # --- store -----------------------------------------------------------------------------

    def store_prefix(self, bid: str, tokens: Sequence[int], *, slots: Sequence[int] | None = None, offset: int = 0) -> dict:
        """Queue the complete chunks of ``tokens`` (whose KV is in the buffer) for storing. Never waits."""
        buf = self._buffer(bid)
        ck = keys.chunk_keys(buf.ns, tokens, self.config.chunk_tokens)
        n = len(ck) * self.config.chunk_tokens
        if not ck:
            return {"queued_chunks": 0, "dropped": False}
        if self._pending_chunks + len(ck) > self.config.store_queue_chunks:
            self.metrics.store_dropped.inc()
            self.metrics.fallbacks.labels("store_queue_full").inc()
            return {"queued_chunks": 0, "dropped": True}
        try:
            idx = kvbuffer.slot_list(buf.tensor.shape[3], n, slots, offset)
        except ValueError as e:
            raise RequestError(str(e)) from e
        if kvbuffer.contiguous(idx):
            kv = buf.tensor[:, :, :, idx[0] : idx[0] + n].to("cpu", copy=True)
        else:
            kv = buf.tensor.index_select(3, torch.tensor(idx, device=buf.tensor.device)).cpu()
        assert self._queue is not None, "Sidecar.start() was not called"
        self._queue.put_nowait(_StoreJob(buf.ns, ck, kv))
        self._pending_chunks += len(ck)
        self.metrics.store_queue_depth.set(self._pending_chunks)
        return {"queued_chunks": len(ck), "dropped": False}

    async def flush(self) -> None:
        """Wait until every queued store has been written (or has failed)."""
        assert self._queue is not None
        await self._queue.join()

    async def _store_worker(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            job = await self._queue.get()
            try:
                await self._store_job(loop, job)
            except StoreError as e:
                self.metrics.errors.labels(e.reason).inc()
                log.warning("store failed (%s): %s", e.reason, e)
            except Exception:
                self.metrics.errors.labels("internal").inc()
                log.exception("store failed")
            finally:
                self._pending_chunks -= len(job.keys)
                self.metrics.store_queue_depth.set(self._pending_chunks)
                self._queue.task_done()

    async def _store_job(self, loop: asyncio.AbstractEventLoop, job: _StoreJob) -> None:
        N = self.config.chunk_tokens
        for i, key in enumerate(job.keys):
            for preset in self.config.presets:
                name = keys.object_name(key, preset)
                if await loop.run_in_executor(self.io_pool, self.store.exists, name):
                    continue  # already stored (by us or another sidecar): a cheap no-op
                t = time.perf_counter()
                piece = job.kv[:, :, :, i * N : (i + 1) * N].contiguous()
                encode = functools.partial(encode_chunk, piece, preset, job.ns.model, start=i * N, rope_theta=self.config.rope_theta)
                obj = await loop.run_in_executor(self.encode_pool, encode)
                if await loop.run_in_executor(self.io_pool, self.store.put, name, obj):
                    self.metrics.bytes_written.inc(len(obj))
                    self.metrics.compression_ratio.labels(preset).set(piece.numel() * piece.element_size() / len(obj))
                self.metrics.store_seconds.observe(time.perf_counter() - t)
