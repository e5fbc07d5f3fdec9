"""service: what one sidecar does — buffers, lookup, fetch, store, warm-up — independent of HTTP.

* :meth:`Sidecar.lookup` is the scheduler's question: it lists the prefix once and runs the cost
  model (:mod:`kvfetcher.fetch.plan`), touching no buffer.
* :meth:`Sidecar.fetch` executes a lookup's plan into a registered buffer; given none, it looks up first (one
  listing). A plan that travelled through a client is checked against its seal, the buffer's
  namespace and the tokens; object names are always re-derived here, never taken from a plan.
* :meth:`Sidecar.store` skips the leading chunks already stored, copies the KV of the next ones
  that fit the store queue out of the buffer (in a thread: the event loop keeps answering
  lookups) and queues them for the background writer (:mod:`kvfetcher.save.writer`); it never
  waits for encoding or upload.

Store I/O runs in two bounded pools: ``meta_pool`` (LIST, HEAD, DELETE, readiness) and
``data_pool`` (GET, PUT), so that stalled reads cannot starve lookups. Every lookup and fetch has a
deadline (``config.deadline_s`` unless the request gives one); work still queued at the deadline is
cancelled. A request names at most ``config.max_request_tokens`` tokens.

``api.server`` puts a sidecar behind aiohttp; tests and the demo may call it directly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

import torch

from kvfetcher import codec, ipc, keys, kvbuffer
from kvfetcher.codec import CodecError, basis as kvbasis
from kvfetcher.config import Config
from kvfetcher.errors import Reason, RequestError
from kvfetcher.fetch import choice, executor, probe, staging
from kvfetcher.fetch.linkshare import LinkShare
from kvfetcher.fetch.readers import ReadProcs, SharedStaging
from kvfetcher.fetch.plan import FORMATS, Catalog, Costs, EngineDecode, EngineDecoded, FetchOptions, FetchPlan, FetchDecision, FetchReply, listing_rounds, make_plan, seal, sealed
from kvfetcher.fetch.prefill import PrefillModel
from kvfetcher.fetch.workers import DecodeWorkers, restore_here, warmup_object
from kvfetcher.format import mac
from kvfetcher.format.presets import PRESETS, usable, get as preset_of
from kvfetcher.kvbuffer import Destination, ObjectArena, PagedKV
from kvfetcher.metrics import Metrics
from kvfetcher.save.writer import Job, Writer
from kvfetcher.store import Store, StoreError
from kvfetcher.store.calibrations import CalibrationLookup
from kvfetcher.store.index import StoredIndex

log = logging.getLogger("kvfetcher.service")

#: registrations held at once; past it the least recently used is released (a client that died
#: without unregistering holds its memory and fd until then)
MAX_BUFFERS = 64


@dataclass
class Buffer:
    tensor: torch.Tensor | PagedKV  # aliasing the model's memory: a flat [layers, 2, kv_heads, capacity, head_dim], or paged blocks
    ns: keys.Namespace
    handle: dict | None = None  # this process's handle (ipc.adopt): what decode worker processes open to write into the same memory
    engine: EngineDecode | None = None  # engine-decode mode: fetches write verified stored objects here, which the engine decodes

    def destination(self, tokens: int, slots: Sequence[int] | None = None, offset: int = 0,
                    block_ids: Sequence[int] | None = None, first_token: int = 0) -> Destination | ObjectArena:
        """Where ``tokens`` tokens of a request live in this buffer (:func:`kvbuffer.destination`);
        for an engine that decodes itself, the arena its stored objects go to."""
        if self.engine is not None:
            if slots is not None or offset or block_ids is not None:
                raise RequestError("an engine-decode buffer holds stored objects: give no slots, offset or block_ids")
            return ObjectArena(self.tensor, self.ns.shape)
        try:
            return kvbuffer.destination(self.tensor, tokens, slots, offset, block_ids, self.handle, first_token)
        except ValueError as e:
            raise RequestError(str(e)) from e

    def room(self, tokens: int, chunk: int, block_ids: Sequence[int] | None) -> int:
        """How many of a fetch's ``tokens`` (whole chunks of ``chunk``) ``block_ids`` have room for
        in a paged buffer, in whole chunks (vLLM allocates blocks for the tokens it asked to load,
        not for the prompt's later chunks); all of them in any other buffer."""
        if not isinstance(self.tensor, PagedKV) or block_ids is None:
            return tokens
        return min(tokens, len(block_ids) * self.tensor.layout.block_size // chunk * chunk)


class Sidecar:
    def __init__(self, store: Store, config: Config | None = None, metrics: Metrics | None = None):
        self.objects = store
        self.config = config or Config()
        self.config.validate(PRESETS)
        self.metrics = metrics or Metrics()
        self.estimator = choice.Estimator(gpu=torch.cuda.is_available())
        self.buffers: dict[str, Buffer] = {}
        self.leases: dict[str, tuple[int, asyncio.AbstractEventLoop]] = {}  # buffer id -> its client's pidfd, the loop watching it
        self.data_pool = ThreadPoolExecutor(self.config.io_workers, thread_name_prefix="kvf-io")
        self.meta_pool = ThreadPoolExecutor(self.config.meta_io_workers, thread_name_prefix="kvf-meta")
        self.decode_pool = ThreadPoolExecutor(self.config.decode_threads, thread_name_prefix="kvf-decode")
        self.write_pool = ThreadPoolExecutor(self.config.write_threads, thread_name_prefix="kvf-write")  # a fetch's writes into buffers
        self.copy_pool = ThreadPoolExecutor(1, thread_name_prefix="kvf-copy-out")  # a store's copy out of a buffer, off the event loop
        self.workers = DecodeWorkers(self.config.decode_procs) if self.config.decode_procs else None
        self.readers = self._readers()
        self.index = StoredIndex(self.config.index_keys, self.config.negative_ttl_s)  # what is stored, as far as this sidecar knows
        self.catalog = Catalog(store, self.index, self.meta_pool, failed=lambda reason: self.metrics.errors.labels(reason).inc())
        self.writer = Writer(store, self.config, self.metrics, self.data_pool, self.meta_pool, stored=self.index.stored,
                             settled=lambda model: self.calibrations.settled(model))  # (made below)
        self.link = LinkShare(self.config.link_dir)  # the node's fetches, which share its link
        self.probe = probe.LinkProbe(store, self.data_pool, self.estimator, self.metrics, self.link,  # the link's rate before any fetch,
                                     read=self.readers.read_into if self.readers else None, staging=self._staging())  # read as a fetch reads
        self._warming: asyncio.Future | None = None  # the latest registered buffer's warm-up
        self._seal_key = secrets.token_bytes(32)  # plans this process issued carry its seal
        self._object_key = mac.key_from(self.config.object_key)  # None: objects unauthenticated
        self._accepted_keys = tuple(mac.key_from(k) for k in self.config.accepted_object_keys)  # a rotation's previous keys
        if self._object_key is None:
            log.warning("no object key (KVFETCHER_OBJECT_KEY): objects and calibrations are neither tagged nor "
                        "checked; whoever can write the store decides what this sidecar fetches%s",
                        "" if self.config.trust_store else " (and, unless KVFETCHER_TRUST_STORE is set, no ans object is read "
                        "and zstd objects decode on the CPU)")
        self._trusted = self._object_key is not None or self.config.trust_store  # stored bytes may reach nvCOMP
        self.formats = self._readable(FORMATS)  # the presets this sidecar's fetches decode, with their format
        self.calibrations = CalibrationLookup(store, self.meta_pool, self.metrics, key=self._object_key,
                                              accepted=self._accepted_keys)  # published after start (a calibration Job)

    def _readers(self) -> ReadProcs | None:
        """Reader processes (``config.read_procs``), where the store can be opened in another process."""
        if not self.config.read_procs:
            return None
        opener = getattr(self.objects, "opener", None)
        if opener is None:
            log.warning("the store cannot be opened in another process: reads stay in this one")
            return None
        try:
            return ReadProcs(opener(), self.config.read_procs, SharedStaging())
        except Exception:  # noqa: BLE001 — e.g. no process may be started here: reads stay in this one, the sidecar serves
            log.exception("reader processes could not be started: reads stay in this process")
            self.metrics.errors.labels(Reason.READERS).inc()
            return None

    def _staging(self) -> staging.StagingPool:
        """Where fetches stage what they read: the reader processes' shared buffers, or this process's pool."""
        return self.readers.staging if self.readers is not None else staging.shared()

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the decode workers and the writer. No GPU is touched here: a GPU is warmed only
        once a model registers a buffer on it (:meth:`register`), so the sidecar never opens a
        device that is not its model's."""
        if self.workers is not None:  # seconds of process start-up and warm-up: not on a request's path
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.workers.start)
            if self.config.warm_up and self.config.device == "cpu":
                await loop.run_in_executor(None, self.warm_workers)
        self.writer.start()

    def _served_presets(self) -> tuple[str, ...]:
        return self.config.allowed_presets or self.config.presets

    def _coded_presets(self, ns: keys.Namespace) -> list[str]:
        """The presets a fetch into a buffer of ``ns`` may choose that a decoder restores (not the
        direct path): what a lookup allows (``allowed_presets``, unset: every preset, whatever this
        sidecar writes), less those this reader cannot decode and those the model cannot use here
        (a calibration it lacks; a basis of another shape, e.g. a tensor-parallel rank's heads)."""
        L, H, D = ns.shape
        chunk = (L, 2, H, self.config.chunk_tokens, D)

        def fits(p: str) -> bool:
            b = preset_of(p, ns.model).layout.basis
            return b is None or kvbasis.fits(b, chunk, ns.model)

        return [p for p in usable(self.config.allowed_presets or PRESETS, ns.model) if not PRESETS[p].direct and p in self.formats and fits(p)]

    def _readable(self, formats: dict[str, str], gpu_engine: bool = False) -> dict[str, str]:
        """Of ``formats`` (preset -> format), those whose stored bytes may reach their decoder: all with
        an object key or a trusted store; else bytes anyone who can write the store may have crafted, so only
        formats decoded by a decoder that validates its input (:func:`codec.decodable`); for an engine
        that decodes on a GPU itself (entropy formats with nvCOMP), no entropy format."""
        if self._trusted:
            return formats
        return {p: f for p, f in formats.items()
                if codec.decodable(f, trusted=False) and not (gpu_engine and f in codec.ENTROPY_FORMATS)}

    def warm_buffer(self, buf: Buffer) -> None:
        """What a first fetch into ``buf`` would otherwise set up on its path: staging buffers for
        the direct path's raw chunks (a fetch's window of them; pinned for a GPU buffer), then the
        decode workers (:meth:`warm_workers`). Best effort, blocking; ``register`` runs it in the
        background."""
        if any(PRESETS[p].direct for p in self._served_presets()):
            try:
                n = executor.chunks_in_flight(self.config.window, self.workers)
                self._staging().reserve(self._chunk_kv_bytes(buf), buf.tensor.device.type == "cuda", n)
            except Exception:  # e.g. pinned memory refused: the first raw fetch allocates instead
                log.exception("staging reservation failed")
                self.metrics.errors.labels(Reason.WARM_UP).inc()
        if self.workers is not None:
            self.warm_workers(buf)
        elif buf.tensor.device.type == "cuda":  # decoded in this process' threads: warm them here
            self.warm_here(buf)

    def warm_here(self, buf: Buffer) -> None:
        """Without decode workers, restore a chunk of ``buf``'s geometry of every coded preset it may
        fetch in this process (into scratch): the first fetch then finds the GPU decoders and the
        fused unpack compiled (seconds of kernel compilation otherwise). Best effort, blocking."""
        t = time.perf_counter()
        objects = self._warmup_objects(self._coded_presets(buf.ns), buf)
        for p, obj in objects.items():
            try:
                restore_here(obj, buf.tensor.device)
            except Exception:  # noqa: BLE001 — the first fetch of it sets up instead
                log.exception("warm-up of %s in this process failed", p)
                self.metrics.errors.labels(Reason.WARM_UP).inc()
        if objects:
            self.metrics.warm_up_seconds.set(time.perf_counter() - t)

    def _warmup_chunk(self, preset: str, buf: Buffer | None) -> bytes:
        """A stored chunk of ``preset`` to warm decoders with: of ``buf``'s model and geometry, or tiny."""
        if buf is None:
            return warmup_object(preset)
        L, H, D = buf.ns.shape
        return warmup_object(preset, (L, H, self.config.chunk_tokens, D), buf.tensor.dtype, buf.ns.model)

    def _warmup_objects(self, names: Sequence[str], buf: Buffer | None) -> dict[str, bytes]:
        """A warm-up chunk of each preset in ``names`` that can be made here (:meth:`_warmup_chunk`).
        One that cannot is left to its first fetch: a preset with no encoder here (HEVC without
        NVENC or PyAV) is named in one warning; any other failure is logged and counted."""
        objects, unencodable, reason = {}, [], None
        for p in names:
            try:
                objects[p] = self._warmup_chunk(p, buf)
            except CodecError as e:
                unencodable.append(p)
                reason = e
            except Exception:  # noqa: BLE001
                log.exception("warm-up chunk of %s could not be made", p)
                self.metrics.errors.labels(Reason.WARM_UP).inc()
        if unencodable:
            log.warning("not warmed with %s (%s): their first fetch sets their decoders up", ",".join(unencodable), reason)
        return objects

    def warm_workers(self, buf: Buffer | None = None) -> None:
        """Restore a chunk of every preset this sidecar may fetch in each decode worker, so that the
        first fetch neither waits for CUDA and NVDEC set-up nor teaches the cost model a cold rate:
        at start a tiny one; for a registered buffer ``buf`` one of its model's chunk geometry (NVDEC
        decoders and the fused unpack are per geometry), on that buffer's device. Best effort:
        failures are logged and counted, and the sidecar serves anyway. Blocking."""
        assert self.workers is not None
        if buf is None:  # at start: what this sidecar serves (direct chunks need no worker)
            names = [p for p in self._served_presets() if not PRESETS[p].direct]
        else:  # every preset a fetch into it may choose, not only those this sidecar writes
            names = self._coded_presets(buf.ns)
        objects = self._warmup_objects(names, buf)
        if not objects:
            return
        names = list(objects)
        try:
            device = self.config.device if buf is None else str(buf.tensor.device)
            w = self.workers.warm(device, list(objects.values()))
        except Exception:
            log.exception("decode worker warm-up failed")
            self.metrics.errors.labels(Reason.WARM_UP).inc()
            return
        if w.errors:
            self.metrics.errors.labels(Reason.WARM_UP).inc(len(w.errors))
        self.metrics.warm_up_seconds.set(max(w.seconds))
        log.warning("decode workers warmed on %s with %s in %s s%s", device, ",".join(names),
                    " ".join(f"{x:.2f}" for x in w.seconds), f"; {len(w.errors)} failed: {w.errors[0]}" if w.errors else "")

    async def close(self, drain_s: float = 10.0) -> None:
        """Stop; queued stores get ``drain_s`` to finish (within a pod's termination grace)."""
        await self.writer.close(drain_s)
        self.catalog.close()
        self.probe.close()
        await self.warmed()  # the decode workers are still in use until it ends
        for pool in (self.data_pool, self.meta_pool, self.decode_pool, self.write_pool, self.copy_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        for bid in list(self.buffers):
            self.unregister(bid)
        if self.workers is not None:
            self.workers.close()
        if self.readers is not None:
            self.readers.close()

    async def ready(self) -> None:
        """Raise a :class:`StoreError` unless the store answers and takes writes (see ``Store.ping``)."""
        async with asyncio.timeout(self.config.deadline_s):
            await asyncio.get_running_loop().run_in_executor(self.meta_pool, self.objects.ping)

    # --- buffers ---------------------------------------------------------------------------

    def register(self, handle: dict, model: str, tp_rank: int = 0, engine: EngineDecode | None = None) -> str:
        """Map the buffer ``handle`` names (:mod:`kvfetcher.ipc`; a memfd handle must name an fd of
        this process: the API passes only fds its buffer socket received; a paged handle, paged KV
        whose block size divides ``chunk_tokens``) and return its id. With ``engine`` (a flat host
        buffer) the engine decodes itself: fetches write verified stored objects into the buffer.

        The id is the registration's capability: unguessable, given only to the registering peer,
        never logged or listed; whoever presents it may fetch into, store from and unregister the
        buffer, and nothing else names the buffer."""
        try:
            t, handle = ipc.adopt(handle)
        except (KeyError, TypeError) as e:
            raise RequestError(f"malformed buffer handle: {e}") from e
        except RequestError:  # NoDeviceError: a CUDA handle this process cannot open
            raise
        except ValueError as e:
            raise RequestError(str(e)) from e
        try:
            if engine is not None and (isinstance(t, PagedKV) or t.device.type != "cpu"):
                raise ValueError("an engine that decodes itself registers a flat host buffer (a memfd) for the stored objects")
            if isinstance(t, PagedKV) and self.config.chunk_tokens % t.layout.block_size:
                raise ValueError(f"block_size {t.layout.block_size} does not divide the sidecar's chunks of {self.config.chunk_tokens} tokens")
            ns = self.namespace(model, kvbuffer.dtype_name(t.dtype), tp_rank, t.shape if isinstance(t, PagedKV) else kvbuffer.check_shape(t))
        except ValueError as e:
            ipc.release(handle)
            raise RequestError(str(e)) from e
        bid = secrets.token_urlsafe(24)
        self.buffers[bid] = Buffer(t, ns, handle, engine)
        while len(self.buffers) > MAX_BUFFERS:  # a client that died without unregistering: its buffer goes first
            log.warning("%d buffers registered: the least recently used is released", len(self.buffers))
            self.unregister(next(iter(self.buffers)))
        self.calibrations.look(model)
        if self.config.warm_up and engine is None:  # (an engine that decodes itself warms its own decoders)
            if self.workers is not None:  # mapped now (CUDA IPC), not on the first fetch into it
                self.workers.open(handle)
            try:  # staging, and its model's chunks decoded once, in the background
                self._warming = asyncio.get_running_loop().run_in_executor(None, self.warm_buffer, self.buffers[bid])
                self.metrics.warming.set(1)  # auto leaves the decode workers' presets alone until it is 0
                self._warming.add_done_callback(lambda _: self.metrics.warming.set(0))
            except RuntimeError:  # no event loop (a direct caller): nothing to run it in the background of
                pass
        return bid

    async def warmed(self) -> None:
        """Wait until the latest registration's warm-up is done (until then ``auto`` leaves the decode
        workers' presets alone, and a fetch of one would wait behind it)."""
        if self._warming is not None:
            await asyncio.gather(self._warming, return_exceptions=True)

    def _warm(self) -> bool:
        """Whether no warm-up is using the decode workers (a fetch needing them would wait for it)."""
        return self._warming is None or self._warming.done()

    def lease(self, bid: str, pidfd: int) -> None:
        """Release buffer ``bid`` when the process ``pidfd`` names exits (its client died without
        unregistering: a crashed or restarted engine, whose KV memory, a GPU's by CUDA IPC, its next
        start needs). Takes ``pidfd`` (closed here, whatever happens); needs the running event loop.
        :class:`RequestError` for an unknown or already leased buffer."""
        try:
            if bid not in self.buffers:
                raise RequestError("unknown buffer: register it first")
            if bid in self.leases:
                raise RequestError("the buffer already has a lease")
            loop = asyncio.get_running_loop()
            loop.add_reader(pidfd, self._client_gone, bid)
        except BaseException:
            os.close(pidfd)
            raise
        self.leases[bid] = (pidfd, loop)

    def _client_gone(self, bid: str) -> None:
        log.info("a registered buffer's client exited without unregistering it: released")
        self.metrics.released_buffers.inc()
        self.unregister(bid)

    def _end_lease(self, bid: str) -> None:
        lease = self.leases.pop(bid, None)
        if lease is None:
            return
        pidfd, loop = lease

        def end() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)

        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            end()
        elif loop.is_closed():
            os.close(pidfd)
        else:  # (from another thread: the loop's reader is the loop's to remove)
            loop.call_soon_threadsafe(end)

    def unregister(self, bid: str) -> None:
        self._end_lease(bid)
        buf = self.buffers.pop(bid, None)
        if buf is not None and buf.handle is not None:
            if self.workers is not None:
                self.workers.forget(buf.handle)
            ipc.release(buf.handle)

    def _buffer(self, bid: str) -> Buffer:
        """The buffer ``bid`` names, now the most recently used (``self.buffers`` is in order of use)."""
        try:
            self.buffers[bid] = self.buffers.pop(bid)
            return self.buffers[bid]
        except KeyError:
            raise RequestError(f"unknown buffer {bid!r}: register it first") from None

    def _chunk_kv_bytes(self, buf: Buffer) -> int:
        L, H, D = buf.ns.shape
        return L * 2 * H * self.config.chunk_tokens * D * kvbuffer.bytes_per_value(buf.tensor.dtype)

    def namespace(self, model: str, dtype: str, tp_rank: int = 0, shape: Sequence[int] | None = None) -> keys.Namespace:
        """The namespace of a model's KV of geometry ``shape`` = (layers, kv_heads, head_dim) in this
        sidecar's tenant; without ``shape``, that of a registered buffer of the model, dtype and rank.
        A model other than the deployment's (``config.model``, when set) is refused."""
        if self.config.model and model != self.config.model:
            raise RequestError(f"this sidecar serves model {self.config.model!r}, not {model!r}")
        if dtype not in kvbuffer.DTYPES:
            raise RequestError(f"unsupported dtype {dtype!r}; supported: {sorted(kvbuffer.DTYPES)}")
        if shape is None:
            shapes = {b.ns.shape for b in self.buffers.values() if (b.ns.model, b.ns.dtype, b.ns.tp_rank) == (model, dtype, tp_rank)}
            if len(shapes) != 1:
                raise RequestError("give the KV geometry (layers, kv_heads, head_dim): "
                                   f"{'no' if not shapes else 'more than one'} registered buffer of this model, dtype and rank names it")
            (shape,) = shapes
        if len(shape) != 3 or not all(isinstance(n, int) and n > 0 for n in shape):
            raise RequestError(f"the KV geometry must be 3 positive integers (layers, kv_heads, head_dim), not {list(shape)}")
        return keys.Namespace(model=model, dtype=dtype, tp_rank=tp_rank, tenant=self.config.tenant, shape=tuple(shape))

    def _check_length(self, tokens: Sequence[int]) -> None:
        if len(tokens) > self.config.max_request_tokens:
            raise RequestError(f"{len(tokens)} tokens in one request; at most {self.config.max_request_tokens}")

    # --- lookup ----------------------------------------------------------------------------

    async def lookup(self, target: str | keys.Namespace, tokens: Sequence[int], options: FetchOptions | None = None) -> FetchPlan:
        """What a fetch of ``tokens`` would do, for a buffer id or a namespace (a scheduler without
        buffers: the cost model then uses a registered buffer of that namespace for the KV
        geometry, and without one leaves the preset unchosen), chosen as ``options`` say. Answered
        from the index of what is stored: nothing waits on the store unless ``options.refresh``."""
        t = time.perf_counter()
        self._check_length(tokens)
        if isinstance(target, str):
            buf = self._buffer(target)
            ns = buf.ns
        else:
            ns, mine = target, [b for b in self.buffers.values() if b.ns == target]  # an engine that decodes itself fetches into its own
            buf = next((b for b in mine if b.engine is not None), mine[0] if mine else None)
        self.metrics.lookups.inc()
        self.calibrations.look(ns.model)
        p = await self._lookup(ns, keys.chunk_keys(ns, tokens, self.config.chunk_tokens), buf, options or FetchOptions())
        self.metrics.lookup_tokens.inc(len(tokens))
        self.metrics.hit_tokens.inc(p.hit_tokens)
        self.metrics.lookup_options.clear()  # the last lookup's options only (none: it needed no cost model)
        for option, seconds in p.options.items():  # why auto chose what it chose
            self.metrics.lookup_options.labels(option).set(seconds)
        self.metrics.lookup_seconds.observe(time.perf_counter() - t)
        return p

    async def _lookup(self, ns: keys.Namespace, ck: Sequence[str], buf: Buffer | None, o: FetchOptions) -> FetchPlan:
        budget = self.config.ttft_budget_s if o.ttft_budget_s is None else o.ttft_budget_s
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0):
            raise RequestError(f"ttft_budget_s must be positive seconds, not {budget!r}")
        sharers = o.group_size + self.link.active()
        if o.prefill_model is not None:
            for term, c in asdict(o.prefill_model).items():
                self.metrics.prefill_model.labels(term).set(c)
            self.metrics.prefill_error.set(o.prefill_error)
        if o.load_overhead_s is not None:
            self.metrics.load_overhead.set(o.load_overhead_s)
        prefill = o.prefill_model or PrefillModel.linear(o.recompute_tokens_per_s or self.config.recompute_tps)
        engine = buf.engine if buf is not None else None  # the engine decodes: its formats, at its rates
        rates = replace(self.estimator.rates(self.objects.endpoint, prefill, sharers, engine=engine.device if engine else None),
                        load_overhead_s=o.load_overhead_s or 0.0, prefill_error=o.prefill_error)
        # never a preset this model may not use (one needing a calibration it lacks)
        allowed = frozenset(o.presets or PRESETS) & frozenset(self.config.allowed_presets or PRESETS) & frozenset(usable(PRESETS, ns.model))
        if o.presets is None and engine is None and not self._warm():  # the decode workers are still warming: only what needs none (raw) or recompute
            allowed = frozenset(p for p in allowed if PRESETS[p].direct)
        costs = Costs(rates, self._chunk_kv_bytes(buf) if buf else None, allowed, budget,
                      self._readable(engine.presets(), gpu_engine=engine.device == "cuda") if engine else self.formats)
        p = await make_plan(self.catalog, ns, ck, self.config.chunk_tokens, costs, refresh=o.refresh, wait_s=o.wait_s,
                            deadline_s=self.config.deadline_s if o.deadline_s is None else o.deadline_s)
        self.metrics.index_keys.set(len(self.index))
        if p.hit_tokens and p.preset == choice.RECOMPUTE and self.probe.wanted():  # a recompute that a prior may have decided
            self.probe.start(probe.objects(ck, self.index.run(ck)[0]))
        if p.error:
            self.metrics.errors.labels(p.error).inc()
        elif p.lookup_s is not None:
            listed = min(p.hit_tokens // p.chunk_tokens + 1, p.requested_tokens // p.chunk_tokens)  # it stops at the first miss
            self.estimator.observe_lookup(self.objects.endpoint, p.lookup_s, listing_rounds(listed))
            self.metrics.listing_seconds.observe(p.lookup_s)
        return seal(p, self._seal_key)

    def _check(self, plan: FetchPlan, buf: Buffer, chunk_keys: Sequence[str]) -> None:
        """Refuse a plan this sidecar did not issue, or one for another namespace or other tokens."""
        if not sealed(plan, self._seal_key):
            raise RequestError("the plan was not issued by this sidecar, or was changed: plan again")
        want = (buf.ns.model, buf.ns.dtype, buf.ns.tp_rank, self.config.chunk_tokens, chunk_keys[-1] if chunk_keys else "")
        if (plan.model, plan.dtype, plan.tp_rank, plan.chunk_tokens, plan.prefix_key) != want:
            raise RequestError("the plan is for another namespace or other tokens than this fetch")

    # --- fetch ------------------------------------------------------------------------------

    async def fetch(self, bid: str, tokens: Sequence[int], plan: FetchPlan | None = None, *, slots: Sequence[int] | None = None,
                    offset: int = 0, block_ids: Sequence[int] | None = None, first_token: int = 0,
                    options: FetchOptions | None = None, decoded: Sequence[EngineDecoded] = ()) -> FetchReply:
        """Fetch as many leading whole chunks of ``tokens`` as ``plan`` says into the buffer at
        ``slots`` or ``offset`` (a paged buffer: into ``block_ids``, :meth:`Buffer.destination`).
        Without a plan, or with one that chose no preset, this looks up first as ``options`` say,
        listing what the index does not know; beside a chosen plan only ``options.deadline_s`` may
        be given. Tokens before ``first_token`` are the caller's: chunks wholly before it are not
        fetched, nor written; they count as loaded. Chunks past what ``block_ids`` have room for are
        not fetched either (:meth:`Buffer.room`): the caller recomputes them.

        Into an engine-decode buffer (:class:`ObjectArena`) the chunks' verified stored objects are
        written instead, as many leading ones as fit, and the reply says where (``objects``);
        ``decoded`` is what that engine reports of its own decodes since (its rates teach the cost model).

        ``options.deadline_s`` covers the listing too. Never raises for a storage or data problem:
        the reply says how many leading tokens were loaded and which to recompute."""
        t0 = time.perf_counter()
        o = options or FetchOptions()
        deadline_s = self.config.deadline_s if o.deadline_s is None else o.deadline_s
        self._check_length(tokens)
        buf = self._buffer(bid)
        self._observe_engine(buf, decoded)
        N = self.config.chunk_tokens
        n_req = len(tokens) // N * N
        room = buf.room(n_req, N, block_ids)
        dest = buf.destination(room, slots, offset, block_ids, first_token)
        ck = keys.chunk_keys(buf.ns, tokens[:n_req], N)
        if plan is not None:
            chosen = {f for f in ("presets", "ttft_budget_s", "prefill_model", "recompute_tokens_per_s", "load_overhead_s", "prefill_error", "group_size",
                                  "refresh", "wait_s")
                      if getattr(o, f) != getattr(FetchOptions(), f)}
            if chosen and plan.preset is not None:
                raise RequestError(f"{sorted(chosen)} belong to the plan: give them when looking up, not with a plan")
            self._check(plan, buf, ck)
        if plan is not None and buf.engine is not None and plan.preset not in buf.engine.presets():
            plan = None  # made for another buffer of the namespace, in a preset this engine does not decode: plan anew
        if plan is None or plan.preset is None:  # no plan, or one made without a buffer of its namespace: look up here
            plan = await self._lookup(buf.ns, ck, buf, replace(o, deadline_s=deadline_s, refresh=True))
        reply = FetchReply(n_req, 0, N, lookup_s=plan.lookup_s,
                           decision=FetchDecision(plan.preset, len(plan.chunks), plan.predicted_s, plan.options))
        if plan.error:  # counted in the errors metric when planning
            return self._fallback(reply, plan.error, plan.detail)
        self.metrics.decisions.labels(plan.preset).inc()
        if not plan.chunks:
            return self._fallback(reply, plan.reason, plan.detail)
        refs = [kvbuffer.ChunkRef(keys.object_name(ck[i], preset), size, i * N, N) for i, (preset, size) in enumerate(plan.chunks[: room // N])]
        mine = min(first_token // N, len(refs))  # leading chunks the caller holds already
        refs, reply.loaded_tokens, reply.not_loaded = refs[mine:], mine * N, (mine * N, n_req)
        if not refs:
            return reply
        if isinstance(dest, ObjectArena):
            refs = self._place(dest, refs)
        if plan.breakeven_s is not None:  # past it the load has lost: it stops, the rest is recomputed
            deadline_s = min(deadline_s, plan.breakeven_s + (time.perf_counter() - t0))
        quiet = self._warm()  # else the warm-up shares the decode workers
        async with self.link.fetch() as share:
            out = await executor.fetch(self.objects, refs, dest, fingerprint=buf.ns.model, io_pool=self.data_pool, decode_pool=self.decode_pool,
                                       device=buf.tensor.device, deadline_s=max(0.0, deadline_s - (time.perf_counter() - t0)),
                                       window=self.config.window, io_concurrency=min(self.config.reads, self.config.io_workers),
                                       workers=None if buf.engine else self.workers, readers=self.readers,
                                       object_key=self._object_key, accepted_keys=self._accepted_keys, write_pool=self.write_pool,
                                       trust_store=self.config.trust_store)
        self._observe(plan, out, learn=quiet, sharers=share.sharers, engine=buf.engine is not None)
        if isinstance(dest, ObjectArena):
            placed = refs[: out.loaded_tokens // N]
            reply.objects = [(c.start, *dest.where(c)) for c in placed]
            self.metrics.engine_objects.labels(plan.preset).inc(len(placed))
        reply.loaded_tokens += out.loaded_tokens
        reply.bytes_read, reply.kv_bytes, reply.seconds = out.bytes_read, out.kv_bytes, out.seconds
        reply.decision.actual_s = out.seconds
        self.metrics.fetch_seconds.observe(time.perf_counter() - t0)
        if out.bad_object or out.error is Reason.MISSING:  # the index no longer trusts the chunks from the one that failed
            self.index.forget(ck[mine + out.loaded_tokens // N :])
        if out.bad_object:  # else it would block every later fetch, and a re-store would be a no-op
            await self._drop(out.bad_object, out.bad_size)
        if out.error:
            self.metrics.errors.labels(out.error).inc()
            return self._fallback(reply, out.error, out.detail)
        reply.not_loaded = (reply.loaded_tokens, n_req)
        return reply

    @staticmethod
    def _place(arena: ObjectArena, refs: list[kvbuffer.ChunkRef]) -> list[kvbuffer.ChunkRef]:
        """The leading ``refs`` whose objects fit the engine's buffer, placed there; a fetch that
        stops at the last of them answers with no reason (the engine fetches again from there)."""
        n = arena.place(refs)
        if not n:
            raise RequestError(f"the engine's buffer of {arena.bytes.numel()} bytes holds no stored object of {refs[0].size} bytes: "
                               "give it more tokens")
        return refs[:n]

    def _observe_engine(self, buf: Buffer, decoded: Sequence[EngineDecoded]) -> None:
        """What an engine that decodes itself reports of its decodes: its rates, for the cost model."""
        if decoded and buf.engine is None:
            raise RequestError("'decoded' reports an engine's own decodes: only for an engine-decode buffer")
        for d in decoded:
            if d.preset in PRESETS:
                self.estimator.observe_engine_decode(d.preset, d.kv_bytes, d.seconds)
                self.metrics.engine_kv_bytes.labels(d.preset).inc(d.kv_bytes)
                self.metrics.engine_decode_seconds.labels(d.preset).inc(d.seconds)

    async def _drop(self, name: str, listed_size: int | None = None) -> None:
        """Delete an object that failed verification, so that the next store writes it anew; not when
        it is no longer the one the plan listed (``listed_size``: another writer stored it again)."""
        try:
            loop = asyncio.get_running_loop()
            if listed_size and (await loop.run_in_executor(self.meta_pool, self.objects.list, name)).get(name) != listed_size:
                log.info("bad object %s was replaced since it was listed: kept", name)
                return
            await loop.run_in_executor(self.meta_pool, self.objects.delete, name)
            log.warning("deleted bad object %s", name)
            self.metrics.errors.labels(Reason.BAD_OBJECT_DELETED).inc()
        except StoreError as e:
            self.metrics.errors.labels(e.reason).inc()

    def _observe(self, plan: FetchPlan, out: executor.Outcome, learn: bool = True, sharers: float = 1.0, engine: bool = False) -> None:
        """Metrics of a fetch, and what it teaches the estimator. ``learn`` False: a fetch that ran
        beside a buffer's background warm-up (the decode workers shared between both) teaches only
        its latency: its rates are those of shared, partly cold workers, not a later fetch's.
        ``sharers``: the fetches that shared the node's link with it, itself included. ``engine``:
        a fetch for an engine that decodes itself teaches the read rate only (the engine reports its decodes)."""
        m, ep, preset = self.metrics, self.objects.endpoint, plan.preset
        m.bytes_read.inc(out.bytes_read)
        m.loaded_tokens.inc(out.loaded_tokens)
        m.kv_bytes.inc(out.kv_bytes)
        for stage, seconds in (("read", out.read_busy_s), ("decode", out.decode_busy_s), ("fetch", out.seconds)):
            m.fetch_busy.labels(stage).inc(seconds)
        fmt = PRESETS[preset].codec.format
        bound = out.read_busy_s > choice.READ_BOUND * out.decode_busy_s  # reads set the pace: the link's rate now
        if out.error is Reason.DEADLINE and learn and bound:  # the link made it late: that is the link's rate now, first fetch or not
            self.estimator.observe_read(ep, out.bytes_read, out.read_busy_s, fmt, sharers, bound=True)
        if out.error is None:
            if out.header_latency_s:
                self.estimator.observe_latency(ep, min(out.header_latency_s))
            settled = self.estimator.settled(fmt)  # (once: it marks the format seen)
            if settled and learn:  # not the process' first fetch of this format
                self.estimator.observe_read(ep, out.bytes_read, out.read_busy_s, fmt, sharers, bound)
            if settled and learn and not engine:  # (an engine that decodes itself reports its decodes)
                self.estimator.observe_decode(preset, out.kv_bytes, out.decode_busy_s)
                if out.loaded_tokens == plan.loaded_tokens:  # the whole planned fetch: its time is comparable
                    fit = self.estimator.observe_fit(ep, preset, fmt, out.bytes_read, out.kv_bytes, out.seconds, sharers)
                    m.fit.labels(preset).set(fit.scale)
                    m.fit_overhead.labels(preset).set(fit.overhead_s)
                    if (ratio := self.estimator.ratio(preset)) is not None:
                        m.fetch_ratio.labels(preset).set(ratio)
            if out.decode_busy_s > 0 and not engine:
                m.decode_rate.labels(preset).set(out.kv_bytes / out.decode_busy_s)
            m.predicted_seconds.observe(plan.predicted_s)
            m.actual_seconds.observe(out.seconds)
            m.last_predicted.labels(preset).set(plan.predicted_s)
            m.last_actual.labels(preset).set(out.seconds)
            m.stages(executor.stage_summary(out.timeline, out.seconds), executor.STAGES)
        m.link(ep, self.estimator.bandwidth(ep), self.estimator.rates(ep).format_bandwidth)

    def _fallback(self, reply: FetchReply, reason: str, detail: str | None) -> FetchReply:
        """Finish a fetch's reply that writes fewer tokens than requested, for a decision (``miss``,
        ``cost_model``) or a failure."""
        error = reason not in (Reason.MISS, Reason.COST_MODEL)
        self.metrics.fallbacks.labels(reason).inc()
        if error:
            log.warning("fetch fell back to recompute (%s): %s", reason, detail)
        reply.error, reply.reason, reply.detail = (reason if error else None), reason, detail
        reply.not_loaded = (reply.loaded_tokens, reply.requested_tokens)
        return reply

    # --- store ------------------------------------------------------------------------------

    async def store(self, bid: str, tokens: Sequence[int], *, slots: Sequence[int] | None = None, offset: int = 0,
                    block_ids: Sequence[int] | None = None, first_token: int = 0) -> dict:
        """Queue the complete chunks of ``tokens`` (whose KV is in the buffer at ``slots``, ``offset``
        or ``block_ids``, as in :meth:`fetch`) for storing: the leading chunks already stored in every
        configured preset are skipped (as far as the index knows: no store request), the next ones are queued as far as the queue has room and the
        rest are dropped and counted. Chunks before ``first_token`` (whole chunks) are the caller's,
        e.g. an earlier window's of a prompt longer than its buffer: not read, counted as skipped.
        Never waits for encoding or upload; the KV is copied before this returns (``Destination.read``)."""
        self._check_length(tokens)
        buf = self._buffer(bid)
        N = self.config.chunk_tokens
        if first_token % N:
            raise RequestError(f"a store's first_token must be whole chunks of {N} tokens, not {first_token}")
        ck = keys.chunk_keys(buf.ns, tokens, N)
        where = buf.destination(len(ck) * N, slots, offset, block_ids, min(first_token, len(ck) * N))
        known = max(self._stored_run(ck, self.writer.presets_for(buf.ns.model)), min(first_token // N, len(ck)))
        chunk_bytes = self._chunk_kv_bytes(buf)
        take = self.writer.reserve(len(ck) - known, chunk_bytes)  # held across the copy: stores arriving meanwhile find it taken
        dropped = len(ck) - known - take
        if dropped:
            self.writer.dropped(dropped)
        if take:
            # a device-to-host copy of up to a prompt's KV: in a thread, so lookups are answered meanwhile
            try:
                kv = await asyncio.get_running_loop().run_in_executor(self.copy_pool, where.read, known * N, take * N)
            except BaseException:
                self.writer.release(take, chunk_bytes)
                raise
            self.writer.submit(Job(buf.ns, ck[known : known + take], kv, first=known, parent=ck[known - 1] if known else ""))
        return {"queued_chunks": take, "skipped_chunks": known, "dropped_chunks": dropped, "dropped": dropped > 0}

    def _stored_run(self, chunk_keys: Sequence[str], written: Sequence[str]) -> int:
        """How many leading chunks the index knows stored in every preset of ``written`` (those this
        sidecar writes for the model). No store request: the writer skips what is stored anyway."""
        run, _ = self.index.run(chunk_keys)
        n = 0
        while n < len(run) and all(p in run[n] for p in written):
            n += 1
        return n

    async def flush(self) -> None:
        """Wait until every queued store has been written (or has failed)."""
        await self.writer.flush()
