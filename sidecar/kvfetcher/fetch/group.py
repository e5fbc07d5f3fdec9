"""group: one prompt across the sidecars of a tensor-parallel group: every rank fetches it, or none does.

Under tensor parallelism each rank's KV buffer holds its own KV heads, and each rank's sidecar
stores and fetches that shard under its own namespace (``keys.Namespace.tp_rank``). A prefix is
usable only where *every* rank has its shard: the ranks recompute together (every layer's
all-reduce needs all of them), so one rank's shortfall is every rank's. This module decides what
the group does from the ranks' own answers and does no I/O: :class:`kvfetcher.api.group.RankGroup`
asks the sidecars through their clients; an engine's connector may carry the answers its own way.

Planning (:func:`agree`), from every rank's plan of the same prompt:

* a rank that did not answer, or whose plan failed (store down, deadline), makes the group recompute;
* plans that agree on preset and chunk count are the group's plan as they are (the usual case:
  shards of one geometry, stored together, priced with similar rates);
* a rank whose own plan recomputes makes the group recompute: its cost model, which alone knows
  the request's TTFT budget, refused a load of a run at least as long as the group's;
* otherwise the group takes the stored preset whose slowest rank is predicted fastest, over the
  shortest leading run among the ranks, and asks every rank once more for exactly that
  (:class:`Retry`: the prompt's first ``tokens`` tokens, that preset only); each rank then weighs
  that load against recompute as it weighs any, budget included (the group itself never prices
  recompute: it would do so without the budget). A plan is sealed by its sidecar, so the group
  never edits one: it only asks again. Plans that still disagree make the group recompute.

Fetching (:func:`settle`): every rank fetches its own plan; the group holds what *every* rank loaded,
the least of the ranks' loaded tokens. The rest is recomputed on all ranks, whatever the others
wrote: a rank that failed, was killed or met a corrupt shard makes every rank treat its shortfall
as a fetch error. (vLLM does the same with each worker's ``get_block_ids_with_load_errors``: its
scheduler unions the invalid blocks of all workers.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvfetcher.errors import Reason
from kvfetcher.fetch.choice import RECOMPUTE
from kvfetcher.fetch.plan import FetchPlan, FetchReply

DECISIONS = (Reason.MISS, Reason.COST_MODEL)  # reasons to fetch less that are not failures


@dataclass(frozen=True)
class Retry:
    """Ask every rank again for the first ``tokens`` tokens of the prompt, with ``preset`` only."""

    tokens: int
    preset: str
    requested_tokens: int  # the whole prompt's, in whole chunks


@dataclass(frozen=True)
class GroupPlan:
    """What the group fetches: rank ``r`` fetches the first ``tokens`` prompt tokens with ``plans[r]``."""

    plans: tuple[FetchPlan | None, ...]  # per rank; () when the group recomputes; None: that rank plans at fetch
    tokens: int  # leading prompt tokens each rank's fetch is given (its plan was made for them)
    requested_tokens: int  # the whole prompt's, in whole chunks
    hit_tokens: int  # leading tokens every rank found stored
    loaded_tokens: int  # tokens every rank's plan fetches (for plans that chose no preset: the common hit)
    preset: str | None  # the common preset, `recompute`, or None: each rank chooses at fetch
    predicted_s: float  # the slowest rank's predicted fetch
    reason: str | None = None  # why fewer than requested: a decision (`miss`, `cost_model`) or a failure
    detail: str | None = None
    rank: int | None = None  # the rank whose answer decided ``reason``

    @property
    def error(self) -> str | None:
        return self.reason if self.reason not in (None, *DECISIONS) else None


@dataclass(frozen=True)
class GroupFetch:
    """What the group loaded: the leading ``loaded_tokens`` are in every rank's buffer; recompute the rest."""

    requested_tokens: int
    loaded_tokens: int
    not_loaded: tuple[int, int]  # [start, end) of the prompt's tokens every rank recomputes
    reason: str | None
    detail: str | None
    rank: int | None  # the rank whose answer decided ``reason``
    replies: tuple[FetchReply | None, ...]  # per rank (None: no answer)

    @property
    def error(self) -> str | None:
        return self.reason if self.reason not in (None, *DECISIONS) else None


