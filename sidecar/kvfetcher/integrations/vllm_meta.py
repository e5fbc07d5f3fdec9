"""What the vLLM connector's two sides share: its options, the per-step metadata the scheduler
sends the workers (:class:`StepMeta`) and the report the workers send back (:class:`WorkerReport`).
Both messages cross process boundaries (pickled by vLLM): plain data only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvfetcher import config
from kvfetcher.api.client import KVClient
from kvfetcher.fetch.plan import FetchOptions, FetchPlan

MIN_TIMED_TOKENS = 256  # a step computing fewer tokens times overheads, not the prefill rate
ROLE_FIELDS = ("loads", "stores")  # the options vLLM's kv_role sets


def role(kv_transfer_config) -> dict[str, bool]:
    """What vLLM's ``kv_role`` lets the connector do, as :class:`Options` fields: ``kv_consumer``
    loads and never stores, ``kv_producer`` stores and never looks up or loads, ``kv_both`` (or
    no config) both."""
    name = getattr(kv_transfer_config, "kv_role", None) or "kv_both"
    if name not in ("kv_consumer", "kv_producer", "kv_both"):
        raise ValueError(f"kvfetcher: kv_role {name!r} is none of kv_consumer, kv_producer, kv_both")
    return {"loads": name != "kv_producer", "stores": name != "kv_consumer"}


def _presets(given: Any) -> tuple[str, ...]:
    """``presets`` of the connector's config (a comma-separated string or a list), each a known preset."""
    names = tuple(p.strip() for p in (given.split(",") if isinstance(given, str) else given) if str(p).strip())
    unknown = [p for p in names if p not in config.PRESET_NAMES]
    if unknown or not names:
        raise ValueError(f"kvfetcher: kv_connector_extra_config 'presets': unknown preset(s) {unknown or given!r}; "
                         f"known: {', '.join(config.PRESET_NAMES)}")
    return names


@dataclass(frozen=True)
class Options:
    """``kv_connector_extra_config``; unset keys fall back to the sidecar client's settings."""

    socket: str | None = None  # the sidecar's Unix socket (default KVFETCHER_SOCKET); needed for host staging
    url: str | None = None  # or its URL (default KVFETCHER_URL), with KVFETCHER_AUTH_TOKEN
    # either may name ``{rank}``: one sidecar per tensor-parallel rank (default: one serves them all)
    model: str = ""  # model fingerprint (default KVFETCHER_MODEL, else vLLM's model name)
    presets: tuple[str, ...] | None = None  # presets a fetch may use (default: the sidecar's allowed ones)
    ttft_budget_s: float | None = None  # prefer a fetch predicted within this to a faster recompute
    recompute_tokens_per_s: float | None = None  # the prefill rate until the engine's own prefill model is fitted
    # the scheduler's wait for a plan in one step (then vLLM asks again at its next step): one GIL switch interval, as the lookup
    # thread in the engine's process may wait that long for the GIL; an answer missed by a hair puts the request off a whole step
    lookup_wait_s: float = 0.005
    listing_wait_s: float = 0.005  # the sidecar's wait for its store listing of a prefix its index does not know
    lookup_timeout_s: float = 0.02  # a request waits at least this for its plan before it recomputes (while recent plans loaded)
    lookup_stake: float = 0.02  # and up to this fraction of its predicted recompute (a long prompt's plan is worth a wait)
    fetch_deadline_s: float | None = None  # a fetch's deadline (default: the sidecar's KVFETCHER_DEADLINE_S)
    # host staging (a CPU cache, or a GPU the sidecar cannot open): token slots of the buffer KV goes through, in windows
    staging_tokens: int = 8192
    # a step that computed nothing while loads run waits this long at most for one to land (0: never), since vLLM's engine
    # steps without pause while a request waits for its KV; a new request is admitted at most this much later
    idle_step_wait_s: float = 0.002
    # who restores a load on a GPU: None where the sidecar cannot open the GPU the engine does (engine-decode), else the sidecar
    # (direct); true: the engine also where the sidecar could (in the engine's own CUDA context); false: never the engine (staging)
    engine_decode: bool | None = None
    # engine-decode on a GPU: processes of the engine's own that restore its loads (each a GIL and a CUDA context, ~0.5 GiB of the
    # GPU); 0: the engine's thread restores them, beside vLLM's loop (slower: integrations.restore_procs)
    engine_procs: int = 2
    # from vLLM's kv_role, not kv_connector_extra_config: kv_consumer loads only, kv_producer stores only, kv_both both
    loads: bool = True
    stores: bool = True

    @classmethod
    def parse(cls, extra: dict[str, Any], vllm_config=None) -> "Options":
        known = {f.name: f for f in dataclasses.fields(cls) if f.name not in ROLE_FIELDS}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"kvfetcher: unknown kv_connector_extra_config key(s) {unknown}; known: {sorted(known)}")
        kw = dict(extra)
        if "presets" in kw:
            kw["presets"] = _presets(kw["presets"])
        for name in ("ttft_budget_s", "recompute_tokens_per_s", "lookup_wait_s", "listing_wait_s", "lookup_timeout_s", "lookup_stake", "fetch_deadline_s"):
            if kw.get(name) is not None:
                try:
                    kw[name] = float(kw[name])
                except (TypeError, ValueError):
                    kw[name] = float("nan")
                if not 0 < kw[name] < float("inf"):
                    raise ValueError(f"kvfetcher: kv_connector_extra_config {name!r} must be positive seconds or "
                                     f"tokens/s, not {extra[name]!r}")
        if "idle_step_wait_s" in kw:
            w = kw["idle_step_wait_s"]
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 1:
                raise ValueError(f"kvfetcher: idle_step_wait_s must be seconds from 0 to 1, not {w!r}")
        if kw.get("engine_decode") is not None and not isinstance(kw["engine_decode"], bool):
            raise ValueError(f"kvfetcher: engine_decode must be true, false or null, not {kw['engine_decode']!r}")
        if "engine_procs" in kw:
            n = kw["engine_procs"]
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 16:
                raise ValueError(f"kvfetcher: engine_procs must be an integer from 0 to 16, not {n!r}")
        if "staging_tokens" in kw:
            n = kw["staging_tokens"]
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"kvfetcher: staging_tokens must be a positive integer, not {n!r}")
        kw.setdefault("model", config.MODEL.read() or (vllm_config.model_config.model if vllm_config else ""))
        if kw.get("ttft_budget_s") is None:
            kw["ttft_budget_s"] = config.TTFT_BUDGET_S.read()
        return cls(**kw, **role(getattr(vllm_config, "kv_transfer_config", None)))

    def client(self, timeout_s: float = 60.0, rank: int = 0) -> KVClient:
        """A client of tensor-parallel rank ``rank``'s sidecar."""
        socket = self.socket or (None if self.url else config.SOCKET.read())
        if socket:
            return KVClient(socket_path=socket.replace("{rank}", str(rank)), timeout_s=timeout_s)
        return KVClient((self.url or config.URL.read()).replace("{rank}", str(rank)), timeout_s=timeout_s)


