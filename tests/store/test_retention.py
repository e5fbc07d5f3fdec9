"""Retention: the policy (leaves only, least recently used and deepest first, dead first, TTL) against a
brute-force reference, and enforcement on both stores beside a sidecar that stores and fetches."""

import asyncio
import json
import random
import threading
import time

import pytest
import torch

from kvfetcher import keys
from kvfetcher.store import access, retention
from kvfetcher.store.retention import Index
from kvfetcher.fetch.plan import FetchOptions

from kvtest import running, synthetic_kv

# --- the policy -----------------------------------------------------------------------------------


def test_only_leaves_go_and_the_deepest_first_among_equals():
    ix = Index()
    ix.add("a", None, 10, 0.0)
    ix.add("b", "a", 10, 0.0, depth=1)
    ix.add("c", "b", 10, 0.0, depth=2)
    ix.add("x", None, 10, 5.0)
    ix.touch("a", 20.0)  # the oldest by use are b and c, but a is the newest: it goes last
    assert [b.key for b in ix.victims(max_bytes=0)] == ["c", "b", "x", "a"]
    assert ix.total == 0 and len(ix) == 0


def test_a_parent_with_a_stored_child_is_never_a_victim():
    ix = Index()
    ix.add("r", None, 10, 0.0)  # used long ago ...
    ix.add("c", "r", 10, 10.0, depth=1)  # ... but its child is recent
    ix.add("x", None, 10, 5.0)
    assert [b.key for b in ix.victims(max_bytes=20)] == ["x"]
    assert [b.key for b in ix.victims(max_bytes=10)] == ["c"]  # the child first: no hole
    ix.add("c2", "r", 10, 0.0, depth=1)
    with pytest.raises(ValueError, match="children"):
        ix.remove("r")


def test_ttl_takes_the_unused_but_keeps_a_parent_whose_child_is_used():
    ix = Index()
    ix.add("old", None, 1, 0.0)
    ix.add("old/1", "old", 1, 0.0, depth=1)
    ix.add("kept", None, 1, 0.0)
    ix.add("kept/1", "kept", 1, 0.0, depth=1)
    ix.touch("kept/1", 90.0)  # a fetch of a child reads its parent too, but even if only the child were noted
    ix.add("new", None, 1, 95.0)
    assert [b.key for b in ix.victims(ttl_s=50.0, now=100.0)] == ["old/1", "old"]
    assert set(ix.blocks) == {"kept", "kept/1", "new"}


def test_dead_blocks_go_first_and_only_when_due_otherwise():
    ix = Index()
    ix.add("live", None, 1, 0.0)
    ix.add("orphan", "gone", 1, 50.0, depth=3, dead=True)
    assert [b.key for b in ix.victims(max_bytes=100)] == ["orphan"]  # dead: always due
    assert [b.key for b in ix.victims(max_bytes=100)] == []


def test_adding_a_key_again_changes_its_size_only():
    ix = Index()
    ix.add("a", None, 10, 0.0)
    ix.add("a", None, 25, 99.0)
    assert ix.total == 25 and ix.blocks["a"].created == 0.0


# a brute-force reference: rescan every block for the smallest leaf at every step


def _reference_victims(blocks: dict, max_bytes, horizon):
    blocks = {k: dict(v) for k, v in blocks.items()}
    out = []
    while blocks:
        parents = {b["parent"] for b in blocks.values()}
        leaves = [k for k in blocks if k not in parents]
        k = min(leaves, key=lambda k: (0 if blocks[k]["dead"] else 1, blocks[k]["used"], -blocks[k]["depth"], k))
        b, total = blocks[k], sum(v["size"] for v in blocks.values())
        if not (b["dead"] or (horizon is not None and b["used"] < horizon) or (max_bytes is not None and total > max_bytes)):
            break
        out.append(k)
        del blocks[k]
    return out


