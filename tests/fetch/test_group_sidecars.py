"""A tensor-parallel group of real sidecars on loopback, one per rank, each storing and fetching its
own shard (one KV head each): every rank loads a prefix or none does, the node's link is split among
the ranks, and a killed rank's sidecar makes every rank recompute."""

from contextlib import ExitStack, contextmanager

import pytest
import torch

from benchmarks.lib import linkserver
from kvfetcher.api.client import KVClient
from kvfetcher.api.group import RankGroup
from kvfetcher import keys
from kvfetcher.store.local import LocalStore
from kvfetcher.fetch.plan import FetchOptions

from kvtest import SENTINEL, flip, served, sidecar, synthetic_kv

RANKS, LAYERS, DIM, CAP, CHUNK = 3, 2, 32, 1088, 64
MODEL = "tp-model"
TOKENS = list(range(7000, 7000 + 4 * CHUNK))


@contextmanager
def group(tmp_path, shm, stores, tokens=TOKENS, **config):
    """Sidecars of ``stores`` (one per rank) sharing a link directory, each with its rank's shard of
    the KV of ``tokens`` stored; yields (group, buffer ids, buffers, sidecars, the full KV)."""
    kv = synthetic_kv(layers=LAYERS, heads=len(stores), tokens=len(tokens), head_dim=DIM)
    with ExitStack() as stack:
        scs = [stack.enter_context(sidecar(s, token=None, chunk_tokens=CHUNK, link_dir=str(tmp_path / "link"), **config)) for s in stores]
        g = stack.enter_context(RankGroup([KVClient(socket_path=sc.socket) for sc in scs]))
        bufs = [shm((LAYERS, 2, 1, CAP, DIM)) for _ in scs]
        bids = []
        for r, (c, b) in enumerate(zip(g.clients, bufs)):
            bids.append(c.register(b.handle, MODEL, tp_rank=r))
            b.tensor[:, :, :, : len(tokens)] = kv[:, :, r : r + 1]
            c.store(bids[-1], tokens)
        for c, b in zip(g.clients, bufs):
            c.flush()
            b.tensor.fill_(SENTINEL)
        yield g, bids, [b.tensor for b in bufs], scs, kv


def object_name(sc, rank: int, chunk: int, preset: str = "raw") -> str:
    ns = sc.sidecar.namespace(MODEL, "float16", rank, (LAYERS, 1, DIM))
    return keys.object_name(keys.chunk_keys(ns, TOKENS, CHUNK)[chunk], preset)


def local(tmp_path, n=RANKS):
    return [LocalStore(tmp_path / "store") for _ in range(n)]


def test_every_rank_loads_its_own_shard(tmp_path, shm):
    with group(tmp_path, shm, local(tmp_path)) as (g, bids, bufs, _, kv):
        p = g.lookup(TOKENS, bids, options=FetchOptions(recompute_tokens_per_s=1.0))
        assert (p.preset, p.loaded_tokens, p.error) == ("raw", len(TOKENS), None)
        out = g.fetch(p, TOKENS, bids, offset=8)
        assert (out.loaded_tokens, out.not_loaded, out.error) == (len(TOKENS), (len(TOKENS), len(TOKENS)), None)
        for r, b in enumerate(bufs):
            assert torch.equal(b[:, :, :, 8 : 8 + len(TOKENS)], kv[:, :, r : r + 1])
        # a scheduler without buffers plans by namespace: the same common hit
        assert g.lookup(TOKENS, model=MODEL, dtype="float16", kv_shape=(LAYERS, 1, DIM)).hit_tokens == len(TOKENS)


def test_one_ranks_missing_shard_limits_every_rank_to_the_common_prefix(tmp_path, shm):
    stores = local(tmp_path)
    with group(tmp_path, shm, stores) as (g, bids, bufs, scs, kv):
        stores[1].delete(object_name(scs[1], 1, 2))  # rank 1 loses its shard of chunk 2 (evicted) after its sidecar stored it
        stale = g.lookup(TOKENS, bids, options=FetchOptions(recompute_tokens_per_s=1.0))
        assert stale.loaded_tokens == len(TOKENS)  # what rank 1's index knew
        out = g.fetch(stale, TOKENS, bids)  # the group loads what every rank loaded
        assert (out.loaded_tokens, out.not_loaded) == (2 * CHUNK, (2 * CHUNK, len(TOKENS)))
        p = g.lookup(TOKENS, bids, options=FetchOptions(recompute_tokens_per_s=1.0))  # rank 1's index forgot what failed
        assert (p.tokens, p.loaded_tokens, p.reason) == (2 * CHUNK, 2 * CHUNK, "miss")
        for b in bufs:
            b.fill_(SENTINEL)
        out = g.fetch(p, TOKENS, bids)
        assert (out.loaded_tokens, out.not_loaded) == (2 * CHUNK, (2 * CHUNK, len(TOKENS)))
        for r, b in enumerate(bufs):  # no rank holds more than the others: nothing past the common prefix was written
            assert torch.equal(b[:, :, :, : 2 * CHUNK], kv[:, :, r : r + 1, : 2 * CHUNK])
            assert (b[:, :, :, 2 * CHUNK :] == SENTINEL).all()


