"""The fleet replay on the trace's first 250 requests: its shares against a direct count, its
evictor's invariant (no prefix with a hole), its TTFT against recompute, and its report files."""

import json

import pytest

from benchmarks.fleet import replay

from kvtest import REPO

TRACE = REPO / "tests" / "data" / "fleet" / "conversation_head.jsonl"
REQUESTS = replay.load_trace(TRACE)
RUN = dict(gpu=replay.prefill_model(), link_Bps=100e9 / 8, restore_Bps={"raw": 11.9e9, "ans": 40e9})


def _reusable_share(requests) -> float:
    """Tokens a store that never forgets would serve: the leading run of blocks seen before."""
    seen, served = set(), 0
    for r in requests:
        k = 0
        while k < len(r.blocks) and r.blocks[k] in seen:
            k += 1
        served += min(k * replay.BLOCK_TOKENS, r.tokens)
        seen.update(r.blocks)
    return served / sum(r.tokens for r in requests)


def test_an_unbounded_store_serves_every_reusable_token_and_an_empty_one_none():
    share = _reusable_share(REQUESTS)
    assert share > 0.05
    for evictor in replay.EVICTORS:
        assert replay.replay(REQUESTS, "raw", float("inf"), evictor, **RUN)["served_share"] == pytest.approx(share)
        assert replay.replay(REQUESTS, "raw", 0, evictor, **RUN)["served_share"] == 0


def test_the_projects_evictor_never_leaves_a_hole_and_keeps_its_budget():
    budget = 400 * replay.BLOCK_KV
    store = replay.TreeStore(budget, replay.BLOCK_KV)
    for r in REQUESTS:
        hit = 0
        while hit < len(r.blocks) and r.blocks[hit] in store:
            hit += 1
        store.use(r.blocks, hit, r.t)
        store.enforce(r.t)
        assert store.index.total <= budget
        assert all(b.parent is None or b.parent in store for b in store.index.blocks.values())
    assert store.evicted > 0


def test_coding_serves_more_from_the_same_budget_and_ttft_never_exceeds_recompute():
    budget = 1600 * replay.BLOCK_KV  # the slice holds 6,585 distinct blocks
    raw, coded, both = (replay.replay(REQUESTS, p, budget, "kvfetcher", **RUN) for p in ("raw", "balanced-ans", "raw+balanced-ans"))
    assert both["served_share"] <= raw["served_share"] < coded["served_share"]  # raw+coded costs more room a block
    for row in (raw, coded, both):
        assert row["ttft_mean_s"] < row["recompute_ttft_mean_s"]
        assert row["ttft_p90_s"] <= max(replay.prefill_model().prefill_seconds(replay.costmodel.LLAMA3_8B, r.tokens) for r in REQUESTS)
    assert raw["encoded_GBps"] == 0 and coded["encoded_GBps"] > 0 and coded["ans_gpus"] < coded["x265_cores"]
    assert set(both["choices"]) <= {"raw", "balanced-ans", "recompute"}


def test_the_command_writes_its_json_and_table(tmp_path, capsys):
    assert replay.main(["--trace", str(TRACE), "--budgets-gb", "2,4", "--policies", "raw,balanced-ans", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "result_cpu.json").read_text())
    assert result["requests"] == 250 and len(result["rows"]) == 2 * 2 * 2
    assert result["reusable_share_unbounded"] == pytest.approx(_reusable_share(REQUESTS))
    table = (tmp_path / "result_cpu.md").read_text()
    assert "| `raw` |" in table and "| `balanced-ans` |" in table


def test_the_replays_presets_are_the_projects():
    from kvfetcher.format.presets import PRESETS

    real = [p for p in replay.RATIO if p in PRESETS]
    assert {"raw", "balanced-ans", "compact-ans"} <= set(real)
    assert all(replay.FORMATS[p] == PRESETS[p].codec.format for p in real)