@pytest.mark.parametrize("seed", range(20))
def test_incremental_index_equals_the_brute_force_reference(seed):
    """Random forests grown, touched and partly evicted step by step: the heap with lazy invalidation
    evicts exactly what a full rescan would, in the same order."""
    rng = random.Random(seed)
    ix, ref, clock = Index(), {}, 0.0
    for step in range(300):
        clock += rng.random()
        op = rng.random()
        if op < 0.5 or not ref:  # store a block under a random stored parent (or a new root)
            parent = rng.choice([None, *ref]) if ref else None
            key = f"k{step}"
            depth = 0 if parent is None else ref[parent]["depth"] + 1
            size, dead = rng.randint(1, 9), rng.random() < 0.03
            ix.add(key, parent, size, clock, depth=depth, dead=dead)
            ref[key] = {"parent": parent, "depth": depth, "size": size, "used": clock, "dead": dead}
        elif op < 0.85:  # a fetch: a block and its ancestors (sometimes only the block)
            key = rng.choice(list(ref))
            while key is not None:
                ix.touch(key, clock)
                ref[key]["used"] = max(ref[key]["used"], clock)
                key = ref[key]["parent"] if rng.random() < 0.8 else None
        else:  # enforce a bound and/or a TTL
            max_bytes = rng.choice([None, sum(v["size"] for v in ref.values()) * rng.random()])
            ttl = rng.choice([None, rng.random() * 50])
            expected = _reference_victims(ref, max_bytes, None if ttl is None else clock - ttl)
            got = [b.key for b in ix.victims(max_bytes, ttl, clock)]
            assert got == expected
            for k in got:
                del ref[k]
        assert ix.total == sum(v["size"] for v in ref.values())
    assert [b.key for b in ix.victims(max_bytes=0)] == _reference_victims(ref, 0, None)


# --- enforcement against the real stores ----------------------------------------------------------

CHUNK = 16
PRESETS = ("raw", "q8")


def _prompt(trunk: int, branch: int, chunks: int) -> list[int]:
    """A prompt of ``chunks`` chunks sharing its first 2 chunks with every prompt of its ``trunk``."""
    shared = [trunk * 1000 + t for t in range(2 * CHUNK)]
    return shared + [branch * 100_000 + t for t in range((chunks - 2) * CHUNK)]


def _stored(store) -> dict[str, set[str]]:
    """key -> presets stored."""
    out: dict[str, set[str]] = {}
    for key, objs in retention.chunk_objects(store).items():
        out[key] = {keys.preset_of(n) for n in objs}
    return out


def _prefix_closed(stored: dict, prompts: list[list[int]], ns) -> bool:
    """Every stored chunk of every prompt has all the chunks before it stored (no hole)."""
    for p in prompts:
        ck = keys.chunk_keys(ns, p, CHUNK)
        present = [k in stored for k in ck]
        if any(present[i] and not present[i - 1] for i in range(1, len(ck))):
            return False
    return True


async def _fill(sc, bid, prompts):
    for p in prompts:
        await sc.store(bid, p)
    await sc.flush()


async def test_enforce_keeps_what_was_fetched_deletes_every_representation_and_makes_no_hole(store, shm):
    kv = synthetic_kv(layers=2, heads=2, tokens=4 * CHUNK, head_dim=16)
    buf = shm(kv.shape, kv.dtype)
    buf.tensor.copy_(kv)
    prompts = [_prompt(t, b, 4) for t in range(2) for b in range(3)]  # two trees of three branches each
    async with running(store, chunk_tokens=CHUNK, presets=PRESETS, decode_procs=0, device="cpu") as sc:
        bid = sc.register(buf.handle, "m")
        ns = sc._buffer(bid).ns
        await _fill(sc, bid, prompts)
        stored = _stored(store)
        assert len(stored) == 2 * (2 + 3 * 2) and all(v == set(PRESETS) for v in stored.values())
        sizes = {k: sum(st.size for st in objs.values()) for k, objs in retention.chunk_objects(store).items()}
        fetched = keys.chunk_keys(ns, prompts[4], CHUNK)
        # the sidecars' fetches arrive as access logs: prompt 4 (tree 1) was fetched last
        recorder = access.Recorder(store, flush_s=3600)
        for name in (keys.object_name(k, "raw") for k in fetched):
            recorder.get(name, 0, 64)
            recorder.get(name, 64, 64)  # a segment read is not another fetch
        assert recorder.flush() == 4
        recorder.close()
        # room for the fetched prompt's chunks only: everything else is older
        bound = sum(sizes[k] for k in fetched)
        report = await asyncio.to_thread(retention.enforce, store, bound, None)
    after = _stored(store)
    assert report.errors == [] and report.access_logs == 1 and report.headers_read == 16
    assert set(after) == set(fetched) and report.kept_bytes == bound
    assert report.evicted_chunks == 12 and report.evicted_objects == 24  # every representation went
    assert all(v == set(PRESETS) for v in after.values())  # never half a chunk
    assert _prefix_closed(after, prompts, ns)
    logs = store.list(access.PREFIX)  # the merged table replaced the sidecar's log
    assert len(logs) == 1 and next(iter(logs)).startswith(f"{access.PREFIX}{access.COMPACTED}/")
    assert set(json.loads(store.get(next(iter(logs))))["fetched"]) <= set(after)


