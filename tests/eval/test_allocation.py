"""Step allocation: rate-distortion steps, the budget search, the rate measurement, and the tables
presets read them from."""

import math

import torch

from kvfetcher.codec.params import LayoutParams
from kvfetcher.eval import allocation
from kvfetcher.format import presets


def test_rd_steps_keep_the_rate_and_lower_the_summed_kl():
    k = torch.tensor([[4.0, 1.0], [1.0, 0.25]])  # KL per unit step squared
    slopes = torch.tensor([[1.0, 1.0], [0.5, 2.0]])  # bits per value per unit of ln step
    steps = torch.full((2, 2), 0.2)
    new = allocation.rd_steps(k, slopes, steps)
    assert math.isclose(float((slopes * new.log()).sum()), float((slopes * steps.log()).sum()), rel_tol=1e-5)
    assert float((k * new**2).sum()) < float((k * steps**2).sum())
    # at the optimum every group's KL per bit is the same: k step^2 / slope
    per_bit = k * new**2 / slopes
    assert torch.allclose(per_bit, per_bit.mean().expand_as(per_bit), rtol=1e-4)


def test_bracket_finds_the_boundary_and_stops_at_the_bounds():
    a, b = allocation.bracket(lambda m: m <= 2.7)
    assert a <= 2.7 < b and b / a < 1.11
    a, b = allocation.bracket(lambda m: m < 0.3)
    assert a < 0.3 <= b
    assert allocation.bracket(lambda m: True)[0] > 5  # everything ok: the upper bound
    assert allocation.bracket(lambda m: False)[0] < 0.2  # nothing ok: the lower bound


def test_coarser_steps_cost_fewer_bits_and_a_constant_kv_none():
    torch.manual_seed(0)
    kv = torch.randn(2, 2, 1, 256, 16).cumsum(3).half()  # smooth along tokens, as KV is
    lp = LayoutParams(mode="quant", sigma_steps=((0.1, 0.1),), trellis=True)
    coarser = LayoutParams(mode="quant", sigma_steps=presets.scaled(lp.sigma_steps, 4), trellis=True)
    fine, coarse = allocation.symbol_entropy([kv], lp), allocation.symbol_entropy([kv], coarser)
    assert (fine > coarse + 1.5).all()  # about 2 bits per value for 4x the step
    slopes = allocation.rate_slopes([kv], lp)
    assert ((slopes > 0.5) & (slopes < 2)).all()  # about 1/ln 2 bits per unit of ln step at fine steps
    flat = torch.zeros(2, 2, 1, 256, 16).half()
    assert float(allocation.symbol_entropy([flat], lp).max()) == 0.0


def test_table_for_is_the_inverse_of_sigma_steps():
    steps = [[0.05, 0.3], [0.8, 0.12]]
    for name in ("balanced", "compact"):
        _, scale, lo, hi = presets.LOSSY[name]
        back = presets.sigma_steps(scale, lo, hi, table=tuple(tuple(kv) for kv in presets.table_for(name, steps)))
        assert all(math.isclose(x, y, rel_tol=2e-3, abs_tol=1e-3) for a, b in zip(back, steps) for x, y in zip(a, b))
