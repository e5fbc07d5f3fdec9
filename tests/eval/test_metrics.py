"""The accuracy metrics on tiny synthetic logits whose answers are known."""

import math

import pytest
import torch

from kvfetcher.eval import metrics


def test_kl_of_identical_logits_is_zero_and_of_known_distributions_is_exact():
    a = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]])
    assert torch.allclose(metrics.kl(a, a), torch.zeros(2), atol=1e-7)
    # P = (1/2, 1/2), Q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3)
    p, q = torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, math.log(3.0)]])
    assert metrics.kl(p, q).item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), abs=1e-6)
    # a shift of every logit by a constant is the same distribution
    assert metrics.kl(a, a + 7).abs().max().item() < 1e-6


def test_top1_agreement_counts_positions_with_the_same_argmax():
    ref = torch.tensor([[3.0, 1.0], [1.0, 3.0], [0.0, 2.0], [5.0, 4.0]])
    test = torch.tensor([[2.0, 1.9], [3.0, 1.0], [0.0, 2.0], [4.0, 5.0]])
    assert metrics.top1_agreement(ref, test) == 0.5


def test_nll_of_uniform_logits_is_log_vocab():
    logits = torch.zeros(4, 8)
    assert metrics.nll(logits, torch.tensor([0, 3, 5, 7])) == pytest.approx(math.log(8))


def test_compare_gives_exactly_what_the_separate_metrics_give():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(6, 50, generator=g) * 3
    test, targets = ref + 0.3 * torch.randn(6, 50, generator=g), torch.randint(0, 50, (6,), generator=g)
    m = metrics.compare(ref, test, targets)
    assert torch.equal(m.kl, metrics.kl(ref, test)) and m.top1 == metrics.top1_agreement(ref, test)
    assert (m.nll_ref, m.nll_test) == (metrics.nll(ref, targets), metrics.nll(test, targets))
    assert m.nll_increase_pct == 100 * (m.nll_test - m.nll_ref) / m.nll_ref and m.kl.min() > 0


def test_near_ties_count_steps_under_the_margin():
    logits = torch.tensor([[1.0, 0.9, -2.0], [4.0, 1.0, 0.0], [2.0, 2.0, 0.0]])
    m = metrics.margins(logits)
    assert torch.allclose(m, torch.tensor([0.1, 3.0, 0.0]))
    assert metrics.near_ties(m.tolist(), 0.5) == 2
    assert metrics.near_ties(m.tolist(), 0.05) == 1


def test_greedy_agreement_and_first_divergence():
    assert metrics.greedy_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == (1.0, 4)
    assert metrics.greedy_agreement([1, 2, 3, 4], [1, 9, 3, 4]) == (0.75, 1)


def test_bootstrap_interval_holds_the_median_and_narrows_with_more_prompts():
    few = [0.9, 0.95, 1.0, 0.97, 0.99]
    many = few * 20
    lo, hi = metrics.bootstrap_ci(few)
    assert lo <= 0.97 <= hi
    lo2, hi2 = metrics.bootstrap_ci(many)
    assert hi2 - lo2 < hi - lo
    agg = metrics.aggregate(few)
    assert agg["median"] == 0.97 and agg["n"] == 5 and agg["ci95"] == [lo, hi]
    with pytest.raises(ValueError):
        metrics.bootstrap_ci([])


def test_one_bad_prompt_does_not_move_the_median():
    vals = [0.99] * 23 + [0.1]
    assert metrics.aggregate(vals)["median"] == 0.99