async def test_ttl_on_the_local_store_and_orphans(tmp_path, shm):
    from kvfetcher.store.local import LocalStore

    store = LocalStore(tmp_path / "s")
    kv = synthetic_kv(layers=2, heads=2, tokens=4 * CHUNK, head_dim=16)
    buf = shm(kv.shape, kv.dtype)
    buf.tensor.copy_(kv)
    prompt = _prompt(0, 0, 4)
    async with running(store, chunk_tokens=CHUNK, presets=("raw",), decode_procs=0, device="cpu") as sc:
        bid = sc.register(buf.handle, "m")
        ns = sc._buffer(bid).ns
        await _fill(sc, bid, [prompt])
    ck = keys.chunk_keys(ns, prompt, CHUNK)
    from kvfetcher.format import container

    parents = [container.parse_header(store.get(keys.object_name(k, "raw"))).meta["parent"] for k in ck]
    assert parents == ["", *ck[:-1]]  # every object names the chunk before it
    # a hole made from outside (e.g. a bucket lifecycle rule): what follows it can never be fetched
    store.delete(keys.object_name(ck[1], "raw"))
    fresh = await asyncio.to_thread(retention.enforce, store, None, None)
    assert fresh.evicted_chunks == 0  # a young orphan may be a chunk whose parent the listing missed
    later = retention.Evictor(store).enforce(None, None, now=time.time() + retention.ORPHAN_GRACE_S + 1)
    assert later.dead_chunks == 2 and set(_stored(store)) == {ck[0]}  # the orphan and its child
    # TTL: nothing used within it (here: created a moment ago, judged a day later)
    assert retention.enforce(store, None, ttl_s=3600, now=time.time() + 86400).expired_chunks == 1
    assert _stored(store) == {}


async def test_ttl_expires_what_was_not_used_within_it_on_both_stores(store, shm):
    kv = synthetic_kv(layers=2, heads=2, tokens=4 * CHUNK, head_dim=16)
    buf = shm(kv.shape, kv.dtype)
    buf.tensor.copy_(kv)
    async with running(store, chunk_tokens=CHUNK, presets=("raw",), decode_procs=0, device="cpu") as sc:
        bid = sc.register(buf.handle, "m")
        await _fill(sc, bid, [_prompt(0, 0, 4)])
    assert len(_stored(store)) == 4
    within = retention.enforce(store, None, ttl_s=3600, now=time.time() + 60)
    assert within.expired_chunks == 0 and len(_stored(store)) == 4  # used (stored) within the TTL: kept
    later = retention.enforce(store, None, ttl_s=3600, now=time.time() + 86400)
    assert later.expired_chunks == 4 and _stored(store) == {}


