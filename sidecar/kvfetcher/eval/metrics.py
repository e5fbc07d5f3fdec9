"""metrics: how far a restored cache moves the model's predictions, and robust aggregation.

Every comparison is between two sets of logits for the same positions: the reference (the fp16
cache a server holds) and the test (the cache restored through a preset). Logits are ``[n, vocab]``.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

#: A greedy step whose reference top-2 logits are closer than this is a near-tie: any perturbation
#: may flip it, so a greedy divergence there says little about the cache.
NEAR_TIE_MARGIN = 0.5


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of ``logits`` in float64 (every metric here is computed from them)."""
    return torch.log_softmax(logits.double(), -1)


def kl(ref: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """Per position KL(P_ref || P_test) in nats, ``[n]``."""
    return _kl(log_probs(ref), log_probs(test))


def _kl(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    return (lp.exp() * (lp - lq)).sum(-1).clamp_min(0).float()


def _nll(logp: torch.Tensor, targets: torch.Tensor) -> float:
    return float(-logp.gather(1, targets.view(-1, 1)).mean())


@dataclass(frozen=True)
class Comparison:
    """Test logits against the reference's for the same positions and targets."""

    kl: torch.Tensor  # per position KL(P_ref || P_test), nats, [n]
    nll_ref: float  # mean NLL of the targets under the reference
    nll_test: float  # and under the test
    top1: float  # fraction of positions ranking the same token first

    @property
    def nll_increase_pct(self) -> float:
        return 100 * (self.nll_test - self.nll_ref) / self.nll_ref


def compare(ref: torch.Tensor, test: torch.Tensor, targets: torch.Tensor) -> Comparison:
    """:func:`kl`, :func:`nll` of both and :func:`top1_agreement` of ``ref`` and ``test``: the same
    values, each matrix's log-probabilities computed once."""
    lp, lq = log_probs(ref), log_probs(test)
    return Comparison(_kl(lp, lq), _nll(lp, targets), _nll(lq, targets), top1_agreement(ref, test))


def top1_agreement(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Fraction of positions where both logits rank the same token first."""
    return float((ref.argmax(-1) == test.argmax(-1)).float().mean())


def nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean negative log-likelihood (nats) of ``targets`` ``[n]`` under ``logits``."""
    return _nll(log_probs(logits), targets)


def margins(logits: torch.Tensor) -> torch.Tensor:
    """Per position gap between the largest and second largest logit, ``[n]``."""
    top = torch.topk(logits.float(), 2, dim=-1).values
    return top[:, 0] - top[:, 1]


def near_ties(step_margins: Sequence[float], threshold: float = NEAR_TIE_MARGIN) -> int:
    """How many steps had a top-2 margin below ``threshold``."""
    return sum(1 for m in step_margins if m < threshold)


def greedy_agreement(ref: Sequence[int], test: Sequence[int]) -> tuple[float, int]:
    """(fraction of positions with the same token, index of the first difference or len)."""
    same = [a == b for a, b in zip(ref, test)]
    return sum(same) / len(same), same.index(False) if False in same else len(same)


def bootstrap_ci(values: Sequence[float], stat: Callable[[Sequence[float]], float] = statistics.median,
                 n: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of ``stat`` over ``values`` (resampled with
    replacement, a fixed seed so that a report is reproducible)."""
    if not values:
        raise ValueError("no values to aggregate")
    rng = random.Random(seed)
    k = len(values)
    stats = sorted(stat([values[rng.randrange(k)] for _ in range(k)]) for _ in range(n))
    lo = stats[int((1 - level) / 2 * (n - 1))]
    hi = stats[int((1 + level) / 2 * (n - 1))]
    return lo, hi


def aggregate(values: Sequence[float]) -> dict:
    """Median, mean and the bootstrap 95% interval of the median, over prompts."""
    lo, hi = bootstrap_ci(values)
    return {"median": statistics.median(values), "mean": statistics.fmean(values), "ci95": [lo, hi], "n": len(values)}
