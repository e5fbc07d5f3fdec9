"""The cost model is pure: the cases that matter, decided from rates alone."""

from dataclasses import replace

import pytest

from kvfetcher.fetch.choice import (FASTER, NO_FIT, RECOMPUTE, REFRESH_S, Estimator, Fit, Rates, choose, decode_rate, fetch_seconds,
                                    hopeless)
from kvfetcher.fetch.prefill import PrefillModel

FORMATS = {"raw": "raw", "q8": "hevc", "exact": "hevc"}
CHUNK_KV = 10_000_000  # bytes of KV per chunk
STORED = [{"raw": 10_000_000, "q8": 5_000_000}] * 4  # four chunks, both representations


def rates(bw, decode_hevc=50e6, tps=1000.0):
    return Rates(bandwidth_Bps=bw, latency_s=0.001, decode_Bps={"raw": 5e9, "hevc": decode_hevc}, prefill=PrefillModel.linear(tps))


def test_fast_link_fetches_raw():
    d = choose(STORED, 256, CHUNK_KV, FORMATS, rates(bw=5e9))
    assert (d.preset, d.chunks, d.tokens) == ("raw", 4, 1024)
    assert d.predicted_s == pytest.approx(0.001 + 40e6 / 5e9)
    assert set(d.options) == {"raw", "q8", RECOMPUTE}


def test_slow_link_fetches_the_compressed_representation():
    d = choose(STORED, 256, CHUNK_KV, FORMATS, rates(bw=50e6, decode_hevc=200e6))
    assert d.preset == "q8"  # 20 MB at 50 MB/s beats 40 MB at 50 MB/s; decode keeps up


def test_very_slow_link_or_fast_model_recomputes():
    assert choose(STORED, 256, CHUNK_KV, FORMATS, rates(bw=1e6)).preset == RECOMPUTE
    assert choose(STORED, 256, CHUNK_KV, FORMATS, rates(bw=5e9, tps=1e9)).preset == RECOMPUTE


def test_partial_availability_counts_the_recompute_of_the_rest():
    stored = [{"raw": 10_000_000, "q8": 5_000_000}, {"raw": 10_000_000}, {"raw": 10_000_000}]
    d = choose(stored, 256, CHUNK_KV, FORMATS, rates(bw=50e6, decode_hevc=200e6, tps=200))
    # q8 covers one chunk only, the other 512 tokens would be recomputed at 200 tok/s
    assert d.options["q8"] == pytest.approx(fetch_seconds(5_000_000, CHUNK_KV, 200e6, rates(50e6, 200e6)) + 512 / 200)
    assert d.preset == "raw" and d.chunks == 3


def test_a_measured_preset_rate_beats_the_format_prior():
    r = Rates(bandwidth_Bps=1e9, latency_s=0.0, decode_Bps={"hevc": 1e8, "exact": 1e7}, prefill=PrefillModel.linear(1e3))
    stored = [{"exact": 5_000_000, "q8": 5_000_000}]
    d = choose(stored, 256, CHUNK_KV, FORMATS, r)
    assert d.preset == "q8" and d.options["exact"] == pytest.approx(CHUNK_KV / 1e7)


def test_allowed_and_unknown_presets():
    stored = [{"raw": 1, "future": 1}]
    assert choose(stored, 256, CHUNK_KV, FORMATS, rates(bw=5e9), allowed={"q8"}).preset == RECOMPUTE
    assert "future" not in choose(stored, 256, CHUNK_KV, FORMATS, rates(bw=5e9)).options
    assert choose([], 256, CHUNK_KV, FORMATS, rates(bw=5e9)).preset == RECOMPUTE


def test_estimator_learns_per_endpoint():
    e = Estimator(alpha=0.5, bandwidth_Bps=1e6)
    assert e.rates("a").bandwidth_Bps == 1e6
    e.observe_read("a", 100_000_000, 1.0)
    e.observe_read("a", 300_000_000, 1.0)
    assert e.bandwidth("a") == pytest.approx((0.5 * 100e6 + 300e6) / (0.5 + 1))  # decayed bytes over decayed seconds
    assert e.bandwidth("b") == 1e6  # another endpoint is not affected
    e.observe_decode("exact", 30_000_000, 1.0)
    r = e.rates("a")
    assert decode_rate("exact", "hevc", r) == 30e6  # measured for that preset
    assert decode_rate("q8", "hevc", r) == r.decode_Bps["hevc"] != 30e6  # the format's prior until measured
    e.observe_read("a", 0, 0.0)  # no data: no change
    assert e.bandwidth("a") == pytest.approx(350e6 / 1.5)


