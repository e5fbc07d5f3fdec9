"""The prefill model: its contract, and a fit that recovers the engine's coefficients from timed steps."""

import numpy as np
import pytest

from kvfetcher.fetch.prefill import PrefillFit, PrefillModel, terms

TRUE = PrefillModel(c0=0.004, c1=5e-5, c2=3e-9)


def _step(rng, model: PrefillModel, noise: float) -> tuple[int, float, float]:
    """A step computing for 1-4 requests, each a prefill chunk after some cached tokens or a decode."""
    work = [(int(rng.integers(0, 16384)), int(rng.choice([1, rng.integers(256, 8192)]))) for _ in range(rng.integers(1, 5))]
    tokens, attention = terms(work)
    seconds = model.c0 + model.c1 * tokens + model.c2 * attention
    return tokens, attention, seconds * (1 + noise * rng.standard_normal())


def test_the_model_is_superlinear_and_splits_of_a_prefix_differ_exactly():
    assert TRUE.seconds(0, 8192) > 2 * TRUE.seconds(0, 4096)  # attention: twice the tokens cost more than twice
    assert TRUE.seconds(4096, 4096) + TRUE.seconds(0, 4096) == pytest.approx(TRUE.seconds(0, 8192) + TRUE.c0)
    T, n = 8192, 3000  # recomputing tokens n..T costs c1 (T - n) + c2 (T² - n²) / 2 beyond c0
    assert TRUE.seconds(n, T - n) - TRUE.c0 == pytest.approx(TRUE.c1 * (T - n) + TRUE.c2 * (T * T - n * n) / 2)
    assert PrefillModel.linear(1000.0).seconds(123, 500) == pytest.approx(0.5)
    assert terms([(100, 10), (0, 1)]) == (11, 10 * 105 + 0.5)


@pytest.mark.parametrize("bad", [dict(c1=-1e-5), dict(), dict(c1=float("nan")), dict(c2=float("inf"))])
def test_a_model_is_non_negative_finite_and_not_zero(bad):
    with pytest.raises(ValueError):
        PrefillModel(**bad)


def test_the_fit_recovers_known_coefficients_from_noisy_steps():
    rng = np.random.default_rng(0)
    fit = PrefillFit()
    assert fit.model() is None  # nothing seen: the sidecar takes its constant rate
    for _ in range(400):
        fit.observe(*_step(rng, TRUE, noise=0.03))
    m = fit.model()
    assert m.c1 == pytest.approx(TRUE.c1, rel=0.1) and m.c2 == pytest.approx(TRUE.c2, rel=0.1)
    assert m.c0 == pytest.approx(TRUE.c0, abs=0.004)
    for cached, new in [(0, 4096), (0, 32768), (16384, 16384)]:  # and it predicts, beyond the contexts it saw too
        assert m.seconds(cached, new) == pytest.approx(TRUE.seconds(cached, new), rel=0.05)


def test_the_fit_forgets_an_engine_that_changed():
    rng = np.random.default_rng(1)
    fit = PrefillFit(decay=0.05)
    for _ in range(200):
        fit.observe(*_step(rng, PrefillModel(c1=1e-3), noise=0.0))
    for _ in range(300):
        fit.observe(*_step(rng, TRUE, noise=0.0))
    assert fit.model().seconds(0, 8192) == pytest.approx(TRUE.seconds(0, 8192), rel=0.02)


def test_steps_of_one_shape_give_a_constant_rate_and_the_fit_never_goes_negative():
    fit = PrefillFit()
    for _ in range(5):
        fit.observe(2048, 2048 * 1024, 0.5)
    m = fit.model()  # nothing tells the terms apart: the old constant tokens/s
    assert (m.c0, m.c2) == (0, 0) and m.c1 == pytest.approx(0.5 / 2048)
    rng = np.random.default_rng(2)
    fit = PrefillFit()
    for _ in range(200):  # a fixed cost and a rate, no attention: the noise must not make a term negative
        tokens = int(rng.integers(256, 4096))
        fit.observe(tokens, tokens * tokens / 2, (0.02 + 1e-4 * tokens) * (1 + 0.05 * rng.standard_normal()))
    m = fit.model()
    assert min(m.c0, m.c1, m.c2) >= 0 and m.seconds(0, 2048) == pytest.approx(0.02 + 1e-4 * 2048, rel=0.05)


