"""A tensor-parallel group's decision from its ranks' answers (fetch.group), the node's link share
(fetch.linkshare) and the estimator's split of the link among the fetches sharing it."""

import asyncio
import os
import subprocess
import sys

import pytest

from kvfetcher.fetch import choice, group
from kvfetcher.fetch.linkshare import LinkShare, Share
from kvfetcher.fetch.plan import FetchPlan, FetchReply

N = 256  # tokens per chunk


def plan(hit, preset="raw", chunks=None, requested=8 * N, options=None, reason=None, rank=0, predicted=1.0):
    """A rank's plan: ``chunks`` leading chunks of ``preset`` (default: all it found)."""
    n = hit // N if chunks is None else chunks
    if preset == choice.RECOMPUTE:
        n = 0
    opts = {choice.RECOMPUTE: 10.0, "raw": 2.0, "q8": 3.0} if options is None else options
    return FetchPlan("m", "float16", rank, N, requested, "k", hit, preset, tuple((preset, 100) for _ in range(n)), predicted,
                     opts, 0.01, reason, None)


def reply(loaded, requested=8 * N, error=None):
    return FetchReply(requested, loaded, N, (loaded, requested), error, error, "detail")


# --- planning ------------------------------------------------------------------------------------


def test_agreeing_plans_are_the_groups_plan():
    g = group.agree([plan(8 * N, rank=r, predicted=1.0 + r) for r in range(4)])
    assert (g.preset, g.tokens, g.loaded_tokens, g.hit_tokens, g.reason) == ("raw", 8 * N, 8 * N, 8 * N, None)
    assert g.predicted_s == 4.0  # the slowest rank decides
    assert [p.tp_rank for p in g.plans] == [0, 1, 2, 3]


def test_one_rank_short_of_a_shard_makes_every_rank_ask_for_the_common_run():
    r = group.agree([plan(8 * N), plan(3 * N, rank=1), plan(8 * N, rank=2)])
    assert r == group.Retry(3 * N, "raw", 8 * N)
    # the ranks' answers for the first 3 chunks agree: every rank loads 3, the group recomputes the rest
    g = group.agree([plan(3 * N, requested=3 * N, rank=k) for k in range(3)], retry=r)
    assert (g.tokens, g.loaded_tokens, g.requested_tokens, g.reason) == (3 * N, 3 * N, 8 * N, "miss")


def test_the_common_preset_is_the_one_whose_slowest_rank_is_fastest():
    fast_raw = {choice.RECOMPUTE: 10.0, "raw": 1.0, "q8": 3.0}
    slow_raw = {choice.RECOMPUTE: 10.0, "raw": 5.0, "q8": 3.5}
    r = group.agree([plan(8 * N, "raw", options=fast_raw), plan(8 * N, "q8", options=slow_raw, rank=1)])
    assert r == group.Retry(8 * N, "q8", 8 * N)


def test_a_rank_predicting_recompute_faster_than_every_common_load_makes_all_recompute():
    slow = {choice.RECOMPUTE: 10.0, "raw": 30.0}
    g = group.agree([plan(8 * N), plan(8 * N, choice.RECOMPUTE, options=slow, reason="cost_model", rank=1)])
    assert (g.preset, g.plans, g.loaded_tokens, g.reason, g.error) == (choice.RECOMPUTE, (), 0, "cost_model", None)


def test_ranks_that_chose_to_load_are_asked_again_for_the_common_run_though_recompute_is_predicted_faster():
    # each rank's cost model chose its load within the request's TTFT budget, which the group does not know
    slow = {choice.RECOMPUTE: 1.0, "raw": 3.0}
    r = group.agree([plan(2 * N, options=slow), plan(N, options=slow, rank=1), plan(2 * N, options=slow, rank=2)])
    assert r == group.Retry(N, "raw", 8 * N)


def test_ranks_with_no_stored_preset_in_common_recompute():
    g = group.agree([plan(8 * N, "raw", options={choice.RECOMPUTE: 10.0, "raw": 2.0}),
                     plan(8 * N, "q8", options={choice.RECOMPUTE: 10.0, "q8": 3.0}, rank=1)])
    assert (g.preset, g.loaded_tokens, g.reason, g.hit_tokens) == (choice.RECOMPUTE, 0, "tp_group", 8 * N)


def test_a_rank_with_nothing_stored_makes_all_recompute():
    g = group.agree([plan(8 * N), plan(0, choice.RECOMPUTE, options={}, reason="miss", rank=1)])
    assert (g.preset, g.loaded_tokens, g.reason, g.rank) == (choice.RECOMPUTE, 0, "miss", 1)


@pytest.mark.parametrize("answer, reason", [(ConnectionRefusedError("no sidecar"), "sidecar_down"),
                                            (plan(0, choice.RECOMPUTE, reason="store_down"), "store_down")])
def test_a_failed_rank_makes_all_recompute(answer, reason):
    g = group.agree([plan(8 * N), answer, plan(8 * N)])
    assert (g.preset, g.plans, g.loaded_tokens, g.reason, g.error, g.rank) == (choice.RECOMPUTE, (), 0, reason, reason, 1)


