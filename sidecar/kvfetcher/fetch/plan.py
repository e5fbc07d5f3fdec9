"""plan: what a lookup decides a fetch will do, before any KV moves — and what the fetch answered.

:func:`make_plan` finds the prefix's stored run through a :class:`Catalog` (an in-memory index of
what is stored; what it does not know is listed, one LIST per chunk in growing batches of up to
:data:`LOOKUP_PARALLEL`, stopping at the first chunk not stored, in the background unless the
caller asks to wait) and runs the cost model (:func:`choice.hopeless` first, then
:func:`choice.choose`). Whoever calls it records metrics and teaches the estimator from the
returned plan.

A :class:`FetchPlan` names no object. It is bound to its prompt by ``prefix_key``, the key of the
last requested chunk (which hashes the namespace, tenant included, and every token before it), and
sealed by the sidecar that made it (:func:`seal`), so that a plan that travelled through a client
can be checked before a fetch trusts its presets and object sizes. A fetch re-derives every object
name from its own buffer's namespace and tokens.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, fields, replace

from kvfetcher import codec, keys
from kvfetcher.errors import Reason
from kvfetcher.fetch import choice
from kvfetcher.fetch.prefill import PrefillModel
from kvfetcher.format.presets import PRESETS, measured
from kvfetcher.store import Store, StoreError
from kvfetcher.store.index import StoredIndex

LOOKUP_PARALLEL = 16  # LISTs in flight during a listing
#: measured size ratio vs fp16 per preset, for the no-listing shortcut (absent where never measured)
RATIOS = {p: r for p in PRESETS if (r := (measured(p) or {}).get("ratio_vs_fp16"))}  # where the preset table measured one
#: the bitstream format of every preset this reader can decode (``ans`` only with a GPU and nvCOMP):
#: the cost model never considers the others, whatever is stored
FORMATS = {p: PRESETS[p].codec.format for p in PRESETS if codec.decodable(PRESETS[p].codec.format)}


def _doc(text: str, min: float | None = None, open: bool = False, **kw):
    """A field with its doc (and, for numbers, a lower bound the API checks: ``open`` exclusive)."""
    return field(metadata={"doc": text, **({} if min is None else {"min": min, "open": open})}, **kw)


@dataclass(frozen=True)
class FetchOptions:
    """How a lookup (or a fetch that looks up) chooses what to fetch: the API's one options message."""

    presets: tuple[str, ...] | None = _doc("presets a fetch may use, within the sidecar's allowed ones (default: all of those)", default=None)
    ttft_budget_s: float | None = _doc("prefer a fetch predicted within this many seconds to a faster recompute (default: the "
                                       "sidecar's `KVFETCHER_TTFT_BUDGET_S`)", min=0, open=True, default=None)
    prefill_model: PrefillModel | None = _doc("the engine's prefill time as it measured it (wins over `recompute_tokens_per_s`)", default=None)
    recompute_tokens_per_s: float | None = _doc("the model's prefill rate, constant (default: the sidecar's `KVFETCHER_RECOMPUTE_TPS`)",
                                                min=0, open=True, default=None)
    load_overhead_s: float | None = _doc("seconds a load costs the engine beyond the fetch and the prefill after it (scheduling the "
                                         "request again once the load is done), as it measured them: every load option pays them "
                                         "(default: none)", min=0, default=None)
    prefill_error: float = _doc("how far the engine's prefill model was lately off its whole prefills, as a share of their time "
                                "(it measures it): a load is taken only when predicted faster than recompute by more than this "
                                f"share of recompute's time, at most {choice.MAX_PREFILL_ERROR}", min=0, default=0.0)
    deadline_s: float | None = _doc("seconds a listing, and a fetch, may take (default: the sidecar's `KVFETCHER_DEADLINE_S`)",
                                    min=0, open=True, default=None)
    group_size: int = _doc("fetches that will run at once as one group with this one, itself included (a tensor-parallel group's "
                           "ranks): they share the node's link, beside the fetches the node's sidecars announce", min=1, default=1)
    refresh: bool = _doc("list the store for the chunks the sidecar's index does not know before answering (default: answer from "
                         "the index and list those in the background; a fetch that looks up always lists them)", default=False)
    wait_s: float = _doc("without `refresh`: seconds the answer may wait for that background listing before it answers with what "
                         "the index knows then (a serving engine's scheduler gives a few milliseconds)", min=0, default=0.0)

    def __post_init__(self) -> None:
        if self.presets is not None:
            object.__setattr__(self, "presets", tuple(self.presets))
            if unknown := [p for p in self.presets if p not in PRESETS]:  # a typo would otherwise be a miss forever
                raise ValueError(f"unknown preset(s) {unknown}; known: {', '.join(PRESETS)}")