def test_a_few_steps_of_similar_size_give_a_rate_not_a_fixed_cost():
    """Steps of nearly one size whose times barely differ (noise): a large fixed cost and a tiny rate
    would explain them best, and would make every fetch look useless (the fixed cost is paid
    whatever is loaded)."""
    fit = PrefillFit(decay=0.0)
    steps = [(600, 1.05), (600, 1.03), (520, 1.0)]
    for tokens, seconds in steps:
        fit.observe(tokens, tokens * tokens / 2, seconds)
    m = fit.model()
    assert (m.c0, m.c2) == (0, 0)
    assert m.c1 == pytest.approx(sum(t * s for t, s in steps) / sum(t * t for t, _ in steps))  # seconds per token, through 0


def test_a_step_without_tokens_or_time_teaches_nothing():
    fit = PrefillFit()
    fit.observe(0, 0.0, 1.0)
    fit.observe(512, 512 * 256, 0.0)
    fit.observe(512, 512 * 256, float("nan"))
    assert fit.model() is None


def test_the_wall_scale_learns_how_much_longer_whole_prefills_take_than_the_gpu_model():
    """Whole prefills by the wall clock 20% longer than the GPU-step model predicts: the scaled model
    predicts them; nothing seen yet or no model leaves it as it is; the scale stays within bounds."""
    from kvfetcher.fetch.prefill import PrefillModel, WallScale

    gpu = PrefillModel(c0=0.01, c1=2e-5, c2=1e-10)
    w = WallScale()
    assert w.scale == 1.0 and w.apply(gpu) == gpu and w.apply(None) is None
    for new in (4096, 8192, 16384, 32768, 8192):
        w.observe(gpu.seconds(0, new), 1.2 * gpu.seconds(0, new))
    assert abs(w.scale - 1.2) < 1e-9
    assert abs(w.apply(gpu).seconds(0, 20000) - 1.2 * gpu.seconds(0, 20000)) < 1e-12
    w.observe(1.0, 100.0)
    assert w.scale == WallScale.HIGH


def test_the_wall_scales_error_is_how_far_the_scaled_model_was_off_each_prefill_after_the_first():
    """The first prefill sets the scale and says nothing of the error; then each prefill off the scaled
    model by a share of its time adds that share to a decayed mean, so a young fit's misses fade as it settles."""
    from kvfetcher.fetch.prefill import WallScale

    w = WallScale(decay=0.5)
    assert w.error == 0.0
    w.observe(1.0, 1.0)
    assert w.error == 0.0 and w.scale == 1.0
    w.observe(1.0, 0.8)  # predicted 1.0 by the scale of 1: off by 0.2 of 0.8
    assert abs(w.error - 0.25) < 1e-12
    for _ in range(40):
        w.observe(1.0, w.scale)  # the model as scaled is right from now on
    assert w.error < 1e-6
    w.observe(0.0, 1.0)  # no prediction: not an observation
    w.observe(1.0, float("nan"))
    assert w.error < 1e-6


def test_the_load_overhead_is_the_prior_until_a_load_is_timed_then_the_decayed_excess_over_the_plans():
    from kvfetcher.fetch.prefill import LoadOverhead

    o = LoadOverhead(prior_s=0.03)
    assert o.seconds == 0.03
    o.observe(0.2, 0.25)
    assert abs(o.seconds - 0.05) < 1e-12  # the first load replaces the prior
    for _ in range(40):
        o.observe(1.0, 1.08)
    assert abs(o.seconds - 0.08) < 1e-3  # the latest loads dominate
    for _ in range(40):
        o.observe(1.0, 0.9)  # loads faster than planned: no overhead, never a bonus
    assert o.seconds == 0.0
    o.observe(0.0, 1.0)  # no prediction: nothing learnt
    o.observe(1.0, float("nan"))
    assert o.seconds == 0.0
    with pytest.raises(ValueError):
        LoadOverhead(prior_s=-0.01)
