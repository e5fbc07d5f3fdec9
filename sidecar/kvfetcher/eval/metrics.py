"""metrics: how far a restored cache moves the model's predictions, and robust aggregation.

Every comparison is between two sets of logits for the same positions: the reference (the fp16
cache a server holds) and the test (the cache restored through a preset). Logits are ``[n, vocab]``.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence

import torch

#: A greedy step whose reference top-2 logits are closer than this is a near-tie: any perturbation
#: may flip it, so a greedy divergence there says little about the cache.
NEAR_TIE_MARGIN = 0.5


def kl(ref: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """Per position KL(P_ref || P_test) in nats, ``[n]``."""
    lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(test.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).clamp_min(0).float()


def top1_agreement(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Fraction of positions where both logits rank the same token first."""
    return float((ref.argmax(-1) == test.argmax(-1)).float().mean())


def nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean negative log-likelihood (nats) of ``targets`` ``[n]`` under ``logits``."""
    logp = torch.log_softmax(logits.double(), -1)
    return float(-logp.gather(1, targets.view(-1, 1)).mean())


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
