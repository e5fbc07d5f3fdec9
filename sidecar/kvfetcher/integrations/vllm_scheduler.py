"""The vLLM connector's scheduler side: what to fetch, what to store, and what to tell routers.

* :meth:`SchedulerSide.matched` (``get_num_new_matched_tokens``) asks the sidecar for a plan of the
  prompt (all but its last token, which vLLM always computes) once per request, in a lookup thread,
  and keeps it; it has no other side effect. The scheduler never waits on the network: the sidecar
  answers from its index of the store, the scheduler waits at most ``lookup_wait_s`` for that answer
  and otherwise tells vLLM to ask again at its next step, for at most ``lookup_timeout_s``. The tokens the plan would load beyond vLLM's own prefix-cache hit are
  loaded asynchronously. Under tensor parallelism every rank's sidecar is asked
  (:class:`~kvfetcher.api.group.RankGroup`): a prefix is loaded only where every rank has its shard,
  and each worker gets its own rank's plan.
* :meth:`allocated` turns that into a :class:`FetchSpec` with the request's block table; :meth:`step`
  (``build_connector_meta``) hands the workers the fetches and, for each request whose prefill ends in
  this step, a :class:`StoreSpec` of its whole chunks; :meth:`finished` holds the request's blocks
  until its store has copied them.
* vLLM's ``kv_role`` (:func:`~kvfetcher.integrations.vllm_meta.role`): ``kv_consumer`` never asks
  for a store, ``kv_producer`` never looks up (nor loads); a request's ``kv_transfer_params``
  ``{"store": false}`` is never stored.
* :meth:`report` reads the workers' report: stored chunks become ``BlockStored`` events (medium
  ``OBJ``) for KV-aware routers, timed steps teach the engine's prefill model
  (:class:`~kvfetcher.fetch.prefill.PrefillFit`, fed what :meth:`step` saw each request compute
  after how many cached tokens), which every plan then passes to the cost model, with what a load
  costs the engine beyond the fetch and the prefill after it (:class:`~kvfetcher.fetch.prefill.LoadOverhead`,
  timed from the workers' report that the load is done to the end of the request's prefill).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace

from kvfetcher import kvbuffer
from kvfetcher.api.client import SidecarError
from kvfetcher.api.group import RankGroup
from kvfetcher.fetch import prefill
from kvfetcher.fetch.plan import FetchOptions, FetchPlan
from kvfetcher.integrations.lookups import NOT_YET, Lookups
from kvfetcher.integrations.vllm_meta import MIN_TIMED_TOKENS, FetchSpec, Options, StoreSpec, StepMeta, WorkerReport

log = logging.getLogger("kvfetcher.integrations.vllm")

#: a lookup thread's wait for a reply beyond the sidecar's own wait for its listing (``listing_wait_s``):
#: a reply that the sidecar was allowed to take is never a failed lookup (the scheduler itself waits at most lookup_wait_s)
LOOKUP_SOCKET_TIMEOUT_S = 2.0
MEDIUM = "OBJ"  # vLLM's KV-event medium of an object store (MEDIUM_OBJ in vLLM 0.26)
WARN_EVERY_S = 30.0
MAX_WAIT_S = 0.01  # the most one lookup's ask holds the scheduler (and every request decoding) in a step
LOOKUP_THREADS = 4  # lookups in flight at once (requests arriving together are not asked in turn)
#: answers whose plans tell whether a late answer is worth a step: once this many in a row planned no
#: load, a request whose answer is late recomputes at once rather than waiting a step for it
NOTHING_TO_WAIT_FOR = 8
#: seconds a load costs vLLM beyond the fetch and the prefill after it until the engine's own loads are timed
#: (:class:`~kvfetcher.fetch.prefill.LoadOverhead`; docs/results.md has the measurement behind it)
LOAD_OVERHEAD_PRIOR_S = 0.03


@dataclass
class _Request:
    request: object  # vllm Request: its prompt and block hashes
    tokens: list[int]  # what was planned: the prompt but its last token (or the leading part all ranks agreed on)
    plans: tuple[FetchPlan | None, ...]  # per tensor-parallel rank
    end: int  # tokens the plan would load, from token 0 (0 once the load was handed to the workers)
    options: FetchOptions = field(default_factory=FetchOptions)  # the lookup's: a load without a chosen plan plans with them
    loaded: int = 0  # tokens a load was asked for (stored already)
    stored: int = 0  # leading tokens the lookup found stored, in any preset (every rank's plan's hit): a store starts after them
    local: int = 0  # vLLM's own prefix-cache hit when the load was decided
    blocks: list[int] = field(default_factory=list)  # the block table
    storing: bool = False  # a store was asked for: its blocks stay until the workers copied them
    store: bool = True  # its prefill may be stored (the connector's role and the request's own ``store``)
    answered: bool = False  # the sidecar's plan (not a failed or late lookup's recompute)


@dataclass
class _Load:
    """A load handed to the workers: the tokens it loads to, when it was handed over, when it ended
    (as the workers timed the fetch, else when they reported it done), and the prefill model's
    seconds for the engine's steps since (``perf_counter`` times)."""

    end: int
    handed: float
    done: float | None = None
    predicted: float = 0.0


