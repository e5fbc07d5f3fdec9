"""The harness on the shipped model: a lossless preset changes nothing, a coarse one is seen."""

import pytest

from kvfetcher.codec.base import CodecParams
from kvfetcher.codec.params import LayoutParams
from kvfetcher.eval import accuracy
from kvfetcher.format.presets import Preset

pytestmark = pytest.mark.slow

#: 3 bits per value, per channel: far coarser than any shipped preset
COARSE = Preset("coarse", LayoutParams(mode="quant", bits=3, planes=3), CodecParams(format="hevc", lossless=True), False, "test only")


@pytest.fixture(scope="module")
def reports(lm):
    cases = accuracy.suite_cases(lm, tokens=128, cont=64, per_genre=1)[:2]
    contexts = accuracy.retrieval_contexts(lm, 256, 1)
    codecs = {"exact": accuracy.preset_codec(lm, "exact", 128), "coarse": accuracy.preset_codec(lm, COARSE, 128)}
    return {n: r.summary() for n, r in accuracy.run(lm, codecs, cases, 8, contexts).items()}


def test_exact_reproduces_the_reference(reports):
    s = reports["exact"]
    assert s["bit_exact"] and s["tf_top1"] == 1.0 and s["kl"] < 1e-9 and s["nll_increase_pct"] == 0.0
    assert s["greedy"]["agreement"] == 1.0 and s["retrieval"]["answers_changed"] == 0
    assert s["retrieval"]["restored_exact"] == s["retrieval"]["fp16_exact"]
    assert s["gate"]["passed"] and s["prompts"] == 2 and set(s["per_genre"]) == {"legal", "prose"}


def test_a_coarse_layout_shows_in_every_primary_figure(reports):
    e, c = reports["exact"], reports["coarse"]
    assert c["ratio_vs_fp16"] > 2 * e["ratio_vs_fp16"]
    assert c["tf_top1"] < 1.0 and c["kl"] > 1e-3 and c["nll_increase_pct"] > 0.1
    assert c["stats"]["kl"]["ci95"][0] > 0
    assert c["gate"] is None  # not a preset: no promise to judge
