"""group: the sidecars of one tensor-parallel group, asked together — every rank fetches a prompt, or none.

One sidecar per GPU: rank ``r``'s sidecar stores and fetches rank ``r``'s shard of the KV (its
heads) under its own namespace. :class:`RankGroup` holds one :class:`KVClient` per rank, asks all
of them at once, and turns their answers into the group's with :mod:`kvfetcher.fetch.group`:

* :meth:`RankGroup.lookup` (the scheduler's question, e.g. from rank 0's connector) looks the prompt up
  on every rank with ``group_size`` = the group's size, so each sidecar prices its fetch with the node's
  link shared by all ranks; the ranks' plans become one :class:`GroupPlan` (common preset, common
  leading run, or recompute), asking the ranks a second time only when they disagree.
* :meth:`RankGroup.fetch` fetches every rank's shard with its plan at once and answers with what every
  rank loaded; any rank short (failed, killed, corrupt shard) is every rank's shortfall.

An engine whose ranks live in separate processes may instead look up here and hand each worker its
``GroupPlan.plans[rank]`` (to fetch the first ``GroupPlan.tokens`` tokens with its own client), then
combine the workers' replies with :func:`kvfetcher.fetch.group.settle`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from kvfetcher.api.client import KVClient
from kvfetcher.fetch import group
from kvfetcher.fetch.group import GroupFetch, GroupPlan
from kvfetcher.fetch.plan import FetchOptions

__all__ = ["RankGroup", "GroupPlan", "GroupFetch"]


class RankGroup:
    """Rank ``r``'s sidecar at ``clients[r]``; each call asks all ranks in parallel."""

    def __init__(self, clients: Sequence[KVClient]):
        if not clients:
            raise ValueError("a group needs at least one rank's client")
        self.clients = list(clients)
        self._pool = ThreadPoolExecutor(len(self.clients), thread_name_prefix="kvf-rank")

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for c in self.clients:
            c.close()

    def __enter__(self) -> "RankGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _each(self, call: Callable[[int, KVClient], object]) -> list:
        """``call(rank, client)`` for every rank at once; an exception is that rank's answer."""
        futures = [self._pool.submit(call, r, c) for r, c in enumerate(self.clients)]
        answers = []
        for f in futures:
            try:
                answers.append(f.result())
            except Exception as e:  # unreachable, timed out or refused: the group recomputes
                answers.append(e)
        return answers

    def lookup(self, tokens: Sequence[int], buffers: Sequence[str] | None = None, options: FetchOptions | None = None, **ns) -> GroupPlan:
        """The group's plan for ``tokens``. Name each rank's namespace by its registered buffer
        (``buffers[r]``) or, a scheduler without buffers, by ``model``, ``dtype`` and ``kv_shape``
        (one rank's geometry; rank ``r`` plans for ``tp_rank=r``). ``options`` as in
        :meth:`KVClient.lookup`, with the group's size (``presets`` is narrowed to the common preset if
        the ranks are asked again)."""
        tokens = list(tokens)
        base = replace(options or FetchOptions(), group_size=len(self.clients))

        def ask(prefix: list[int], o: FetchOptions) -> list:
            return self._each(lambda r, c: c.lookup(buffers[r], prefix, o) if buffers else c.lookup(None, prefix, o, tp_rank=r, **ns))

        got = group.agree(ask(tokens, base))
        if isinstance(got, group.Retry):
            got = group.agree(ask(tokens[: got.tokens], replace(base, presets=(got.preset,))), retry=got)
        return got

    def fetch(self, plan: GroupPlan, tokens: Sequence[int], buffers: Sequence[str], *, offset: int = 0,
              slots: Sequence[int] | None = None, options: FetchOptions | None = None) -> GroupFetch:
        """Fetch ``plan`` (from :meth:`lookup`, for these ``tokens``) into every rank's buffer at once,
        token ``i`` at slot ``offset + i`` (or ``slots[i]``) of each. When this returns, the leading
        ``loaded_tokens`` are in every rank's buffer; every rank recomputes ``not_loaded``.
        ``options``: a fetch's deadline, and how a rank looks up at its fetch (a plan made without buffers)."""
        if len(buffers) != len(self.clients):
            raise ValueError(f"{len(buffers)} buffers for {len(self.clients)} ranks")
        if not plan.plans or plan.loaded_tokens == 0:
            return group.settle(plan, [])
        prefix = list(tokens[: plan.tokens])
        cut = list(slots[: plan.tokens]) if slots is not None else None
        o = options or FetchOptions()

        def fetch(r: int, c: KVClient):
            p = plan.plans[r]
            own = FetchOptions(deadline_s=o.deadline_s) if p is not None and p.preset is not None else replace(o, group_size=len(self.clients))
            return c.fetch(buffers[r], prefix, p, offset=offset, slots=cut, options=own)

        return group.settle(plan, self._each(fetch))
