"""The vLLM connector's worker side: vLLM's paged KV cache registered with the sidecar, fetches
and stores in background threads (vLLM's loads and saves).

Three modes, chosen at registration and logged once:

* direct: on a GPU the sidecar shares (DRA, a device list), it opens vLLM's KV tensors by CUDA IPC
  and loads straight into the request's blocks (the cross-layer tensor when vLLM gives one);
* engine-decode: on a GPU whose sidecar refuses the CUDA handle (``no_device``: a device-plugin GPU
  held by the model container only), or on any GPU with the ``engine_decode`` option true (the
  restore then runs in this process' CUDA context), a bounded flat host buffer of ``staging_tokens`` slots is
  registered instead; a load has the sidecar fetch and verify the stored objects into it and this
  process decodes them on its GPU into the blocks with the sidecar's own restore; a save copies the
  blocks' KV into it for the sidecar to store (:class:`~kvfetcher.integrations.staged.Staging`);
* staged: on a CPU (no process can map vLLM's memory), or on a GPU the sidecar cannot open with
  ``engine_decode`` false, the same buffer carries KV both ways: the sidecar decodes into it and
  this process copies it into the blocks, in windows of whole chunks.

Invariants: a fetch writes only tokens ``first .. end`` of its request, in whole blocks; every block
of that range it did not write is reported by :meth:`load_errors` no later than the step that
reports the request finished receiving. A store copies its blocks before its request's id is
reported finished sending (vLLM holds the blocks until then) and before a preemption frees them.
Registration is retried on the next fetch or store after the sidecar was unreachable or restarted.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import torch

from kvfetcher import kvbuffer
from kvfetcher.api.client import SidecarError
from kvfetcher.fetch.plan import FetchOptions
from kvfetcher.integrations import staged
from kvfetcher.integrations.staged import Staging
from kvfetcher.integrations.vllm_meta import MIN_TIMED_TOKENS, FetchSpec, Options, StoreSpec, StepMeta, WorkerReport

log = logging.getLogger("kvfetcher.integrations.vllm")

_PROBE = dict(num_blocks=1013, block_size=272, num_kv_heads=7)  # distinct sizes that name a backend's axes


def backend_axes(backend, head_size: int) -> str:
    """The letters of ``backend.get_kv_cache_shape``'s axes (X: K and V packed as ``2*head_size``).
    vLLM 0.32's backends no longer say: their FlashAttention cache keeps 0.26's ``(B, H, T, 2*D)``."""
    if not hasattr(backend, "get_kv_cache_shape"):
        return "BHTX"
    shape = backend.get_kv_cache_shape(head_size=head_size, **_PROBE)
    names = {1013: "B", 272: "T", 7: "H", head_size: "D", 2 * head_size: "X", 2: "K"}
    try:
        return "".join(names[n] for n in shape)
    except KeyError:
        raise ValueError(f"kvfetcher: KV cache shape {tuple(shape)} of {backend} is not one it knows") from None


def paged_view(t: torch.Tensor, axes: str, head_size: int) -> tuple[torch.Tensor, str]:
    """``t`` (axes named by ``axes``, in any memory order) as a contiguous view in memory order, with
    packed K/V split: the tensor and its :class:`kvbuffer.PagedLayout` dims."""
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
    v, dims = t.permute(order), "".join(axes[i] for i in order)
    if "X" in dims:
        v, dims = v.unflatten(dims.index("X"), (2, head_size)), dims.replace("X", "KD")
    if not v.is_contiguous():
        raise ValueError(f"kvfetcher: KV cache {tuple(t.shape)} with strides {t.stride()} is not a plain layout")
    return v, dims


def cpu_view(t: torch.Tensor) -> tuple[torch.Tensor, str]:
    """vLLM's CPU attention cache ``(blocks, heads, block_size, 2*head_size)`` holds, per block and
    head, the block's keys then its values: ``(B, H, K, T, D)``."""
    B, H, T, D2 = t.shape
    return t.view(B, H, 2, T, D2 // 2), "BHKTD"


class WorkerSide:
    def __init__(self, vllm_config, options: Options):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.vllm_config, self.options = vllm_config, options
        self.tp_rank = get_tensor_model_parallel_rank()
        self.client = options.client(rank=self.tp_rank)
        self.block_size = vllm_config.cache_config.block_size  # the scheduler's
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvfetcher")  # fetches: a request waits on each
        self.store_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvfetcher-store")  # so no fetch waits behind stores
        self.lock = threading.Lock()  # guards what the pool's threads report
        self.landed = threading.Condition(self.lock)  # a fetch finished (loaded or not)
        self.loading = 0  # fetches started and not finished
        self.idle_step = False  # the step under way computes nothing
        self.registering = threading.Lock()  # one registration at a time
        self.tensors, self.layout, self.ratio = None, None, 1
        self.staging: Staging | None = None  # staged mode (else direct)
        self.mode: str | None = None  # "direct", "engine-decode" or "staged", once registered
        self.buffer: str | None = None
        self.recving: set[str] = set()
        self.errors: set[int] = set()
        self.stores: dict[str, Future] = {}  # issued stores, until reported finished sending
        self.vllm_finished: set[str] = set()
        self.stored: dict[str, int] = {}
        self.fetched: dict[str, tuple[float, float]] = {}  # per request: its fetch's (start, end), until reported
        self.steps: list[tuple[int, float, float]] = []
        self._timing: list = []  # ((tokens, attention), start, end) of steps, until their time is known
        self._step_start = None

    # --- registration --------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        head = self.vllm_config.model_config.get_head_size()
        views = []
        for name in names:
            t = kv_caches[name]
            if t.device.type == "cpu":
                views.append(cpu_view(t))
            else:
                layer = self.vllm_config.compilation_config.static_forward_context[name]
                views.append(paged_view(t, backend_axes(layer.attn_backend, head), head))
        self._use([v for v, _ in views], views[0][1])

    def register_cross_layer(self, kv_cache: torch.Tensor, backend) -> None:
        head = self.vllm_config.model_config.get_head_size()
        logical = "L" + backend_axes(backend, head)
        order = backend.get_kv_cache_stride_order(include_num_layers_dimension=True)
        physical = "".join(logical[i] for i in order)  # vLLM allocates the tensor in this order
        self._use(*paged_view(kv_cache, physical, head))

    def _use(self, tensors, dims: str) -> None:
        t0 = tensors if isinstance(tensors, torch.Tensor) else tensors[0]
        kernel_block = t0.shape[dims.index("T")]
        self.tensors, self.layout, self.ratio = tensors, kvbuffer.PagedLayout(dims, kernel_block), self.block_size // kernel_block
        log.info("kvfetcher: vLLM KV cache %s x%s, layout %s, block %d", tuple(t0.shape),
                 1 if isinstance(tensors, torch.Tensor) else len(tensors), dims, kernel_block)
        self._registered()

    def _registered(self) -> str | None:
        """The sidecar's id of our buffer, registering it first if needed (None: not now). The mode
        (:func:`staged.register`) is logged when it is chosen or changes."""
        with self.registering:
            if self.buffer is not None or self.tensors is None:
                return self.buffer
            tokens = min(self.options.staging_tokens, self.vllm_config.model_config.max_model_len)
            try:
                self.buffer, self.staging, why = staged.register(self.client, self.tensors, self.layout, self.options.model, self.tp_rank,
                                                                 tokens, self.staging, self.options.engine_decode, self.options.engine_procs)
            except (OSError, SidecarError, ValueError) as e:
                log.warning("kvfetcher: cannot register the KV cache with the sidecar (will retry): %s", e)
                return None
            mode = "direct" if self.staging is None else "staged" if self.staging.engine is None else "engine-decode"
            if mode != self.mode:
                self.mode = mode
                log.info("kvfetcher: %s mode: %s%s%s", mode, why, "" if self.staging is None else
                         f"; fetches and stores go through a host buffer of {tokens} tokens "
                         f"({self.staging.buffer.tensor.nbytes / 2**20:.0f} MiB), copied to and from the blocks in this process",
                         "" if mode != "engine-decode" else
                         f"; loads decode here, on {self.staging.paged.device} ({', '.join(self.staging.engine.formats)})")
            return self.buffer

    def _t0(self) -> torch.Tensor:
        return self.tensors if isinstance(self.tensors, torch.Tensor) else self.tensors[0]

    def _on_cpu(self) -> bool:
        return self._t0().device.type == "cpu"

    def _blocks(self, block_ids: list[int]) -> list[int]:
        """vLLM's block ids as blocks of the registered tensors (kernel blocks may be smaller)."""
        r = self.ratio
        return list(block_ids) if r == 1 else [b * r + j for b in block_ids for j in range(r)]

    def _with_buffer(self, fn):
        """``fn(buffer id)``, registering first; once more after the sidecar answered that it does not
        know the buffer (it restarted). None when the sidecar cannot be reached."""
        for attempt in (0, 1):
            if (buf := self._registered()) is None:
                return None
            try:
                return fn(buf)
            except OSError:  # it restarted or went away: whichever sidecar answers next registers anew
                self.buffer = None
                raise
            except SidecarError as e:
                if attempt or "unknown buffer" not in e.detail:
                    raise
                self.buffer = None

    # --- the step ------------------------------------------------------------------------------

    def start_step(self, meta: StepMeta) -> None:
        """Start the step's fetches (vLLM 0.32 calls this after launching the forward)."""
        if isinstance(meta, StepMeta):
            self.idle_step = meta.step_tokens == 0
            for spec in meta.fetches:  # each reports its request finished, loaded or not
                with self.lock:
                    self.loading += 1
                self.pool.submit(self._fetch, spec)

    def layer_start(self, meta: StepMeta) -> None:
        """An attention layer starts: the first one of a step starts the step's clock."""
        if self._step_start is None and self.tensors is not None and isinstance(meta, StepMeta) and meta.step_tokens >= MIN_TIMED_TOKENS:
            self._step_start = self._clock()

    def end_step(self, meta: StepMeta) -> None:
        """The forward is done: time it, and start the stores of the prefills it finished."""
        if not isinstance(meta, StepMeta):
            return
        if self._step_start is not None:
            self._timing.append(((meta.step_tokens, meta.step_attention), self._step_start, self._clock()))
            self._step_start = None
        self._collect_timing()
        if meta.stores:
            ready = self._clock() if self.tensors is not None and not self._on_cpu() else None  # the step's KV writes, on the GPU
            for spec in meta.stores:
                self.stores[spec.req_id] = self.store_pool.submit(self._store, spec, ready)

    def _clock(self):
        if self._on_cpu():
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _collect_timing(self) -> None:
        """Steps whose time is known now (on a GPU, once their end event completed)."""
        pending = []
        for work, start, end in self._timing:
            if isinstance(start, float):
                self.steps.append((*work, end - start))
            elif end.query():
                self.steps.append((*work, start.elapsed_time(end) / 1e3))
            else:
                pending.append((work, start, end))
        self._timing = pending[-64:]

    def preempted(self, meta: StepMeta) -> None:
        """vLLM frees a preempted request's blocks: its store must have copied them first."""
        for req_id in getattr(meta, "preempted", ()) or ():
            if (f := self.stores.get(req_id)) is not None:
                f.exception()

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose stores and loads finished. After a step that computed nothing while loads
        run, first wait up to ``options.idle_step_wait_s`` for one to land (woken as it does): vLLM's
        engine steps without pause while a request waits for its KV, each step CPU and GPU work beside the load."""
        self.vllm_finished |= finished_req_ids & set(self.stores)
        sending = {r for r in self.vllm_finished if self.stores[r].done()}
        for r in sending:
            self.vllm_finished.discard(r)
            del self.stores[r]
        with self.lock:
            if self.idle_step and self.loading and not self.recving:
                self.landed.wait(self.options.idle_step_wait_s)
            recving, self.recving = self.recving, set()
        return sending or None, recving or None

    def load_errors(self) -> set[int]:
        with self.lock:
            errors, self.errors = self.errors, set()
        return errors

    def take_report(self) -> WorkerReport | None:
        with self.lock:
            if not self.stored and not self.steps and not self.fetched:
                return None
            rep = WorkerReport(self.stored, self.steps, self.fetched)
            self.stored, self.steps, self.fetched = {}, [], {}
        return rep

    # --- fetches and stores (pool threads) ------------------------------------------------------

    def _fetch(self, spec: FetchSpec) -> None:
        written, start = spec.first, time.perf_counter()
        try:
            written = self._with_buffer(lambda buf: self._fetch_into(buf, spec)) or spec.first
        except Exception as e:  # noqa: BLE001 — whatever failed, the blocks it did not write are recomputed
            log.warning("kvfetcher: KV fetch failed, recomputing: %s", e)
        bs = self.block_size
        with self.lock:
            self.errors.update(spec.block_ids[written // bs : -(-spec.end // bs)])
            self.fetched[spec.req_id] = (start, time.perf_counter())
            self.recving.add(spec.req_id)
            self.loading -= 1
            self.landed.notify_all()

    def _fetch_into(self, buf: str, spec: FetchSpec) -> int:
        """Load the request's stored chunks; the end of the tokens written (whole blocks)."""
        plan = spec.plans[self.tp_rank] if self.tp_rank < len(spec.plans) else None
        plan = plan if plan is not None and plan.tp_rank == self.tp_rank else None
        # without a chosen plan the sidecar looks up at fetch, as the scheduler did (the request's presets and budget)
        lookup = replace(spec.lookup, deadline_s=self.options.fetch_deadline_s)
        bs = self.block_size
        # vLLM's own cache holds the tokens before ``first``, in blocks other requests may share: never written
        if self.staging is not None:
            n = self.staging.fetch(self.client, buf, spec.tokens, self._blocks(spec.block_ids), spec.first, spec.end, plan, lookup)
            return max(spec.first, n // bs * bs)
        options = lookup if plan is None or not plan.preset else FetchOptions(deadline_s=self.options.fetch_deadline_s)
        reply = self.client.fetch(buf, spec.tokens, plan, block_ids=self._blocks(spec.block_ids), options=options, first_token=spec.first)
        return max(spec.first, min(reply.loaded_tokens, spec.end) // bs * bs)

    def _store(self, spec: StoreSpec, ready) -> None:
        stored = 0
        try:
            stored = self._with_buffer(lambda buf: self._store_from(buf, spec, ready)) or 0
        except Exception as e:  # noqa: BLE001 — a lost store costs a future recompute, never this request
            log.warning("kvfetcher: KV store failed: %s", e)
        with self.lock:
            self.stored[spec.req_id] = stored

    def _store_from(self, buf: str, spec: StoreSpec, ready) -> int:
        if ready is not None:
            ready.synchronize()  # the step's KV writes, on the GPU
        if self.staging is not None:
            chunk = spec.chunk_tokens or self.client.chunk_tokens
            return self.staging.store(self.client, buf, spec.tokens, self._blocks(spec.block_ids), chunk, spec.first_token) if chunk else 0
        rep = self.client.store(buf, spec.tokens, block_ids=self._blocks(spec.block_ids), first_token=spec.first_token)
        return rep.queued_chunks + rep.skipped_chunks

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.store_pool.shutdown(wait=True, cancel_futures=True)
        if self.buffer is not None:
            try:
                self.client.unregister(self.buffer)
            except (OSError, SidecarError):
                pass
        if self.staging is not None:
            self.staging.close()
        self.client.close()