def test_disagreeing_again_after_the_retry_is_a_recompute():
    r = group.Retry(4 * N, "raw", 8 * N)
    g = group.agree([plan(4 * N, requested=4 * N), plan(4 * N, chunks=2, requested=4 * N, rank=1)], retry=r)
    assert (g.preset, g.loaded_tokens, g.reason) == (choice.RECOMPUTE, 0, "tp_group")


def test_plans_without_a_buffer_give_the_common_hit_and_leave_the_choice_to_each_load():
    g = group.agree([plan(8 * N, None, chunks=0), plan(5 * N, None, chunks=0, rank=1)])
    assert (g.plans, g.tokens, g.hit_tokens, g.preset) == ((None, None), 5 * N, 5 * N, None)


# --- loading -------------------------------------------------------------------------------------


def test_the_group_holds_what_every_rank_loaded():
    g = group.agree([plan(8 * N, rank=r) for r in range(3)])
    assert group.settle(g, [reply(8 * N)] * 3).not_loaded == (8 * N, 8 * N)
    out = group.settle(g, [reply(8 * N), reply(2 * N, error="corrupt"), reply(8 * N)])
    assert (out.loaded_tokens, out.not_loaded, out.error, out.rank) == (2 * N, (2 * N, 8 * N), "corrupt", 1)
    dead = group.settle(g, [reply(8 * N), reply(8 * N), BrokenPipeError("killed")])
    assert (dead.loaded_tokens, dead.error, dead.rank, dead.replies[2]) == (0, "sidecar_down", 2, None)


def test_a_group_that_recomputes_loads_nothing():
    g = group.agree([plan(8 * N), ConnectionRefusedError()])
    out = group.settle(g, [])
    assert (out.loaded_tokens, out.not_loaded, out.error) == (0, (0, 8 * N), "sidecar_down")


# --- the node's link share -----------------------------------------------------------------------


#: a process announcing one fetch until its stdin closes (or it is killed); it says "ready" first
HOLD = """
import asyncio, sys
from kvfetcher.fetch.linkshare import LinkShare
async def main():
    async with LinkShare(sys.argv[1]).fetch():
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
asyncio.run(main())
"""


def test_announced_fetches_are_counted_across_processes_and_a_killed_ones_stop_counting(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["ready", "ready"]
        share = LinkShare(str(tmp_path))
        assert share.active() == 2
        procs[0].kill()  # its announcement file stays, its lock goes
        procs[0].wait(10)
        assert share.active() == 1
        assert len([n for n in os.listdir(tmp_path) if n.endswith(".fetch")]) == 1  # the dead one's removed
        procs[1].stdin.close()  # its fetch ends
        procs[1].wait(10)
        assert share.active() == 0 and not os.listdir(tmp_path)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_fetch_counts_itself_and_its_neighbours_in_one_process(tmp_path):
    async def main():
        a, b = LinkShare(str(tmp_path), sample_s=0.005), LinkShare(str(tmp_path))
        async with a.fetch() as alone:
            await asyncio.sleep(0.02)
        async with a.fetch() as shared, b.fetch():
            await asyncio.sleep(0.2)
        return alone.sharers, shared.sharers

    alone, shared = asyncio.run(main())
    assert alone == 1.0
    assert 1.0 < shared <= 2.0  # sampled before the neighbour announced and after it withdrew, with it between
    assert LinkShare(None).active() == 0 and Share().sharers == 1.0
    assert Share([1, 2, 2, 4]).sharers == pytest.approx(4 / (1 + 0.5 + 0.5 + 0.25))  # the link's split, averaged over time


# --- the estimator -------------------------------------------------------------------------------


def test_the_estimator_learns_the_link_and_splits_it_among_the_fetches_sharing_it():
    e = choice.Estimator(alpha=1.0)
    e.observe_read("s3", 100_000_000, 1.0, "raw", sharers=4)  # 100 MB/s seen while 4 fetches shared the link
    assert e.bandwidth("s3") == pytest.approx(4e8)
    assert e.rates("s3").bandwidth_Bps == pytest.approx(4e8)
    assert e.rates("s3", sharers=4).bandwidth_Bps == pytest.approx(1e8)
    assert e.rates("s3", sharers=4).format_bandwidth["raw"] == pytest.approx(1e8)


def test_plans_of_n_ranks_predict_n_times_the_transfer_on_the_same_link():
    e = choice.Estimator(alpha=1.0)
    e.observe_read("s3", 1_000_000_000, 1.0, "raw")
    stored = [{"raw": 100_000_000}] * 8
    one = choice.choose(stored, N, 100_000_000, {"raw": "raw"}, e.rates("s3"))
    four = choice.choose(stored, N, 100_000_000, {"raw": "raw"}, e.rates("s3", sharers=4))
    latency = e.rates("s3").latency_s
    assert four.predicted_s - latency == pytest.approx(4 * (one.predicted_s - latency))