async def test_a_load_planned_before_an_eviction_gets_a_clean_prefix_and_recomputes_the_rest(store, shm):
    """The lookup saw four chunks; the evictor then took the last two (deepest first); the load,
    which does not list again, GETs objects that are gone: it answers the two that are left and
    `missing`, and writes nothing past them."""
    kv = synthetic_kv(layers=2, heads=2, tokens=4 * CHUNK, head_dim=16)
    buf = shm(kv.shape, kv.dtype)
    prompt = _prompt(0, 0, 4)
    async with running(store, chunk_tokens=CHUNK, presets=("raw",), decode_procs=0, device="cpu") as sc:
        bid = sc.register(buf.handle, "m")
        buf.tensor.copy_(kv)
        await _fill(sc, bid, [prompt])
        plan = await sc.lookup(bid, prompt, options=FetchOptions(recompute_tokens_per_s=1e-9))
        assert plan.hit_tokens == 4 * CHUNK and len(plan.chunks) == 4
        ck = keys.chunk_keys(sc._buffer(bid).ns, prompt, CHUNK)
        two = sum(st.size for k in ck[:2] for st in retention.chunk_objects(store)[k].values())
        assert (await asyncio.to_thread(retention.enforce, store, two, None)).evicted_chunks == 2
        buf.tensor.fill_(0)
        r = await sc.fetch(bid, prompt, plan)
    assert (r.error, r.loaded_tokens, r.not_loaded) == ("missing", 2 * CHUNK, (2 * CHUNK, 4 * CHUNK))
    assert torch.equal(buf.tensor[:, :, :, : 2 * CHUNK], kv[:, :, :, : 2 * CHUNK])
    assert bool((buf.tensor[:, :, :, 2 * CHUNK :] == 0).all())


@pytest.mark.slow
async def test_concurrent_fetches_only_hit_or_miss_cleanly_while_the_evictor_runs(store, shm):
    """A bounded store, a sidecar storing and fetching prompts, an evictor enforcing the bound in a
    loop beside it (deleting a chunk's two representations one after the other): every load returns
    a clean prefix (all its tokens right, nothing else written) or a clean miss."""
    kv = synthetic_kv(layers=2, heads=2, tokens=6 * CHUNK, head_dim=16)
    buf = shm(kv.shape, kv.dtype)
    prompts = [_prompt(t, b, 6) for t in range(3) for b in range(3)]
    stop, reports = threading.Event(), []

    def evict(bound):
        ev = retention.Evictor(store)
        while not stop.is_set():
            reports.append(ev.enforce(bound, None))

    async with running(store, chunk_tokens=CHUNK, presets=PRESETS, decode_procs=0, device="cpu") as sc:
        bid = sc.register(buf.handle, "m")
        buf.tensor.copy_(kv)
        await _fill(sc, bid, prompts[:1])
        chunk_bytes = sum(st.size for objs in retention.chunk_objects(store).values() for st in objs.values()) // 6
        evictor = threading.Thread(target=evict, args=(10 * chunk_bytes,))  # room for fewer than two prompts
        evictor.start()
        outcomes = []
        try:
            rng = random.Random(0)
            for _ in range(16):
                p = rng.choice(prompts)
                buf.tensor.copy_(kv)
                await sc.store(bid, p)
                buf.tensor.fill_(0)
                r = await sc.fetch(bid, rng.choice(prompts), options=FetchOptions(recompute_tokens_per_s=1e-9, presets=("raw",)))  # q8 is lossy
                outcomes.append((r.error, r.loaded_tokens))
                assert r.error in (None, "missing"), r
                n = r.loaded_tokens
                assert torch.equal(buf.tensor[:, :, :, :n], kv[:, :, :, :n])  # what was loaded is right
                assert bool((buf.tensor[:, :, :, n:] == 0).all())  # and nothing else was written
            await sc.flush()
        finally:
            stop.set()
            await asyncio.to_thread(evictor.join)
    assert len(reports) >= 2 and sum(r.evicted_chunks for r in reports) > 0
    assert any(n for _, n in outcomes)  # some loads hit
    assert all(r.errors == [] for r in reports)


# --- the command line and store URLs --------------------------------------------------------------