@dataclass
class FetchSpec:
    """Fetch the plan's chunks of ``tokens`` and write tokens ``first .. end`` into ``block_ids``
    (the request's whole block table, indexed from token 0). ``plans[r]`` is tensor-parallel rank
    ``r``'s plan (made for exactly ``tokens``); a rank without one, or whose plan chose no preset,
    looks up at fetch with ``lookup``: the options of the request's own lookup (its presets and budget)."""

    req_id: str
    tokens: list[int]
    plans: tuple[FetchPlan | None, ...]
    first: int
    end: int
    block_ids: list[int]
    lookup: FetchOptions


@dataclass
class StoreSpec:
    """Store ``tokens`` (whole chunks of a finished prefill), whose KV is in ``block_ids``, from
    ``first_token`` on (whole chunks: those before it are stored already, and never copied out)."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    chunk_tokens: int = 0  # the sidecar's chunk size (the scheduler's client learnt it): a staged store's windows are whole chunks
    first_token: int = 0


@dataclass
class StepMeta(KVConnectorMetadata):
    fetches: list[FetchSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    step_tokens: int = 0  # tokens the engine computes in this step (for the prefill model)
    preempted: set[str] = field(default_factory=set)
    step_attention: float = 0.0  # and their attention term (:func:`kvfetcher.fetch.prefill.terms`)


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Chunks the sidecar took per request (queued or already stored), timed steps ``(tokens,
    attention, seconds)``, and per request the ``(start, end)`` of its fetch (``time.perf_counter``,
    one clock for every process of the host); over tensor-parallel workers the least stored and the
    earliest start and latest end."""

    stored_chunks: dict[str, int] = field(default_factory=dict)
    steps: list[tuple[int, float, float]] = field(default_factory=list)
    fetched: dict[str, tuple[float, float]] = field(default_factory=dict)

    def aggregate(self, other: "WorkerReport") -> "WorkerReport":
        stored = {r: min(n, other.stored_chunks[r]) for r, n in self.stored_chunks.items() if r in other.stored_chunks}
        fetched = dict(other.fetched)
        for r, (a, b) in self.fetched.items():
            fetched[r] = (min(a, fetched[r][0]), max(b, fetched[r][1])) if r in fetched else (a, b)
        return WorkerReport(stored, self.steps + other.steps, fetched)
