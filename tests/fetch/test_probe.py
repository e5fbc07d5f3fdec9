"""A fresh sidecar learns its link from a background probe when its prior alone made a stored
prefix recompute: ``auto`` can then choose a load without a forced one teaching it first."""

import torch

from kvfetcher.config import Config
from kvfetcher.fetch import probe
from kvfetcher.fetch.plan import FetchOptions
from kvfetcher.service import Sidecar
from kvfetcher.store.local import LocalStore
from kvtest import synthetic_kv

FP = "model/fp16"
N = 32
TOKENS = list(range(1000, 1000 + 8 * N))
RECOMPUTES = FetchOptions(recompute_tokens_per_s=1e12)  # recompute beats any fetch: the lookup plans a recompute


def test_a_probe_reads_the_largest_object_of_each_leading_chunk_up_to_its_bytes():
    run = [{"raw": 100, "q8": 40}, {"raw": 100}, {"q8": 40}, {}, {"raw": 100}]
    assert probe.objects(["a", "b", "c", "d", "e"], run, max_bytes=10_000) == [
        (probe.keys.object_name("a", "raw"), 100), (probe.keys.object_name("b", "raw"), 100), (probe.keys.object_name("c", "q8"), 40)]  # stops at the first chunk not stored
    assert [n for n, _ in probe.objects(["a", "b", "c"], run, max_bytes=150)] == [probe.keys.object_name(k, "raw") for k in "ab"]
    assert len(probe.objects(["a"], run, max_bytes=1)) == 1  # at least one
    assert probe.objects([], [], max_bytes=1) == []


def kv_buffer(shm):
    return shm((2, 2, 2, 8 * N, 16), fill=synthetic_kv(layers=2, heads=2, tokens=8 * N, head_dim=16))


async def stored_sidecar(tmp_path, shm):
    sc = Sidecar(LocalStore(tmp_path), Config(chunk_tokens=N, presets=("raw",), decode_procs=0, warm_up=False))
    await sc.start()
    buf = kv_buffer(shm)
    bid = sc.register(buf.handle, FP)
    await sc.store(bid, TOKENS)
    await sc.flush()
    return sc, bid, buf


async def test_a_recompute_over_an_unmeasured_link_probes_it_once_and_touches_no_buffer(tmp_path, shm):
    sc, bid, buf = await stored_sidecar(tmp_path, shm)
    try:
        ep = sc.objects.endpoint
        assert not sc.estimator.measured(ep)
        before = buf.tensor.clone()
        p = await sc.lookup(bid, TOKENS, RECOMPUTES)
        assert (p.preset, p.hit_tokens) == ("recompute", len(TOKENS))
        await sc.probe.settled()
        assert sc.estimator.measured(ep) and sc.estimator.bandwidth(ep) != 1.25e8  # the prior replaced by what the probe saw
        assert f'kvfetcher_store_bandwidth_bytes_per_second{{endpoint="{ep}"}}' in sc.metrics.exposition().decode()
        await sc.lookup(bid, TOKENS, RECOMPUTES)
        await sc.probe.settled()
        assert sc.probe.probes == 1  # measured: never again
        assert torch.equal(buf.tensor, before)  # what it read reached no buffer
    finally:
        await sc.close()


async def test_a_probe_reads_through_the_fetchs_read_path_into_staging(tmp_path, shm):
    """The rate taught is the one fetches read at: the probe reads with the sidecar's ``read`` (its
    reader processes where it has them) into staging buffers, not with a plain GET of its own."""
    from kvfetcher.store import read_into

    sc, bid, _ = await stored_sidecar(tmp_path, shm)
    try:
        seen = []

        def read(name, offset, buf):  # the fetch's ranged read (here the store's own), watched
            seen.append((name, offset, len(buf)))
            return read_into(sc.objects, name, offset, buf)

        sc.probe.read = read
        got = sc.objects.get
        sc.objects.get = lambda *a, **kw: (_ for _ in ()).throw(AssertionError("the probe used a GET of its own"))
        try:
            await sc.lookup(bid, TOKENS, RECOMPUTES)
            await sc.probe.settled()
        finally:
            sc.objects.get = got
        assert seen and all(offset == 0 for _, offset, _ in seen)
        assert {n for n, _, _ in seen} <= set(sc.objects.list("kv/"))
        assert sc.estimator.measured(sc.objects.endpoint)
        assert sc.probe.staging.allocated >= 1  # read into staging buffers (given back)
    finally:
        await sc.close()


async def test_a_miss_or_a_planned_load_starts_no_probe(tmp_path, shm):
    sc, bid, _ = await stored_sidecar(tmp_path, shm)
    try:
        await sc.lookup(bid, list(range(5000, 5000 + 4 * N)), RECOMPUTES)  # nothing stored
        p = await sc.lookup(bid, TOKENS, FetchOptions(recompute_tokens_per_s=1.0))  # recompute far slower: a load is planned
        assert p.preset == "raw"
        assert sc.probe.probes == 0
    finally:
        await sc.close()