def test_evict_command_on_a_store_url(s3_endpoint, tmp_path, capsys, monkeypatch):
    """``kvfetcher evict --store URL`` reaches a bucket with the environment's credentials and a
    directory by its path; one JSON report a run; a bound that needs deleting deletes."""
    from kvfetcher.cli import main
    from kvfetcher.store import from_url
    from kvfetcher.store.local import LocalStore
    from kvfetcher.store.s3 import S3Store

    from kvtest import new_bucket

    monkeypatch.setenv("KVFETCHER_S3_ACCESS_KEY", "testing")
    monkeypatch.setenv("KVFETCHER_S3_SECRET_KEY", "testing")
    bucket = new_bucket(s3_endpoint)
    s3 = from_url(f"{s3_endpoint}/{bucket.bucket}")
    assert isinstance(s3, S3Store) and s3.endpoint == bucket.endpoint
    assert isinstance(from_url(f"file://{tmp_path}/d"), LocalStore) and isinstance(from_url(str(tmp_path / "e")), LocalStore)
    for bad in ("ftp://x/y", f"{s3_endpoint}/", f"{s3_endpoint}/a/b"):
        with pytest.raises(ValueError):
            from_url(bad)

    from kvfetcher.chunk import encode_chunk

    kv = synthetic_kv(layers=2, heads=2, tokens=CHUNK, head_dim=16)
    parent = ""
    for i, key in enumerate(("aa" + "0" * 62, "bb" + "1" * 62, "cc" + "2" * 62)):  # one prompt of three chunks
        s3.put(keys.object_name(key, "raw"), encode_chunk(kv, "raw", "fp", {"parent": parent}, start=i * CHUNK))
        parent = key
    assert main(["evict", "--store", f"{s3_endpoint}/{bucket.bucket}", "--max-bytes", "1", "--once"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["chunks"], report["evicted_chunks"], report["kept_bytes"], report["errors"]) == (3, 3, 0, [])
    assert s3.list("kv/") == {}
    assert main(["evict", "--store", str(tmp_path / "empty"), "--ttl-days", "7"]) == 0
    assert json.loads(capsys.readouterr().out)["chunks"] == 0
    with pytest.raises(SystemExit):
        main(["evict", "--max-bytes", "0"])


def test_a_serving_sidecars_store_writes_access_logs_and_keeps_records_a_failed_write_lost(tmp_path):
    from kvfetcher.store import StoreError, from_env
    from kvfetcher.store.local import LocalStore

    env = {"KVFETCHER_STORE_DIR": str(tmp_path / "s"), "KVFETCHER_ACCESS_LOG_S": "0.05"}
    assert isinstance(from_env(env), LocalStore)  # the evictor's and tools' stores record nothing
    assert isinstance(from_env(dict(env, KVFETCHER_ACCESS_LOG_S="0"), record_access=True), LocalStore)
    rec = from_env(env, record_access=True)
    assert isinstance(rec, access.Recorder)
    name = keys.object_name("ab" + "9" * 62, "raw")
    rec.put(name, b"x" * 100)
    rec.put("kv/_meta/other.json", b"{}")
    t0 = time.time()
    rec.get(name, 0, 10)
    rec.get("kv/_meta/other.json")  # not a chunk
    deadline = time.time() + 10
    while not rec.list(access.PREFIX) and time.time() < deadline:
        time.sleep(0.02)
    rec.close()
    (log_name,) = rec.list(access.PREFIX)
    assert log_name.startswith(f"{access.PREFIX}{rec.writer}/")
    fetched = json.loads(rec.get(log_name))["fetched"]
    assert list(fetched) == ["ab" + "9" * 62] and t0 <= fetched["ab" + "9" * 62] <= time.time()

    class Full(LocalStore):
        fail = True

        def put(self, name, data):
            if self.fail:
                raise StoreError("full")
            return super().put(name, data)

    store = Full(tmp_path / "f")
    rec = access.Recorder(store, flush_s=3600)
    store.fail = False
    store.put(name, b"x" * 100)
    store.fail = True
    rec.get(name, 0, 10)
    assert rec.flush() == 0 and store.list(access.PREFIX) == {}
    store.fail = False
    assert rec.flush() == 1 and len(store.list(access.PREFIX)) == 1
    rec.close()