def test_hopeless_only_when_even_the_best_case_loses():
    ratios = {"raw": 1.0, "q8": 2.0, "exact": 0.8}
    # a fast model on a slow link: even q8 at 1.5x its ratio loses -> skip the lookup
    assert hopeless(4, 256, CHUNK_KV, ratios, FORMATS, rates(bw=1e6, tps=1e5))
    # the same case whenever choose() picks a fetch must not be called hopeless
    for bw, tps in [(5e9, 1000.0), (50e6, 1000.0), (2e8, 2e4)]:
        r = rates(bw=bw, decode_hevc=200e6, tps=tps)
        if choose(STORED, 256, CHUNK_KV, FORMATS, r).preset != RECOMPUTE:
            assert not hopeless(4, 256, CHUNK_KV, ratios, FORMATS, r)
    # only allowed presets count
    r = rates(bw=5e9, tps=1000.0)
    assert not hopeless(4, 256, CHUNK_KV, ratios, FORMATS, r)
    assert hopeless(4, 256, CHUNK_KV, ratios, FORMATS, rates(bw=1e6, tps=1000.0), allowed={"raw"})
    assert hopeless(0, 256, CHUNK_KV, ratios, FORMATS, r)


def test_hopeless_never_rules_out_a_coded_preset_of_unknown_ratio():
    """A coded preset the preset table has no ratio for (the entropy presets) may be far smaller than
    raw: taken as 1x, it would be ruled out where it is the fastest option."""
    slow = replace(rates(bw=20e6, decode_hevc=1e9), prefill=PrefillModel.linear(1000.0))  # raw: 2 s against 1.02 s of recompute
    assert hopeless(4, 256, CHUNK_KV, {"raw": 1.0, "q8": 1.0}, FORMATS, slow, allowed={"raw", "q8"})  # as q8 were 1x: ruled out
    assert not hopeless(4, 256, CHUNK_KV, {"raw": 1.0}, FORMATS, slow, allowed={"raw", "q8"})  # unknown: it may pay
    assert not hopeless(4, 256, CHUNK_KV, {"raw": 1.0}, FORMATS, replace(slow, ratios={"q8": 5.0}), allowed={"raw", "q8"})
    assert hopeless(4, 256, CHUNK_KV, {"raw": 1.0, "q8": 5.0}, FORMATS, replace(slow, ratios={"q8": 1.0}), allowed={"raw", "q8"})  # measured wins


def test_the_estimator_learns_each_presets_ratio_from_its_fetches():
    e = Estimator(alpha=0.5)
    assert e.rates("a").ratios == {}
    e.observe_fit("a", "q8", "hevc", stored_bytes=2_000_000, kv_bytes=10_000_000, actual_s=0.1)
    e.observe_fit("a", "q8", "hevc", stored_bytes=5_000_000, kv_bytes=10_000_000, actual_s=0.1)
    assert e.rates("b").ratios["q8"] == pytest.approx((0.5 * 10e6 + 10e6) / (0.5 * 2e6 + 5e6))  # decayed KV over decayed stored bytes


@pytest.mark.parametrize("gbps, expect", [(100, "raw"), (25, "raw"), (10, "q8"), (1, RECOMPUTE)])
def test_gpu_priors_pick_raw_on_fast_links_and_q8_or_recompute_on_slow_ones(gbps, expect):
    """An 8B-shaped prefix of 64 chunks (32 MiB of KV each), stored raw and as q8 (1.77x), q8's
    restore rate as measured with decode worker processes on an H200 (2.6 GB/s), raw at its prior."""
    e = Estimator(gpu=True)
    e.observe_read("s3", int(gbps * 1e9 / 8), 1.0)
    e.observe_decode("q8", int(2.6e9), 1.0)
    kv = 32 << 20
    stored = [{"raw": kv + 4096, "q8": int(kv / 1.77)}] * 64
    d = choose(stored, 256, kv, {"raw": "raw", "q8": "hevc"}, e.rates("s3", PrefillModel.linear(16384 / 4.0)))
    assert d.preset == expect, d.options