def _failure(answer) -> tuple[str, str] | None:
    """(reason, detail) when a rank's answer is an exception or a failed plan or fetch."""
    if isinstance(answer, BaseException):
        return str(getattr(answer, "reason", None) or Reason.SIDECAR_DOWN), f"{type(answer).__name__}: {answer}"
    return (answer.error, answer.detail or "") if answer.error else None


def _recompute(requested: int, reason: str, detail: str, rank: int | None = None, hit: int = 0) -> GroupPlan:
    return GroupPlan((), 0, requested, hit, 0, RECOMPUTE, 0.0, str(reason), detail, rank)


def agree(answers: Sequence[FetchPlan | BaseException], retry: Retry | None = None) -> GroupPlan | Retry:
    """The group's plan from rank ``r``'s plan (or the exception asking it raised) at ``answers[r]``;
    or a :class:`Retry` to ask every rank again. With ``retry``: the answers to that retry, and
    the last word (a disagreement is a recompute)."""
    plans = [a for a in answers if isinstance(a, FetchPlan)]
    requested = retry.requested_tokens if retry else max((p.requested_tokens for p in plans), default=0)
    for r, a in enumerate(answers):
        if failed := _failure(a):
            return _recompute(requested, failed[0], f"rank {r}: {failed[1]}", r)
    hit = min(p.hit_tokens for p in plans)
    if any(p.preset is None for p in plans):  # hit counts only (no buffer of the namespace): each rank plans at fetch
        return GroupPlan((None,) * len(plans), hit, requested, hit, hit, None, 0.0, None if hit else Reason.MISS.value)
    first = plans[0]
    if all((p.preset, len(p.chunks), p.requested_tokens) == (first.preset, len(first.chunks), first.requested_tokens) for p in plans):
        reason, detail = first.reason, first.detail
        if reason is None and first.loaded_tokens < requested:  # a retry's run: some rank lacks its shard of the rest
            reason, detail = Reason.MISS.value, f"not every rank has its shard past token {first.loaded_tokens}"
        return GroupPlan(tuple(plans), first.requested_tokens, requested, hit, first.loaded_tokens, first.preset,
                         max(p.predicted_s for p in plans), reason, detail)
    if hit == 0:
        r = next(r for r, p in enumerate(plans) if p.hit_tokens == 0)
        return _recompute(requested, Reason.MISS, f"rank {r}: nothing stored", r)
    if (r := next((r for r, p in enumerate(plans) if p.preset == RECOMPUTE), None)) is not None:
        return _recompute(requested, plans[r].reason or Reason.COST_MODEL, f"rank {r}: {plans[r].detail}", r, hit)
    if retry is not None:
        return _recompute(requested, Reason.TP_GROUP, f"the ranks chose {sorted({(p.preset, len(p.chunks)) for p in plans})}", None, hit)
    common = set.intersection(*(set(p.options) for p in plans)) - {RECOMPUTE}
    if not common:
        return _recompute(requested, Reason.TP_GROUP, "the ranks have no stored preset in common", None, hit)
    best = min(common, key=lambda o: max(p.options[o] for p in plans))
    return Retry(min(p.loaded_tokens if p.preset == best else p.hit_tokens for p in plans), best, requested)


def settle(plan: GroupPlan, answers: Sequence[FetchReply | BaseException]) -> GroupFetch:
    """What the group loaded, from rank ``r``'s fetch reply (or the exception asking it raised) at
    ``answers[r]`` (none: the group did not fetch). A rank that failed counts as having loaded nothing."""
    replies = tuple(a if isinstance(a, FetchReply) else None for a in answers)
    loaded = [a.loaded_tokens if isinstance(a, FetchReply) else 0 for a in answers]
    common = min(loaded, default=0)
    reason, detail, rank = plan.reason, plan.detail, plan.rank
    failed = [(r, f) for r, a in enumerate(answers) if (f := _failure(a))]
    if failed:
        rank, (reason, detail) = failed[0]
        detail = f"rank {rank}: {detail}"
    elif answers and common < plan.loaded_tokens:  # short without an error: take the shortest rank's word
        rank = loaded.index(common)
        reason, detail = answers[rank].reason, f"rank {rank}: {answers[rank].detail}"
    if common == plan.requested_tokens:
        reason = detail = rank = None
    return GroupFetch(plan.requested_tokens, common, (common, plan.requested_tokens), reason, detail, rank, replies)