async def test_a_failed_probe_is_counted_and_the_next_waits(tmp_path, shm):
    sc, bid, _ = await stored_sidecar(tmp_path, shm)
    try:
        for name in sc.objects.list("kv/"):
            sc.objects.delete(name)  # the index still says stored: the probe's reads fail
        await sc.lookup(bid, TOKENS, RECOMPUTES)
        await sc.probe.settled()
        assert not sc.estimator.measured(sc.objects.endpoint)
        assert 'kvfetcher_errors_total{reason="missing"}' in sc.metrics.exposition().decode()
        await sc.lookup(bid, TOKENS, RECOMPUTES)
        assert sc.probe.probes == 1  # not before every_s
    finally:
        await sc.close()


async def test_a_probe_counts_as_a_fetch_on_the_nodes_link_and_learns_the_whole_link(tmp_path, shm, monkeypatch):
    """Another fetch on the node holds the link while the probe reads: the probe saw half of it,
    and teaches the estimator the whole (as a fetch does, :mod:`kvfetcher.fetch.linkshare`)."""
    from kvfetcher.fetch.linkshare import LinkShare

    sc, bid, _ = await stored_sidecar(tmp_path, shm)
    try:
        sc.probe.link = LinkShare(str(tmp_path / "link"))
        taught = []
        monkeypatch.setattr(sc.estimator, "observe_read", lambda ep, nbytes, seconds, fmt=None, sharers=1.0, **kw: taught.append(sharers))
        async with LinkShare(str(tmp_path / "link")).fetch():  # a fetch of another sidecar on the node
            await sc.lookup(bid, TOKENS, RECOMPUTES)
            await sc.probe.settled()
        assert taught == [2.0]
    finally:
        await sc.close()


async def test_a_ceiling_past_half_its_time_is_probed_and_a_probe_no_faster_renews_it(tmp_path, shm):
    """A slow spell's ceiling keeps ``auto`` recomputing; before it lapses (and a stale faster rate
    plans a load again) a probe checks the link: no faster, the ceiling stands anew."""
    from kvfetcher.fetch import choice

    sc, bid, _ = await stored_sidecar(tmp_path, shm)
    try:
        e, ep, now = sc.estimator, sc.objects.endpoint, [0.0]
        e.clock = lambda: now[0]
        e.observe_read(ep, 10**12, 1.0, "raw")  # a fast link, measured
        e.observe_read(ep, 1, 1.0, "raw", bound=True)  # then a slow spell: 1 B/s at most
        await sc.lookup(bid, TOKENS, RECOMPUTES)
        assert sc.probe.probes == 0 and not e.stale(ep)  # the ceiling is fresh
        now[0] = choice.CEILING_TTL_S * 0.6
        assert e.stale(ep)
        await sc.lookup(bid, TOKENS, RECOMPUTES)
        await sc.probe.settled()
        assert sc.probe.probes == 1 and e.ceiling(ep) is not None and e.ceiling(ep) > 1  # the local disk beat 1 B/s: lifted
        e.observe_read(ep, 10**15, 1.0, "raw", bound=True)  # a ceiling no probe can beat
        now[0] = choice.CEILING_TTL_S * 1.2
        sc.probe._last = float("-inf")
        await sc.lookup(bid, TOKENS, RECOMPUTES)
        await sc.probe.settled()
        assert e.ceiling(ep) == 1e15 and not e.stale(ep)  # renewed at now, not lapsed
    finally:
        await sc.close()


async def test_rates_learnt_in_a_slow_spell_are_probed_once_stale_and_auto_loads_again(tmp_path, shm):
    """A slow spell taught raw's rate; ``auto`` then recomputes, reads nothing and learns nothing.
    Once no read renewed the rate for ``REFRESH_S``, a lookup that recomputes a stored prefix probes
    the link; the probe reads it far faster, the slow rates are dropped, and the next lookup loads."""
    from kvfetcher.fetch import choice

    sc, bid, _ = await stored_sidecar(tmp_path, shm)
    try:
        e, ep, now = sc.estimator, sc.objects.endpoint, [0.0]
        e.clock = lambda: now[0]
        for _ in range(3):
            e.observe_read(ep, 1000, 1.0, "raw")  # 1 kB/s: the 64 kB prefix in a minute
        options = FetchOptions(recompute_tokens_per_s=len(TOKENS) / 1.0)  # recompute in 1 s
        assert (await sc.lookup(bid, TOKENS, options)).preset == "recompute"
        assert sc.probe.probes == 0  # the rate is fresh
        now[0] = choice.REFRESH_S + 1
        assert (await sc.lookup(bid, TOKENS, options)).preset == "recompute"  # decided on what it knew ...
        await sc.probe.settled()
        assert sc.probe.probes == 1 and e.rates(ep).format_bandwidth.get("raw", 0.0) != 1000.0
        assert (await sc.lookup(bid, TOKENS, options)).preset == "raw"  # ... the local disk is far faster than 1 kB/s
    finally:
        await sc.close()