def test_a_ttft_budget_prefers_the_fetch_that_fits_to_a_faster_recompute():
    r = rates(bw=50e6, decode_hevc=200e6, tps=1e4)  # recompute 0.1 s; q8 0.4 s, raw 0.8 s
    assert choose(STORED, 256, CHUNK_KV, FORMATS, r).preset == RECOMPUTE
    d = choose(STORED, 256, CHUNK_KV, FORMATS, r, budget_s=0.5)
    assert (d.preset, d.chunks) == ("q8", 4)  # within the budget: fetched, the GPU left to the running requests
    assert choose(STORED, 256, CHUNK_KV, FORMATS, r, budget_s=1.0).preset == "q8"  # both fit: the faster
    assert choose(STORED, 256, CHUNK_KV, FORMATS, r, budget_s=0.2).preset == RECOMPUTE  # none fits: the fastest
    # a fetch that restores more of the prefix beats a faster one that leaves more to recompute
    partial = [{"raw": 10_000_000, "q8": 5_000_000}] + [{"raw": 10_000_000}] * 3
    assert choose(partial, 256, CHUNK_KV, FORMATS, r, budget_s=1.0).preset == "raw"
    # the lookup is skipped only when no fetch could fit either
    ratios = {"raw": 1.0, "q8": 2.0, "exact": 0.8}
    assert hopeless(4, 256, CHUNK_KV, ratios, FORMATS, r) and not hopeless(4, 256, CHUNK_KV, ratios, FORMATS, r, budget_s=0.5)


def test_the_fit_learns_what_the_rates_miss_and_turns_a_near_tie():
    e = Estimator(alpha=1.0, bandwidth_Bps=1e9, latency_s=0.0)
    e.observe_read("s3", 100_000_000, 0.1)  # 1 GB/s
    e.observe_decode("q8", 40_000_000, 0.1)  # 400 MB/s of KV
    r = e.rates("s3", PrefillModel.linear(1024 / 0.105))  # recompute 0.105 s; q8 modelled 0.100 s
    assert choose(STORED, 256, CHUNK_KV, FORMATS, r, allowed={"q8"}).preset == "q8"
    e.observe_fit("s3", "q8", "hevc", 20_000_000, 40_000_000, 0.120)  # its fetch took 20 ms longer than modelled
    r = e.rates("s3", PrefillModel.linear(1024 / 0.105))
    assert r.fit["q8"] == Fit(1.0, pytest.approx(0.02))  # one size: taken as fixed overhead
    d = choose(STORED, 256, CHUNK_KV, FORMATS, r, allowed={"q8"})
    assert d.preset == RECOMPUTE and d.options["q8"] == pytest.approx(0.120)
    e.observe_fit("s3", "q8", "hevc", 20_000_000, 40_000_000, 100.0)  # an outlier is bounded: 4x at its size
    assert e.rates("s3").fit["q8"].apply(0.1) == pytest.approx(0.4)


def test_the_fit_tells_fixed_overhead_from_a_slower_rate():
    """Fill and drain cost the same seconds at any size; imperfect overlap grows with the fetch.
    Seen on an H100: a 4K-token 70B fetch 0.20 s over its decode time, a 128K one 0.16 s -- as a
    ratio, the small one predicted the large one 1.54x too slow and ``auto`` fetched raw."""
    e = Estimator(alpha=0.3, bandwidth_Bps=1e9, latency_s=0.0)
    e.observe_read("s3", 100_000_000, 0.1)
    e.observe_decode("q8", 40_000_000, 0.1)  # modelled: 0.1 s per 40 MB of KV
    e.observe_fit("s3", "q8", "hevc", 20_000_000, 40_000_000, 0.1 + 0.2)
    assert e.fit("q8", "s3").apply(3.2) == pytest.approx(3.4)  # 32x the KV: the same 0.2 s, not 3x
    e.observe_fit("s3", "q8", "hevc", 200_000_000, 400_000_000, 1.2 * 1.0 + 0.2)  # sizes differ: both terms
    e.observe_fit("s3", "q8", "hevc", 100_000_000, 200_000_000, 1.2 * 0.5 + 0.2)
    f = e.fit("q8", "s3")
    assert f.scale == pytest.approx(1.2, abs=0.05) and f.overhead_s == pytest.approx(0.2, abs=0.03)