@dataclass(frozen=True)
class EngineDecode:
    """A buffer whose engine decodes stored objects itself (engine-decode mode: a GPU the sidecar
    cannot open). Fetches into it write verified stored objects, not KV; plans consider only the
    presets of these formats, at the engine's decode rates."""

    formats: tuple[str, ...] = _doc("bitstream formats the engine decodes (`raw`, `zstd`, `ans`, `hevc`)")
    device: str = _doc("where the engine decodes: `cuda` (the cost model's GPU rates) or `cpu`", default="cuda")

    def __post_init__(self) -> None:
        object.__setattr__(self, "formats", tuple(self.formats))
        known = {PRESETS[p].codec.format for p in PRESETS}
        if unknown := [f for f in self.formats if f not in known] or not self.formats:
            raise ValueError(f"engine formats {unknown or list(self.formats)}: name some of {', '.join(sorted(known))}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"engine device must be 'cuda' or 'cpu', not {self.device!r}")

    def presets(self) -> dict[str, str]:
        """Each preset the engine can decode, with its bitstream format (:data:`FORMATS`' counterpart)."""
        return {p: PRESETS[p].codec.format for p in PRESETS if PRESETS[p].codec.format in self.formats}


@dataclass(frozen=True)
class EngineDecoded:
    """What an engine that decodes itself restored of one preset (reported with its next fetch)."""

    preset: str = _doc("the preset decoded")
    kv_bytes: int = _doc("KV bytes restored into its blocks", min=0)
    seconds: float = _doc("seconds its decodes and writes took", min=0)


@dataclass(frozen=True)
class FetchPlan:
    """What a fetch of `requested_tokens` leading tokens would do, and why: what a lookup returns."""

    model: str = _doc("model fingerprint of the namespace")
    dtype: str = _doc("KV dtype of the namespace, e.g. `float16`")
    tp_rank: int = _doc("tensor-parallel rank of the namespace")
    chunk_tokens: int = _doc("tokens per chunk")
    requested_tokens: int = _doc("the request's tokens rounded down to whole chunks")
    prefix_key: str = _doc("key of the last requested chunk (empty when none): binds the plan to its tokens")
    hit_tokens: int = _doc("leading tokens known stored (as the sidecar's index knows them, or as listed)")
    preset: str | None = _doc("the chosen preset, `recompute`, or null: not chosen (no buffer of this namespace)")
    chunks: tuple[tuple[str, int], ...] = _doc("the leading chunks to fetch, as [preset, object size]")
    predicted_s: float = _doc("predicted seconds of that fetch")
    options: dict[str, float] = _doc("predicted seconds until the whole prefix is in the buffer, per option considered")
    lookup_s: float | None = _doc("seconds the listing took (null: answered from the sidecar's index, no store request waited for)")
    reason: str | None = _doc("why it fetches fewer than `requested_tokens`: `miss`, `cost_model` or a failure reason")
    detail: str | None = _doc("a human-readable detail of `reason`")
    breakeven_s: float | None = _doc("seconds after which the chosen load has lost to recompute (or passed the TTFT budget): a fetch "
                                     "still running then stops, keeping the chunks it loaded (null: the fetch's deadline alone)",
                                     default=None)
    tag: str = _doc("the issuing sidecar's seal over the other fields; a fetch refuses a plan whose seal does not match", default="")

    @property
    def loaded_tokens(self) -> int:
        """Tokens the plan fetches."""
        return len(self.chunks) * self.chunk_tokens

    @property
    def error(self) -> str | None:
        """The failure that made this plan recompute (not a decision such as a miss)."""
        return self.reason if self.reason not in (None, Reason.MISS, Reason.COST_MODEL) else None


def plain(value):
    """A message (a dataclass, nested) as JSON's plain values: objects, arrays (from tuples and
    lists), scalars. What ``dataclasses.asdict`` gives, without its deep copy of every scalar."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return {f.name: plain(getattr(value, f.name)) for f in fields(value)}


def _digest(plan: FetchPlan, key: bytes) -> str:
    body = {k: v for k, v in plain(plan).items() if k != "tag"}
    return hmac.new(key, json.dumps(body, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def seal(plan: FetchPlan, key: bytes) -> FetchPlan:
    return replace(plan, tag=_digest(plan, key))


def sealed(plan: FetchPlan, key: bytes) -> bool:
    """Whether ``plan`` is, field for field, one that :func:`seal` made with ``key``."""
    return hmac.compare_digest(plan.tag.encode(), _digest(plan, key).encode())


@dataclass(frozen=True)
class Costs:
    """What the cost model needs besides the listing."""

    rates: choice.Rates
    chunk_kv_bytes: int | None  # KV bytes of one chunk in the buffer (None: no buffer, no choice)
    allowed: frozenset[str]  # presets the fetch may use
    budget_s: float | None  # TTFT budget (see choice)
    formats: Mapping[str, str] = field(default_factory=lambda: FORMATS)  # presets the reader decodes, with their format


def _representations(store: Store, key: str) -> dict[str, int]:
    """The chunk's stored representations: preset -> object size. Blocking."""
    reps = {}
    for name, size in store.list(keys.chunk_prefix(key)).items():
        try:
            reps[keys.preset_of(name)] = size
        except ValueError:
            continue
    return reps


def listing_rounds(chunks: int) -> int:
    """Rounds of LISTs (batches of 1, 2, 4, … up to :data:`LOOKUP_PARALLEL`) that list ``chunks`` chunks."""
    rounds, batch = 0, 1
    while chunks > 0:
        chunks, rounds, batch = chunks - batch, rounds + 1, min(2 * batch, LOOKUP_PARALLEL)
    return rounds


async def list_prefix(store: Store, chunk_keys: Sequence[str], io_pool: Executor) -> list[dict[str, int]]:
    """For the leading run of chunks stored in a known preset: preset -> object size.

    Lists in growing batches (1, 2, 4, … up to :data:`LOOKUP_PARALLEL` LISTs in flight) and stops
    at the batch holding the first chunk that is not stored: a miss costs one LIST however long the
    prompt, a hit of ``n`` chunks about ``n`` LISTs."""
    loop = asyncio.get_running_loop()
    run: list[dict[str, int]] = []
    i, batch = 0, 1
    while i < len(chunk_keys):
        listed = await asyncio.gather(*(loop.run_in_executor(io_pool, _representations, store, k) for k in chunk_keys[i : i + batch]))
        for reps in listed:
            if not any(p in PRESETS for p in reps):
                return run
            run.append(reps)
        i, batch = i + batch, min(2 * batch, LOOKUP_PARALLEL)
    return run


class Catalog:
    """The store seen through a :class:`StoredIndex`: a run of stored chunks answered from memory,
    what the index does not know listed (:func:`list_prefix`) either in the background (a lookup:
    it never waits on the store) or before answering (``refresh``: a fetch that plans, a caller
    that must see the store). At most ``max_listings`` background listings run at once, one per
    unknown chunk; ``failed(reason)`` counts those that fail."""

    def __init__(self, store: Store, index: StoredIndex, io_pool: Executor, failed=lambda reason: None, max_listings: int = 32):
        self.objects, self.index, self.io_pool, self.failed, self.max_listings = store, index, io_pool, failed, max_listings
        self._listing: dict[str, asyncio.Task] = {}  # background listings by the first key they list

    async def run(self, ck: Sequence[str], *, refresh: bool = False, wait_s: float = 0.0) -> list[dict[str, int]]:
        """The leading run of ``ck`` stored. ``refresh``: list what the index does not know first
        (the caller bounds the wait); else list that in the background and answer from the index,
        after waiting at most ``wait_s`` for that listing."""
        run, known = self.index.run(ck)
        if known:
            return run
        if refresh:
            await self._list(ck, len(run))
            return self.index.run(ck)[0]
        key = ck[len(run)]
        task = self._listing.get(key)
        if task is None and len(self._listing) < self.max_listings:
            task = self._listing[key] = asyncio.get_running_loop().create_task(self._background(ck, len(run)))
            task.add_done_callback(lambda _t: self._listing.pop(key, None))
        if task is not None and wait_s > 0:
            await asyncio.wait([task], timeout=wait_s)
            return self.index.run(ck)[0]
        return run

    async def settled(self) -> None:
        """Wait for the background listings started so far."""
        await asyncio.gather(*self._listing.values(), return_exceptions=True)

    def close(self) -> None:
        """Cancel the background listings."""
        for task in list(self._listing.values()):
            task.cancel()

    async def _list(self, ck: Sequence[str], start: int) -> None:
        rest = ck[start:]
        self.index.listed(rest, await list_prefix(self.objects, rest, self.io_pool))

    async def _background(self, ck: Sequence[str], start: int) -> None:
        try:
            await self._list(ck, start)
        except StoreError as e:
            self.failed(e.reason)
        except Exception:  # noqa: BLE001 — a background listing must not die unseen (e.g. its pool shut down)
            self.failed(Reason.INTERNAL)


async def make_plan(
    catalog: Catalog,
    ns: keys.Namespace,
    ck: Sequence[str],
    chunk_tokens: int,
    costs: Costs,
    *,
    refresh: bool = False,
    wait_s: float = 0.0,
    deadline_s: float | None = None,
) -> FetchPlan:
    """Plan a fetch of the chunks keyed ``ck`` (:func:`keys.chunk_keys` of the prompt in ``ns``, whole
    chunks only) from what ``catalog`` knows is stored; with ``refresh``, what it does not know is
    listed first, within ``deadline_s`` (a store failure or a missed deadline is a plan that
    recomputes, with its reason). Without ``refresh`` nothing here waits on the store longer than
    ``wait_s``, and when no fetch could pay (:func:`choice.hopeless`) the store is not asked at all
    (the hit is then what the index knows)."""
    n_req = len(ck) * chunk_tokens
    recompute = FetchPlan(ns.model, ns.dtype, ns.tp_rank, chunk_tokens, n_req, ck[-1] if ck else "", 0, choice.RECOMPUTE, (), 0.0,
                          {}, None, Reason.MISS.value, "nothing requested" if not ck else None)
    if not ck:
        return recompute
    if not refresh and costs.chunk_kv_bytes is not None and choice.hopeless(
        len(ck), chunk_tokens, costs.chunk_kv_bytes, RATIOS, costs.formats, costs.rates, set(costs.allowed), budget_s=costs.budget_s):
        return replace(recompute, hit_tokens=len(catalog.index.run(ck)[0]) * chunk_tokens, reason=Reason.COST_MODEL.value,
                       detail="recompute predicted faster than any stored preset could be; store not asked",
                       options={choice.RECOMPUTE: costs.rates.prefill.seconds(0, n_req)})  # (recompute alone: the shortcut decided)
    t = time.perf_counter()
    try:
        async with asyncio.timeout(deadline_s if refresh else None):
            run = await catalog.run(ck, refresh=refresh, wait_s=wait_s)
    except StoreError as e:
        return replace(recompute, reason=e.reason, detail=str(e), lookup_s=time.perf_counter() - t)
    except TimeoutError:
        return replace(recompute, reason=Reason.DEADLINE.value, detail=f"listing the prefix took longer than {deadline_s} s",
                       lookup_s=time.perf_counter() - t)
    listed = replace(recompute, hit_tokens=len(run) * chunk_tokens, lookup_s=time.perf_counter() - t if refresh else None,
                     reason=None if run else Reason.MISS.value, detail=None if run else "nothing stored")
    if costs.chunk_kv_bytes is None or not run:
        return replace(listed, preset=None) if run else listed
    return decide(listed, run, costs)


def decide(listed: FetchPlan, run: Sequence[dict[str, int]], costs: Costs) -> FetchPlan:
    """The cost model's choice among the listed representations ``run`` of ``listed``'s chunks."""
    d = choice.choose(run, listed.chunk_tokens, costs.chunk_kv_bytes, costs.formats, costs.rates, set(costs.allowed), costs.budget_s)
    if d.preset == choice.RECOMPUTE:
        return replace(listed, preset=d.preset, options=d.options, reason=Reason.COST_MODEL.value, detail="recompute predicted faster")
    return replace(listed, preset=d.preset, chunks=tuple((d.preset, run[i][d.preset]) for i in range(d.chunks)),
                   predicted_s=d.predicted_s, options=d.options, breakeven_s=d.breakeven_s)


@dataclass
class FetchDecision:
    """What a fetch chose, and how long it took against the prediction."""

    preset: str = _doc("the preset loaded, or `recompute`")
    chunks: int = _doc("leading chunks planned")
    predicted_s: float = _doc("the plan's predicted seconds")
    options: dict[str, float] = _doc("the plan's options (see the plan)")
    actual_s: float | None = _doc("measured seconds of the fetch (null: nothing was fetched)", default=None)


@dataclass
class FetchReply:
    """What a fetch did: the leading ``loaded_tokens`` are in the buffer, ``not_loaded`` are not."""

    requested_tokens: int = _doc("the request's tokens rounded down to whole chunks")
    loaded_tokens: int = _doc("leading tokens now in the buffer; recompute from here", default=0)
    chunk_tokens: int = _doc("tokens per chunk", default=0)
    not_loaded: tuple[int, int] = _doc("the `[start, end)` range of requested tokens to recompute", default=(0, 0))
    error: str | None = _doc("the failure that stopped the fetch early, if any", default=None)
    reason: str | None = _doc("why fewer than requested were loaded: `miss`, `cost_model` or the failure", default=None)
    detail: str | None = _doc("a human-readable detail of `reason`", default=None)
    decision: FetchDecision | None = _doc("the plan's choice and the measured time", default=None)
    lookup_s: float | None = _doc("seconds the plan's listing took (null: the store was not asked)", default=None)
    bytes_read: int = _doc("stored bytes read", default=0)
    kv_bytes: int = _doc("KV bytes restored", default=0)
    seconds: float = _doc("seconds the fetch took", default=0.0)
    objects: list[tuple[int, int, int]] | None = _doc(
        "engine-decode buffers: each loaded chunk's verified stored object in the buffer's memory, as [first token, byte offset, "
        "size], in token order (the engine decodes them). When fewer of the plan's chunks fit the buffer, the fetch stops after "
        "those with no `reason`: fetch again from `first_token` = `loaded_tokens`", default=None)
