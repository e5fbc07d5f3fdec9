"""A load planned on a rate the link no longer has (learnt before it slowed) stops at its plan's
break-even, keeps what it loaded, and teaches the link's rate: the next lookup recomputes."""

import threading
import time
from dataclasses import replace

from kvfetcher.config import Config
from kvfetcher.fetch import choice
from kvfetcher.fetch.plan import FetchOptions
from kvfetcher.service import Sidecar
from kvfetcher.store.local import LocalStore
from kvtest import synthetic_kv

FP = "model/fp16"
N = 32
TOKENS = list(range(1000, 1000 + 8 * N))
RECOMPUTE_S = 0.4
OPTIONS = FetchOptions(recompute_tokens_per_s=len(TOKENS) / RECOMPUTE_S)


class Link(LocalStore):
    """A store behind a link of ``rate`` bytes per second (None: the disk's), one read at a time."""

    rate: float | None = None
    lock = threading.Lock()

    def _pace(self, n: int) -> None:
        if self.rate:
            with self.lock:
                time.sleep(n / self.rate)

    def get(self, name, offset=0, length=None):
        data = super().get(name, offset, length)
        self._pace(len(data))
        return data

    def get_into(self, name, offset, buf):
        n = super().get_into(name, offset, buf)
        self._pace(n)
        return n


async def test_a_load_on_a_stale_rate_stops_at_its_break_even_and_the_next_lookup_recomputes(tmp_path, shm):
    store = Link(tmp_path)
    sc = Sidecar(store, Config(chunk_tokens=N, presets=("raw",), decode_procs=0, read_procs=0, warm_up=False))
    await sc.start()
    try:
        buf = shm((2, 2, 2, 8 * N, 16), fill=synthetic_kv(layers=2, heads=2, tokens=8 * N, head_dim=16))
        bid = sc.register(buf.handle, FP)
        await sc.store(bid, TOKENS)
        await sc.flush()
        ep, chunk_bytes = sc.objects.endpoint, sum(store.list("kv/").values()) // 8
        sc.estimator.settled("raw")  # raw fetched before, on a fast link: 1 GB/s learnt
        sc.estimator.observe_read(ep, 10**9, 1.0, "raw", bound=True)
        plan = await sc.lookup(bid, TOKENS, OPTIONS)
        assert plan.preset == "raw" and plan.breakeven_s == choice.BREAKEVEN_SLACK * plan.options[choice.RECOMPUTE]

        store.rate = chunk_bytes / 0.3  # the link slowed: a chunk takes 0.3 s, the prefix 2.4 s
        t = time.perf_counter()
        reply = await sc.fetch(bid, TOKENS, plan)
        took = time.perf_counter() - t
        assert reply.error == "deadline" and reply.kv_bytes > 0 and reply.loaded_tokens < len(TOKENS)  # stopped (a leading run it loaded is kept)
        assert plan.breakeven_s <= took < plan.breakeven_s + 0.35  # (a read in flight at the break-even is not waited for)

        assert sc.estimator.rates(ep).format_bandwidth["raw"] < 2 * store.rate  # the link's rate now, from the late fetch
        shown = f'kvfetcher_store_read_rate_bytes_per_second{{endpoint="{ep}",format="raw"}}'
        assert any(line.startswith(shown) and float(line.split()[-1]) < 2 * store.rate
                   for line in sc.metrics.exposition().decode().splitlines())  # and shown as such
        assert (await sc.lookup(bid, TOKENS, OPTIONS)).preset == choice.RECOMPUTE
    finally:
        await sc.close()


def test_a_read_bound_fetch_caps_every_format_s_rate_until_a_faster_read_or_its_time_is_up():
    e = choice.Estimator(alpha=0.3)
    now = [0.0]
    e.clock = lambda: now[0]
    e.observe_read("s3", 4_000_000_000, 1.0, "raw", bound=True)  # 4 GB/s, learnt on a fast link
    e.observe_read("s3", 500_000_000, 1.0, "ans")  # decode-bound: a floor of the link, no cap
    assert e.rates("s3").format_bandwidth["raw"] == 4e9
    e.observe_read("s3", 125_000_000, 1.0, "ans", bound=True)  # the link now delivers 125 MB/s
    r = e.rates("s3")
    assert r.format_bandwidth["raw"] == r.format_bandwidth["ans"] == r.bandwidth_Bps == 1.25e8
    e.observe_read("s3", 1_000_000_000, 1.0, "ans")  # a read faster than the ceiling: the link delivers at least that
    assert e.rates("s3").format_bandwidth["raw"] == 1e9
    e.observe_read("s3", 125_000_000, 1.0, "ans", bound=True)
    now[0] = choice.CEILING_TTL_S + 1  # one slow spell does not rule the link for good
    assert e.ceiling("s3") is None and e.rates("s3").format_bandwidth["raw"] > 1e9