def test_hopeless_counts_the_fit():

    ratios = {"raw": 1.0, "q8": 2.0, "exact": 0.8}
    r = rates(bw=5e9, tps=1024 / 0.012)  # recompute 12 ms; raw's best case 8 ms
    assert not hopeless(4, 256, CHUNK_KV, ratios, FORMATS, r)
    assert hopeless(4, 256, CHUNK_KV, ratios, FORMATS, replace(r, fit={"raw": Fit(2.0), "q8": Fit(2.0)}))  # measured overheads count


def test_the_listing_time_is_learned_per_endpoint():
    e = Estimator(latency_s=0.002)
    e.observe_lookup("s3", 0.2, 8)
    assert e.rates("s3").list_s == pytest.approx(0.025) and e.rates("other").list_s is None


def test_each_format_reads_at_its_own_measured_rate():
    e = Estimator(alpha=1.0, bandwidth_Bps=1e8)
    e.observe_read("s3", 4_000_000_000, 1.0, "raw")  # raw's direct path read the link at 4 GB/s
    e.observe_read("s3", 1_000_000_000, 1.0, "hevc")  # a decode-bound fetch read at 1 GB/s
    r = e.rates("s3")
    assert r.bandwidth_Bps == 1e9 and r.format_bandwidth == {"raw": 4e9, "hevc": 1e9}
    assert fetch_seconds(4_000_000_000, 4_000_000_000, 1e12, r, fmt="raw") == pytest.approx(r.latency_s + 1.0)
    assert e.rates("other").format_bandwidth == {}


def test_a_link_that_got_faster_is_believed_at_once_and_noise_is_not_a_faster_link():
    """Rates learnt in a slow spell made ``auto`` recompute, so nothing read, so nothing taught: a
    read (a link probe's) that shows a much faster link drops them; a read within noise does not."""
    e = Estimator(alpha=0.3)
    for _ in range(5):  # a congested hour: raw and q8 fetches at 1 Gbit/s, 1 GB each
        e.observe_read("s3", 1_000_000_000, 8.0, "raw")
        e.observe_read("s3", 1_000_000_000, 8.0, "hevc")
    prefill = PrefillModel.linear(1024 / 0.2)  # the four chunks recompute in 0.2 s, raw reads 40 MB in 0.32
    assert choose(STORED, 256, CHUNK_KV, FORMATS, e.rates("s3", prefill)).preset == RECOMPUTE
    e.observe_read("s3", 1_000_000_000, 8.0 / (1.5 * FASTER), "raw")  # 1.5x FASTER than believed ...
    assert e.rates("s3", prefill).format_bandwidth["raw"] == pytest.approx(1e9 / (8.0 / (1.5 * FASTER)))  # ... dropped what it knew
    assert e.bandwidth("s3") == pytest.approx(1e9 / (8.0 / (1.5 * FASTER)))
    assert "hevc" not in e.rates("s3").format_bandwidth  # q8's reads too: learnt on the slower link
    assert choose(STORED, 256, CHUNK_KV, FORMATS, e.rates("s3", prefill)).preset == "raw"
    before = e.bandwidth("s3")
    e.observe_read("s3", 1_000_000_000, 1e9 / (0.9 * FASTER * before), "raw")  # faster, but less than FASTER times: a mean
    assert before < e.bandwidth("s3") < 0.9 * FASTER * before


def test_a_rate_no_read_renewed_is_stale():
    e, now = Estimator(), [0.0]
    e.clock = lambda: now[0]
    assert e.stale("s3")  # never measured
    e.observe_read("s3", 1_000_000, 1.0)
    now[0] = REFRESH_S * 0.9
    assert not e.stale("s3")
    now[0] = REFRESH_S * 1.1  # no read since: worth a probe
    assert e.stale("s3") and e.measured("s3") and e.ceiling("s3") is None
    e.observe_read("s3", 1_000_000, 1.0)
    assert not e.stale("s3")


def test_a_small_cold_fetch_does_not_hold_down_the_rate_of_large_ones():
    e = Estimator(alpha=0.3, gpu=True)
    e.observe_decode("balanced", 1_300_000_000, 3.0)  # 16 chunks while the decoders start: 0.43 GB/s
    e.observe_decode("balanced", 21_500_000_000, 5.5)  # 64K tokens warm: 3.9 GB/s
    rate = e.rates("s3").decode_Bps["balanced"]
    assert 2.9e9 < rate < 3.9e9  # an average of the two fetches' rates would say 1.5 GB/s
    e.observe_decode("balanced", 43_000_000_000, 11.0)
    assert 3.5e9 < e.rates("s3").decode_Bps["balanced"] < 3.9e9  # the average: 2.2 GB/s