def test_one_ranks_corrupt_shard_makes_every_rank_recompute(tmp_path, shm):
    stores = local(tmp_path)
    with group(tmp_path, shm, stores) as (g, bids, _, scs, _):
        p = g.lookup(TOKENS, bids, options=FetchOptions(recompute_tokens_per_s=1.0))
        name = object_name(scs[2], 2, 0)
        obj = stores[2].get(name)
        stores[2].delete(name)
        stores[2].put(name, flip(obj, len(obj) - 100))  # found by the listing, refused by its checksum
        out = g.fetch(p, TOKENS, bids)
        assert (out.loaded_tokens, out.not_loaded, out.error, out.rank) == (0, (0, len(TOKENS)), "corrupt", 2)
        assert out.replies[0].loaded_tokens == len(TOKENS)  # rank 0 had its shard, and recomputes with the others


@pytest.mark.slow
def test_a_killed_ranks_sidecar_makes_every_rank_recompute(tmp_path, shm):
    env = dict(KVFETCHER_STORE_DIR=str(tmp_path / "store"), KVFETCHER_PRESET="raw", KVFETCHER_CHUNK_TOKENS=str(CHUNK),
               KVFETCHER_LINK_DIR=str(tmp_path / "link"))
    sock = str(tmp_path / "run" / "rank1.sock")
    with served(sock, env) as proc, sidecar(LocalStore(tmp_path / "store"), token=None, chunk_tokens=CHUNK) as rank0:
        bufs = [shm((LAYERS, 2, 1, CAP, DIM), fill=1.0) for _ in range(2)]
        with RankGroup([KVClient(socket_path=rank0.socket), KVClient(socket_path=sock)]) as g:
            bids = [c.register(b.handle, MODEL, tp_rank=r) for r, (c, b) in enumerate(zip(g.clients, bufs))]
            for c, bid in zip(g.clients, bids):
                c.store(bid, TOKENS)
                c.flush()
            p = g.lookup(TOKENS, bids, options=FetchOptions(recompute_tokens_per_s=1.0))
            assert p.loaded_tokens == len(TOKENS)
            proc.kill()  # between the plan and the load
            proc.wait(30)
            out = g.fetch(p, TOKENS, bids)
            assert (out.loaded_tokens, out.error, out.rank) == (0, "sidecar_down", 1)
            again = g.lookup(TOKENS, bids, options=FetchOptions(recompute_tokens_per_s=1.0))
            assert (again.preset, again.loaded_tokens, again.error, again.rank) == ("recompute", 0, "sidecar_down", 1)


def test_the_group_plans_with_the_link_split_among_its_ranks(tmp_path, shm):
    with group(tmp_path, shm, local(tmp_path)) as (g, bids, _, _, _):
        p = g.lookup(TOKENS, bids, options=FetchOptions(recompute_tokens_per_s=1.0))
        alone = g.clients[0].lookup(bids[0], TOKENS, options=FetchOptions(recompute_tokens_per_s=1.0))
        assert alone.preset == p.plans[0].preset == "raw"
        # every rank's estimator is fresh (the prior link, latency and decode rates): the transfer is the
        # stored bytes over the link's share
        latency = alone.predicted_s - sum(s for _, s in alone.chunks) / 1.25e8
        assert latency == pytest.approx(0.005)
        assert p.plans[0].predicted_s - latency == pytest.approx(RANKS * (alone.predicted_s - latency))


@pytest.mark.slow
def test_ranks_fetching_at_once_learn_the_links_rate_not_their_share(tmp_path, shm):
    """Over one paced link (an S3 server whose responses share one rate), every rank fetches at
    ``rate / 3``; counting the others, each learns the link's ``rate``. Four times a load's window of
    chunks, so that the ranks' requests interleave on the link (it serves them first come, first served)."""
    from kvfetcher.store.s3 import S3Store

    (tmp_path / "s3" / "bench").mkdir(parents=True)
    server = linkserver.start_thread(tmp_path / "s3")
    rate = 1e6  # bytes/s: a rank's 256 KiB shard takes ~0.8 s at a third of it
    tokens = list(range(16 * CHUNK))
    try:
        stores = [S3Store(server.url, "bench", "k", "s") for _ in range(RANKS)]
        with group(tmp_path, shm, stores, tokens, io_workers=4) as (g, bids, _, scs, _):
            linkserver.set_rate(server.url, rate)
            for _ in range(2):  # a sidecar's first fetch of a format teaches nothing
                p = g.lookup(tokens, bids, options=FetchOptions(recompute_tokens_per_s=1.0))
                assert g.fetch(p, tokens, bids).loaded_tokens == len(tokens)
            learnt = [sc.sidecar.estimator.bandwidth(stores[0].endpoint) for sc in scs]
            assert all(0.6 * rate < b < 1.4 * rate for b in learnt), learnt  # alone on it, each would have learnt ~rate / 3
    finally:
        server.shutdown()
        server.server_close()