def test_only_a_load_has_a_break_even_and_a_budget_extends_it():
    stored, fmts = [{"raw": 10_000_000}] * 4, {"raw": "raw"}
    rates = choice.Rates(5e9, 0.001, {"raw": 5e9}, choice.PrefillModel.linear(1000.0))
    d = choice.choose(stored, 256, 10_000_000, fmts, rates)
    assert d.preset == "raw" and d.breakeven_s == choice.BREAKEVEN_SLACK * d.options[choice.RECOMPUTE]
    fast = replace(rates, prefill=choice.PrefillModel.linear(1e6))  # recompute in 1 ms: a load still gets the floor
    assert choice.choose(stored, 256, 10_000_000, fmts, replace(fast, bandwidth_Bps=1e12, latency_s=0.0, decode_Bps={"raw": 1e12})).breakeven_s == choice.MIN_BREAKEVEN_S
    assert choice.choose(stored, 256, 10_000_000, fmts, rates, budget_s=100.0).breakeven_s == choice.BREAKEVEN_SLACK * 100.0
    slow = choice.Rates(1e3, 0.001, {"raw": 5e9}, choice.PrefillModel.linear(1000.0))
    assert choice.choose(stored, 256, 10_000_000, fmts, slow).breakeven_s is None  # recompute: nothing to stop


def test_a_load_predicted_to_win_by_less_than_it_costs_the_engine_is_not_taken():
    """Recompute 1 s, a raw load 0.95 s: taken with no overhead, not once the engine says a load costs
    it 0.1 s more; the shortcut that skips the store agrees."""
    stored, fmts = [{"raw": 10_000_000}] * 4, {"raw": "raw"}
    rates = choice.Rates(4e7 / 0.95, 0.0, {"raw": 1e12}, choice.PrefillModel(c1=1.0 / 1024))
    assert choice.choose(stored, 256, 10_000_000, fmts, rates).preset == "raw"
    costly = replace(rates, load_overhead_s=0.1)
    d = choice.choose(stored, 256, 10_000_000, fmts, costly)
    assert d.preset == choice.RECOMPUTE and abs(d.options["raw"] - 1.05) < 1e-6
    assert not choice.hopeless(4, 256, 10_000_000, {}, fmts, rates)
    assert choice.hopeless(4, 256, 10_000_000, {}, fmts, costly)


def test_a_load_must_win_by_more_than_the_prefill_model_was_lately_off():
    """Recompute 1 s, a raw load 0.8 s: taken while the model is right to 10%, not while it is off by
    30% (capped at MAX_PREFILL_ERROR: a 0.8 s load beats 1 s by 20%, less than 25%); a clear win
    (0.5 s) is taken whatever the error; the shortcut that skips the store agrees; a TTFT budget
    still prefers the fetch."""
    stored, fmts = [{"raw": 10_000_000}] * 4, {"raw": "raw"}
    rates = choice.Rates(4e7 / 0.8, 0.0, {"raw": 1e12}, choice.PrefillModel(c1=1.0 / 1024))
    assert choice.choose(stored, 256, 10_000_000, fmts, replace(rates, prefill_error=0.1)).preset == "raw"
    unsure = replace(rates, prefill_error=0.3)
    d = choice.choose(stored, 256, 10_000_000, fmts, unsure)
    assert d.preset == choice.RECOMPUTE and abs(d.options["raw"] - 0.8) < 1e-6  # the options are the model's, unmargined
    assert choice.hopeless(4, 256, 10_000_000, {}, fmts, unsure) and not choice.hopeless(4, 256, 10_000_000, {}, fmts, rates)
    assert choice.choose(stored, 256, 10_000_000, fmts, replace(unsure, bandwidth_Bps=4e7 / 0.5)).preset == "raw"
    assert choice.choose(stored, 256, 10_000_000, fmts, unsure, budget_s=0.9).preset == "raw"
    assert unsure.beats_recompute(0.74, 1.0) and not unsure.beats_recompute(0.76, 1.0)  # the cap: 25%