def test_the_fit_is_per_endpoint_and_falls_back_to_the_preset_s():
    e = Estimator(alpha=1.0, bandwidth_Bps=1e9, latency_s=0.0)
    e.observe_read("fast", 100_000_000, 0.1)
    e.observe_decode("q8", 40_000_000, 0.1)
    e.observe_fit("fast", "q8", "hevc", 20_000_000, 40_000_000, 0.150)  # modelled 0.100 s
    assert e.fit("q8", "fast").apply(0.1) == pytest.approx(0.15)
    assert e.rates("slow").fit["q8"].apply(0.1) == pytest.approx(0.15)  # no fetch from "slow" yet: the preset's fit
    e.observe_read("slow", 10_000_000, 0.1)  # 100 MB/s: q8's 20 MB take 0.2 s
    e.observe_fit("slow", "q8", "hevc", 20_000_000, 40_000_000, 0.220)
    assert e.fit("q8", "slow").apply(0.2) == pytest.approx(0.22)
    assert e.fit("q8", "fast").apply(0.1) == pytest.approx(0.15)  # unchanged by the other endpoint
    assert e.fit("raw", "fast") == NO_FIT  # never measured


def test_a_process_first_fetch_of_each_format_does_not_teach_the_rates():
    e = Estimator()
    assert not e.settled("raw") and e.settled("raw") and e.settled("raw")  # the first pays set-up
    assert not e.settled("hevc") and e.settled("hevc")  # per format


def test_attention_makes_a_long_prefix_worth_fetching_and_a_short_one_not():
    """The engine's superlinear prefill against a constant rate that agrees with it at 4K tokens: the
    constant rate underestimates a 32K recompute (and would recompute), and overestimates a 1K one
    (and would fetch)."""
    attention = PrefillModel(c1=1e-4, c2=2e-8)
    linear = PrefillModel.linear(4096 / attention.seconds(0, 4096))

    def rates(model, bw):
        return Rates(bandwidth_Bps=bw, latency_s=0.001, decode_Bps={"raw": 5e9}, prefill=model)

    def decide(model, n_chunks, bw):
        return choose([{"raw": CHUNK_KV}] * n_chunks, 256, CHUNK_KV, {"raw": "raw"}, rates(model, bw))

    long = 128  # 32K tokens, 1.28 GB at 160 MB/s: 8 s; recompute 14 s with attention, 4.6 s without
    assert decide(attention, long, 160e6).preset == "raw" and decide(linear, long, 160e6).preset == RECOMPUTE
    # and the store is asked only where the fetch could win
    assert not hopeless(long, 256, CHUNK_KV, {"raw": 1.0}, {"raw": "raw"}, rates(attention, 160e6))
    assert hopeless(long, 256, CHUNK_KV, {"raw": 1.0}, {"raw": "raw"}, rates(linear, 160e6))
    short = 4  # 1K tokens, 40 MB at 312 MB/s: 0.129 s; recompute 0.113 s with attention, 0.144 s without
    assert decide(attention, short, 312.5e6).preset == RECOMPUTE and decide(linear, short, 312.5e6).preset == "raw"


def test_the_recomputed_tail_attends_over_the_fetched_prefix():
    model = PrefillModel(c0=0.01, c1=1e-4, c2=2e-8)
    r = Rates(bandwidth_Bps=1e9, latency_s=0.0, decode_Bps={"raw": 5e9}, prefill=model)
    stored = [{"raw": CHUNK_KV}] * 3 + [{}] * 5  # 768 of 2048 tokens stored
    d = choose(stored, 256, CHUNK_KV, {"raw": "raw"}, r)
    assert d.options["raw"] == pytest.approx(d.predicted_s + model.seconds(768, 1280))
    assert d.options[RECOMPUTE] == pytest.approx(model.seconds(0, 2048))
    full = choose([{"raw": CHUNK_KV}] * 8, 256, CHUNK_KV, {"raw": "raw"}, r)
    assert full.total_s == pytest.approx(full.predicted_s + 0.01)  # the prefill step still runs (the prompt's last token)
