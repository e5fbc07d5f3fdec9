"""A lookup answers from the sidecar's index of the store; what the index does not know is listed in
the background (or waited for a little, or refreshed), and a prefix another sidecar stores becomes
visible within the negative TTL plus one listing."""

import asyncio

from kvfetcher.fetch.plan import FetchOptions
from kvfetcher.store.local import LocalStore

from kvtest import running, synthetic_kv

TOKENS = list(range(96))
SLOW_MODEL = dict(recompute_tokens_per_s=1e-9)  # fetching is the cost model's choice


async def stored_by_another_sidecar(root, shm):
    kv = synthetic_kv(layers=2, heads=2, tokens=96, head_dim=32)
    buf = shm(kv.shape, kv.dtype)
    buf.tensor.copy_(kv)
    async with running(LocalStore(root), chunk_tokens=32, presets=("raw",), decode_procs=0, device="cpu") as writer:
        await writer.store(writer.register(buf.handle, "m"), TOKENS)
        await writer.flush()
    return buf


async def test_a_prefix_stored_elsewhere_is_found_by_a_background_listing(tmp_path, shm):
    buf = await stored_by_another_sidecar(tmp_path, shm)
    async with running(LocalStore(tmp_path), chunk_tokens=32, presets=("raw",), decode_procs=0, device="cpu") as sc:
        bid = sc.register(buf.handle, "m")
        cold = await sc.lookup(bid, TOKENS, FetchOptions(**SLOW_MODEL))
        assert (cold.hit_tokens, cold.preset, cold.lookup_s) == (0, "recompute", None)  # not known yet: no wait
        await sc.catalog.settled()
        warm = await sc.lookup(bid, TOKENS, FetchOptions(**SLOW_MODEL))
        assert (warm.hit_tokens, warm.preset) == (96, "raw")


async def test_a_lookup_may_wait_a_little_for_the_listing(tmp_path, shm):
    buf = await stored_by_another_sidecar(tmp_path, shm)
    async with running(LocalStore(tmp_path), chunk_tokens=32, presets=("raw",), decode_procs=0, device="cpu") as sc:
        bid = sc.register(buf.handle, "m")
        p = await sc.lookup(bid, TOKENS, FetchOptions(**SLOW_MODEL, wait_s=10.0))  # a local store lists in well under that
        assert (p.hit_tokens, p.preset) == (96, "raw")


async def test_an_absence_is_remembered_for_the_negative_ttl(tmp_path, shm):
    async with running(LocalStore(tmp_path), chunk_tokens=32, presets=("raw",), decode_procs=0, device="cpu", negative_ttl_s=0.3) as sc:
        kv = synthetic_kv(layers=2, heads=2, tokens=96, head_dim=32)
        bid = sc.register(shm(kv.shape, kv.dtype).handle, "m")
        assert (await sc.lookup(bid, TOKENS, FetchOptions(wait_s=10.0))).hit_tokens == 0  # listed: absent
        await stored_by_another_sidecar(tmp_path, shm)
        assert (await sc.lookup(bid, TOKENS, FetchOptions(wait_s=10.0))).hit_tokens == 0  # still trusted absent
        await asyncio.sleep(0.35)
        assert (await sc.lookup(bid, TOKENS, FetchOptions(wait_s=10.0))).hit_tokens == 96  # expired: listed again


async def test_the_option_gauges_show_the_last_lookup_only(tmp_path, shm):
    """`kvfetcher_lookup_option_seconds` is the last lookup's reasoning: a lookup that weighs no
    option (a miss) leaves none of an earlier lookup's options behind."""
    buf = await stored_by_another_sidecar(tmp_path, shm)
    async with running(LocalStore(tmp_path), chunk_tokens=32, presets=("raw",), decode_procs=0, device="cpu") as sc:
        bid = sc.register(buf.handle, "m")
        await sc.lookup(bid, TOKENS, FetchOptions(refresh=True, **SLOW_MODEL))
        options = lambda: {s.labels["option"] for m in sc.metrics.registry.collect() if m.name == "kvfetcher_lookup_option_seconds"  # noqa: E731
                           for s in m.samples}
        assert options() == {"recompute", "raw"}
        await sc.lookup(bid, [7, 7, 7] * 32, FetchOptions(refresh=True, **SLOW_MODEL))  # stored nowhere
        assert options() <= {"recompute"}


async def test_a_lookup_the_shortcut_decides_shows_recompute_alone(tmp_path, shm):
    """Where no stored preset could beat recompute (a prefill faster than any read), the lookup
    answers without weighing presets, and says so: recompute is its only option."""
    buf = await stored_by_another_sidecar(tmp_path, shm)
    async with running(LocalStore(tmp_path), chunk_tokens=32, presets=("raw",), decode_procs=0, device="cpu") as sc:
        bid = sc.register(buf.handle, "m")
        p = await sc.lookup(bid, TOKENS, FetchOptions(recompute_tokens_per_s=1e15))
        assert (p.preset, p.reason, set(p.options)) == ("recompute", "cost_model", {"recompute"}), p