class SchedulerSide:
    def __init__(self, vllm_config, kv_cache_config, options: Options):
        self.options = options
        tp = vllm_config.parallel_config.tensor_parallel_size
        reply_s = options.listing_wait_s + LOOKUP_SOCKET_TIMEOUT_S
        self.group = RankGroup([options.client(reply_s, rank=r) for r in range(tp)]) if tp > 1 else None
        self.client = self.group.clients[0] if self.group else options.client(timeout_s=reply_s)
        self.lookups = Lookups(options.lookup_wait_s, options.lookup_timeout_s, LOOKUP_THREADS)  # off the scheduler's thread
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.block_size = spec.block_size
        self.dtype = kvbuffer.dtype_name(spec.dtype)
        self.kv_shape = (len(kv_cache_config.kv_cache_groups[0].layer_names), spec.num_kv_heads, spec.head_size)
        self.prefill = prefill.PrefillFit()  # the engine's prefill by its GPU steps ...
        self.wall = prefill.WallScale()  # ... and how much longer whole prefills take by the wall clock
        self.prefilling: dict[str, tuple[float, int, int]] = {}  # req_id -> (first scheduled, computed then, prompt tokens)
        self.load_overhead = prefill.LoadOverhead(LOAD_OVERHEAD_PRIOR_S)
        self.loading: dict[str, _Load] = {}
        self.requests: dict[str, _Request] = {}
        self.fetches: list[FetchSpec] = []
        self.storing: dict[str, _Request] = {}  # asked to store, not yet reported
        self.events: list = []
        self._warned: dict[str, float] = {}  # message -> when last logged
        self.loads_planned: deque[bool] = deque(maxlen=NOTHING_TO_WAIT_FOR)  # per recent answer: did it plan a load

    def close(self) -> None:
        if self.lookups.answered:
            log.info("kvfetcher: %d lookups answered (lately 90%% within %.1f ms of the first ask), %d asks put a request off a step",
                     self.lookups.answered, 1e3 * self.lookups.typical_s(), self.lookups.deferred)
        self.lookups.close()
        (self.group or self.client).close()

    # --- lookups -----------------------------------------------------------------------------

    def _options(self, request, model: prefill.PrefillModel | None) -> FetchOptions:
        """The lookup's options, with the engine's prefill ``model``; a request's ``kv_transfer_params`` may name ``presets`` and
        ``ttft_budget_s`` (``SamplingParams(extra_args={"kv_transfer_params": {...}})``) in place of the options'."""
        own = getattr(request, "kv_transfer_params", None) or {}
        presets = own.get("presets", self.options.presets)
        return FetchOptions(presets=tuple(presets) if presets else None, ttft_budget_s=own.get("ttft_budget_s", self.options.ttft_budget_s),
                            prefill_model=model, recompute_tokens_per_s=self.options.recompute_tokens_per_s,
                            load_overhead_s=self.load_overhead.seconds, prefill_error=self.wall.error, wait_s=self.options.listing_wait_s)

    def _stores(self, request) -> bool:
        """Whether the request's prefill is stored: the role stores (not ``kv_consumer``) and its
        ``kv_transfer_params`` do not say ``"store": false`` (``ValueError`` for a value not a bool)."""
        own = (getattr(request, "kv_transfer_params", None) or {}).get("store", True)
        if not isinstance(own, bool):
            raise ValueError(f"kv_transfer_params 'store' must be true or false, not {own!r}")
        return self.options.stores and own

    def _lookup(self, request, options: FetchOptions) -> _Request:
        """The request's plan (in a lookup thread: the sidecar answers from its index of the store)."""
        tokens = list(request.prompt_token_ids or [])[:-1]
        plans, end = (), 0
        try:
            if self.group is not None:  # a rank that cannot answer makes the group recompute (no exception)
                plan = self.group.lookup(tokens, None, options, model=self.options.model, dtype=self.dtype, kv_shape=self.kv_shape)
                plans, tokens = plan.plans, tokens[: plan.tokens]
                if plan.error:
                    self._warn("KV lookup failed on a tensor-parallel rank, the group recomputes: %s (%s)", plan.reason, plan.detail)
            else:
                plan = self.client.lookup(None, tokens, options, model=self.options.model, dtype=self.dtype, kv_shape=self.kv_shape)
                plans = (plan,)
            # no preset chosen: the sidecar has no buffer of this namespace yet; the fetch looks up again
            end = plan.loaded_tokens if plan.preset else plan.hit_tokens
        except (OSError, SidecarError) as e:  # no sidecar is no reason to fail a request: recompute
            self._warn("KV lookup failed, recomputing: %s", e)
        stored = min((p.hit_tokens if p is not None else 0 for p in plans), default=0)
        return _Request(request, tokens, plans, end, options, stored=stored, answered=bool(plans))

    def _late(self, request) -> _Request:
        self._warn("KV lookup not answered in time (lookup_timeout_s %s, lookup_stake %s), recomputing",
                   self.options.lookup_timeout_s, self.options.lookup_stake)
        return _Request(request, [], (), 0)

    def prefill_model(self) -> prefill.PrefillModel | None:
        """The engine's prefill time by the wall clock, as a request's first token waits for it
        (None until a step was timed)."""
        return self.wall.apply(self.prefill.model())

    def _patience(self, request, num_computed_tokens: int, model: prefill.PrefillModel | None) -> tuple[float, float]:
        """How long one ask may hold the scheduler and how long a request's plan may keep it
        waiting, from its stake (``lookup_stake`` of its predicted recompute): the ask waits as long
        as recent answers took (with a quarter to spare) or a quarter of the stake, whichever is
        longer, at least ``lookup_wait_s`` and at most :data:`MAX_WAIT_S`, so that a request is not
        put off a whole step for want of a millisecond; the request up to the stake (at least
        ``lookup_timeout_s``), unless the last :data:`NOTHING_TO_WAIT_FOR` answers planned no load:
        then a late answer is not worth a step, and the request recomputes at once."""
        new = len(request.prompt_token_ids or ()) - num_computed_tokens
        stake = self.options.lookup_stake * model.seconds(num_computed_tokens, new) if model is not None and new > 0 else 0.0
        wait = max(self.options.lookup_wait_s, min(MAX_WAIT_S, max(stake / 4, 1.25 * self.lookups.typical_s())))
        worth_a_step = len(self.loads_planned) < NOTHING_TO_WAIT_FOR or any(self.loads_planned)
        return wait, max(self.options.lookup_timeout_s, stake) if worth_a_step else 0.0

    def matched(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: never waits more than ``lookup_wait_s`` for the
        sidecar. A lookup still in flight answers None (vLLM asks again at its next step, the
        request waiting meanwhile); one not answered in time (:meth:`_patience`) recomputes. A role
        that does not load (``kv_producer``) asks nothing: every request recomputes (and is stored);
        nor does a prompt with no whole chunk beyond vLLM's own hit (:meth:`_may_gain`)."""
        if getattr(request, "skip_reading_prefix_cache", False):  # a plain recompute (vLLM 0.26 still asks the connector)
            return 0, False
        rid = request.request_id
        r = self.requests.get(rid)
        if r is None:
            model = self.prefill_model()
            try:
                options, store = self._options(request, model), self._stores(request)
            except (TypeError, ValueError) as e:  # a request's bad kv_transfer_params: its own recompute, not the engine's failure
                self._warn("kvfetcher: request %s's kv_transfer_params refused, recomputing (not stored): %s", rid, e)
                self.requests[rid] = _Request(request, [], (), 0, store=False)
                return 0, False
            if self.options.loads and self._may_gain(request, num_computed_tokens):
                wait_s, timeout_s = self._patience(request, num_computed_tokens, model)
                r = self.lookups.answer(rid, lambda: self._lookup(request, options), lambda: self._late(request), timeout_s, wait_s)
                if r is NOT_YET:  # the request waits a step: say so, as TTFT pays for it
                    self._warn("kvfetcher: a request was put off a step, its KV lookup not answered within %.1f ms "
                               "(lately 90%% of lookups answered within %.1f ms; %d of %d asks put off so far)",
                               1e3 * wait_s, 1e3 * self.lookups.typical_s(), self.lookups.deferred, self.lookups.answered)
                    return None, False
                if r.answered:
                    self.loads_planned.append(r.end > num_computed_tokens)
            else:
                r = _Request(request, [], (), 0)
            r.store = store
            self.requests[rid] = r
        r.local = num_computed_tokens
        n = r.end - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def _may_gain(self, request, num_computed_tokens: int) -> bool:
        """Whether a load could add to vLLM's own hit: the prompt (but its last token) has a whole
        chunk beyond it. Else the sidecar is not asked and the scheduler never waits (a short chat
        turn pays nothing); unknown before the sidecar's first answer gave its chunk size."""
        chunk = self.client.chunk_tokens
        return not chunk or (len(request.prompt_token_ids or ()) - 1) // chunk * chunk > num_computed_tokens

    def allocated(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        r = self.requests.get(request.request_id)
        if r is None or num_external_tokens <= 0:
            return
        r.blocks, r.loaded = list(block_ids), r.end
        lookup = replace(r.options, prefill_model=self.prefill_model(), load_overhead_s=self.load_overhead.seconds,  # as fitted by now
                         prefill_error=self.wall.error, wait_s=0.0)
        self.loading[request.request_id] = _Load(r.local + num_external_tokens, time.perf_counter())
        self.fetches.append(FetchSpec(request.request_id, r.tokens, r.plans, r.local, r.local + num_external_tokens, r.blocks, lookup))
        r.end = 0  # one load per request: vLLM asks again only after it failed (or a preemption), then recompute

    # --- the step ----------------------------------------------------------------------------

    def step(self, out) -> StepMeta:
        new, cached = out.scheduled_new_reqs, out.scheduled_cached_reqs
        had = {n.req_id: n.num_computed_tokens for n in new} | dict(zip(cached.req_ids, cached.num_computed_tokens))
        _, attention = prefill.terms((had[r], out.num_scheduled_tokens[r]) for r in had)
        meta = StepMeta(self.fetches, [], out.total_num_scheduled_tokens, set(getattr(out, "preempted_req_ids", None) or ()), attention)
        self.fetches = []
        self._time_prefills(new, had, meta.preempted)
        self._time_loads(new, had, meta.preempted, out.total_num_scheduled_tokens, attention)
        for n in new:
            if (r := self.requests.get(n.req_id)) is not None:
                r.blocks = list(n.block_ids[0])
        for i, req_id in enumerate(cached.req_ids):
            if (r := self.requests.get(req_id)) is not None and cached.new_block_ids[i] is not None:
                fresh = list(cached.new_block_ids[i][0])  # a resumed request gets its whole table anew
                r.blocks = fresh if req_id in cached.resumed_req_ids else r.blocks + fresh
        for req_id, computed in had.items():  # computed once this step ends
            if (r := self.requests.get(req_id)) is not None and (spec := self._store(r, computed + out.num_scheduled_tokens[req_id])):
                meta.stores.append(spec)
        return meta

    def _store(self, r: _Request, computed: int) -> StoreSpec | None:
        chunk = self.client.chunk_tokens
        prompt = r.request.prompt_token_ids or []
        if r.storing or not r.store or not chunk or computed < len(prompt):
            return None
        n = len(prompt) // chunk * chunk
        first = max(r.loaded, r.stored) // chunk * chunk
        if n <= first:  # nothing new: those chunks were loaded from the store, or are stored already
            return None
        blocks = r.blocks[: -(-n // self.block_size)]
        if len(blocks) * self.block_size < n:
            return None
        r.storing = True
        self.storing[r.request.request_id] = r
        return StoreSpec(r.request.request_id, list(prompt[:n]), blocks, chunk, first)

    def _time_prefills(self, new, had: dict[str, int], preempted: set[str]) -> None:
        """Whole prefills by the wall clock, from the step that first schedules a request to the
        first step after its prompt is computed (or its end, :meth:`finished`): :attr:`wall`."""
        now = time.perf_counter()
        for n in new:
            prompt = len(n.prompt_token_ids or ())
            if prompt - n.num_computed_tokens >= MIN_TIMED_TOKENS:
                self.prefilling[n.req_id] = (now, n.num_computed_tokens, prompt)
        for req_id in preempted:
            self.prefilling.pop(req_id, None)
        for req_id, computed in had.items():
            if req_id in self.prefilling and computed >= self.prefilling[req_id][2]:
                self._prefilled(req_id, now)

    def _prefilled(self, req_id: str, now: float) -> None:
        t0, computed, prompt = self.prefilling.pop(req_id)
        if (model := self.prefill.model()) is not None:
            self.wall.observe(model.seconds(computed, prompt - computed), now - t0)

    def loads_done(self, req_ids) -> None:
        """vLLM's workers reported these requests' loads done (``finished_recving``)."""
        now = time.perf_counter()
        for req_id in req_ids or ():
            if (load := self.loading.get(req_id)) is not None and load.done is None:
                load.done = now

    def _time_loads(self, new, had: dict[str, int], preempted: set[str], tokens: int, attention: float) -> None:
        """What a load cost the engine past the fetch: from the fetch's end to the first step after
        the request's prompt is computed (or its end, :meth:`finished`), plus the wait from the step
        that handed the load over to the fetch's start, against the prefill model's time for the
        steps after the fetch (this one: ``tokens``, ``attention``; a step that computes nothing is
        the load's, not a prefill's: its time is overhead): :attr:`load_overhead`. The fetch as the
        workers timed it (:meth:`report`), else from their report that it is done. A load that fell
        short (the request first scheduled with fewer tokens) or a preempted request is not timed."""
        for n in new:
            if n.req_id in self.loading and n.num_computed_tokens < self.loading[n.req_id].end:
                del self.loading[n.req_id]
        for req_id in preempted:
            self.loading.pop(req_id, None)
        for req_id, computed in had.items():
            if req_id in self.loading and (r := self.requests.get(req_id)) is not None and computed >= len(r.request.prompt_token_ids or ()):
                self._loaded(req_id)
        done = [load for load in self.loading.values() if load.done is not None]
        if done and tokens > 0 and (model := self.prefill_model()) is not None:  # (a refitted model solves: only while a load waits on the engine)
            step_s = model.step(tokens, attention)
            for load in done:
                load.predicted += step_s

    def _loaded(self, req_id: str) -> None:
        load = self.loading.pop(req_id)
        if load.done is not None:
            self.load_overhead.observe(load.predicted, time.perf_counter() - load.done)

    def finished(self, req_id: str, prefilled: bool = False) -> bool:
        """Whether the request's blocks must wait for its store (the workers then report it).
        ``prefilled``: its prompt was computed (its prefill's wall time ends here, if not before)."""
        if req_id in self.prefilling:
            if prefilled:
                self._prefilled(req_id, time.perf_counter())
            else:
                del self.prefilling[req_id]
        if req_id in self.loading:
            if prefilled:
                self._loaded(req_id)
            else:
                del self.loading[req_id]
        self.lookups.forget(req_id)  # finished (aborted) while its lookup was in flight
        r = self.requests.pop(req_id, None)
        return r is not None and r.storing

    # --- what the workers report -------------------------------------------------------------

    def report(self, rep: WorkerReport | None) -> None:
        if not isinstance(rep, WorkerReport):
            return
        for req_id, chunks in rep.stored_chunks.items():
            r = self.storing.pop(req_id, None)
            if r is not None and chunks:
                self.events.extend(self._stored_events(r, chunks * self.client.chunk_tokens))
        for tokens, attention, seconds in rep.steps:
            if tokens >= MIN_TIMED_TOKENS:
                self.prefill.observe(tokens, attention, seconds)
        for req_id, (start, end) in rep.fetched.items():  # the engine's time from here on is the load's (less its steps)
            if (load := self.loading.get(req_id)) is not None:
                load.done = end - max(0.0, start - load.handed)

    def _stored_events(self, r: _Request, tokens: int) -> list:
        """``BlockStored`` for the blocks of the stored chunks, one event per chunk."""
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        req, bs, chunk = r.request, self.block_size, self.client.chunk_tokens
        hashes = [maybe_convert_block_hash(h) for h in req.block_hashes[: tokens // bs]]
        lora = getattr(req, "lora_request", None)
        events = []
        for start in range(0, min(tokens, len(hashes) * bs), chunk):
            b0, b1 = start // bs, min(start + chunk, len(hashes) * bs) // bs
            events.append(BlockStored(block_hashes=hashes[b0:b1], parent_block_hash=hashes[b0 - 1] if b0 else None,
                                      token_ids=list(req.prompt_token_ids[b0 * bs : b1 * bs]), block_size=bs,
                                      lora_id=getattr(lora, "lora_int_id", None), medium=MEDIUM,
                                      lora_name=lora.name if lora else None))
        return events

    def take_events(self) -> list:
        events, self.events = self.events, []
        return events

    def _warn(self, msg: str, *args) -> None:
        """Log ``msg`` at most once every :data:`WARN_EVERY_S` (each message on its own)."""
        if time.monotonic() - self._warned.get(msg, float("-inf")) > WARN_EVERY_S:
            self._warned[msg] = time.monotonic()
            log.warning(msg, *args)
