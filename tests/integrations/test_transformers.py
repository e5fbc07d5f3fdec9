"""End to end with the real model, a real S3 server and real HTTP: a stored prefix gives the same
generation as a recompute; every fault ends in a recompute with the same output; 16 concurrent
fetches of different prefixes never cross-talk."""

import threading

import pytest
import torch

from kvfetcher import ipc, keys
from kvfetcher.eval import model
from kvfetcher.chunk import decode_chunk, encode_chunk
from kvfetcher.api.client import KVClient
from kvfetcher.integrations.transformers import CachedLM
from kvfetcher.store.s3 import S3Store
from kvfetcher.fetch.plan import FetchOptions

from kvtest import CHUNK, NEW, TOKEN, flip, new_bucket, sidecar, unreachable_s3

pytestmark = pytest.mark.slow

SLOW_MODEL_TPS = 50.0  # tell the cost model prefill is slow, so that a fetch is always attempted


def cached_lm(lm, sc, **kw):
    return CachedLM(lm.model, lm.fingerprint, KVClient(socket_path=sc.socket), capacity_tokens=512, **kw)


def test_store_then_fetch_gives_identical_generation(lm, prompt, s3):
    ids, _, reference = prompt
    with sidecar(s3, presets=("q8",)) as a, sidecar(s3, presets=("q8",)) as b:
        ga = cached_lm(lm, a).generate(ids, NEW)
        assert ga.loaded_tokens == 0 and ga.tokens == reference
        assert ga.store.queued_chunks == len(ids) // CHUNK
        KVClient(a.url, token=TOKEN).flush()
        gb = cached_lm(lm, b, recompute_tps=SLOW_MODEL_TPS).generate(ids, NEW, store=False)
        assert "kvfetcher_lookup_seconds_count 1.0" in KVClient(b.url, token=TOKEN).metrics()  # the prefix listed once
    assert gb.fetch.error is None and gb.fetch.decision.preset == "q8"
    assert gb.loaded_tokens == (len(ids) - 1) // CHUNK * CHUNK
    assert gb.computed_tokens == len(ids) - gb.loaded_tokens
    assert gb.tokens == ga.tokens


# --- faults -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def objects(lm, prompt):
    """The prompt's chunks as stored objects (raw: quick to make), by chunk key."""
    ids, kv, _ = prompt
    ns = keys.Namespace(model=lm.fingerprint, dtype="float16", shape=(kv.shape[0], kv.shape[2], kv.shape[4]))
    ck = keys.chunk_keys(ns, ids.tolist(), CHUNK)
    return [(keys.object_name(k, "raw"), encode_chunk(kv[:, :, :, i * CHUNK : (i + 1) * CHUNK].contiguous(), "raw", lm.fingerprint)) for i, k in enumerate(ck)]


def put_all(store, objects):
    for name, data in objects:
        store.put(name, data)


def test_fault_store_down(lm, prompt):
    ids, _, reference = prompt
    with sidecar(unreachable_s3()) as sc:
        g = cached_lm(lm, sc, recompute_tps=SLOW_MODEL_TPS).generate(ids, NEW, store=False)
        assert g.loaded_tokens == 0 and g.tokens == reference
        assert 'kvfetcher_errors_total{reason="store_down"}' in KVClient(sc.url, token=TOKEN).metrics()


def test_fault_sidecar_gone(lm, prompt, s3):
    ids = prompt[0][:CHUNK + 16]  # shorter: this case needs a full prefill twice
    reference = model.greedy(lm, ids, model.prefill(lm, ids)[0], NEW)
    with sidecar(s3) as sc:
        m = cached_lm(lm, sc, recompute_tps=SLOW_MODEL_TPS)
    g = m.generate(ids, NEW)  # the sidecar has stopped: lookup, load and store all fail to connect
    assert (g.loaded_tokens, g.fetch, g.store) == (0, None, None)
    assert g.tokens == reference


@pytest.mark.parametrize(
    "fault, reason",
    [("corrupted", "corrupt"), ("truncated", "truncated"), ("other_model", "fingerprint"), ("deleted_mid_fetch", "missing")],
)
def test_fault_falls_back_to_recompute(lm, prompt, objects, s3_endpoint, slow_proxy, fault, reason):
    ids, _, reference = prompt
    direct = new_bucket(s3_endpoint)
    put_all(direct, objects)
    bad_name, bad_data = objects[1]
    if fault == "corrupted":
        direct.delete(bad_name)
        direct.put(bad_name, flip(bad_data, len(bad_data) - 100))
    elif fault == "truncated":
        direct.delete(bad_name)
        direct.put(bad_name, bad_data[: len(bad_data) // 2])
    elif fault == "other_model":
        _, kv, _ = prompt
        direct.delete(bad_name)
        direct.put(bad_name, encode_chunk(kv[:, :, :, CHUNK : 2 * CHUNK].contiguous(), "raw", "some-other-model"))
    proxy = slow_proxy()
    if fault == "deleted_mid_fetch":
        done = []

        def delete_once(method, path, rng):  # the header has been read; the segments are next
            if method == "GET" and path.endswith(bad_name) and rng and not rng.startswith("bytes=0-") and not done:
                direct.delete(bad_name)
                done.append(path)

        proxy.hook = delete_once
    store = S3Store(proxy.endpoint, direct.bucket, "testing", "testing")
    with sidecar(store) as sc:
        g = cached_lm(lm, sc, recompute_tps=SLOW_MODEL_TPS).generate(ids, NEW, store=False)
        metrics = KVClient(sc.url, token=TOKEN).metrics()
    assert g.fetch is not None and g.fetch.error == reason, g.fetch
    assert g.loaded_tokens == CHUNK  # chunk 0 is good; chunk 1 is not, so it and what follows are recomputed
    assert g.computed_tokens == len(ids) - CHUNK
    assert g.tokens == reference
    assert f'kvfetcher_fallbacks_total{{reason="{reason}"}} 1.0' in metrics
    # the good chunk is kept; a bad object is dropped so that the next store can write it anew
    assert direct.exists(objects[0][0])
    assert not direct.exists(bad_name)


def test_fault_slow_link_past_the_deadline(lm, prompt, objects, s3_endpoint, slow_proxy):
    ids, _, reference = prompt
    direct = new_bucket(s3_endpoint)
    put_all(direct, objects)
    proxy = slow_proxy(bytes_per_s=2e6)  # a raw chunk is ~3 MB: 1.5 s each
    store = S3Store(proxy.endpoint, direct.bucket, "testing", "testing")
    with sidecar(store) as sc:
        g = cached_lm(lm, sc, recompute_tps=SLOW_MODEL_TPS).generate(ids, NEW, store=False, deadline_s=0.5)
    assert g.fetch.error == "deadline"
    assert g.fetch.seconds < 1.5
    assert g.loaded_tokens < len(ids) // CHUNK * CHUNK
    assert g.tokens == reference
    assert all(direct.exists(n) for n, _ in objects)  # a slow link loses nothing


def test_a_dropped_bad_object_is_repaired_by_the_next_store(lm, prompt, objects, s3):
    ids, _, reference = prompt
    put_all(s3, objects)
    bad_name, bad_data = objects[1]
    s3.delete(bad_name)
    s3.put(bad_name, flip(bad_data, len(bad_data) // 2))
    with sidecar(s3) as sc:
        m = cached_lm(lm, sc, recompute_tps=SLOW_MODEL_TPS)
        first = m.generate(ids, NEW)  # falls back at chunk 1, then stores the prompt again
        KVClient(sc.url, token=TOKEN).flush()
        second = m.generate(ids, NEW, store=False)
    assert first.fetch.error == "corrupt" and first.tokens == reference
    assert second.fetch.error is None and second.loaded_tokens == len(objects) * CHUNK
    assert second.tokens == reference
    # rewritten from the second prefill (on top of the fp16 chunk 0, so close to, not equal to, the first)
    _, kv, _ = prompt
    rewritten = decode_chunk(s3.get(bad_name), lm.fingerprint)
    assert torch.allclose(rewritten.float(), kv[:, :, :, CHUNK : 2 * CHUNK].float(), rtol=0.02, atol=0.02)


# --- concurrency ----------------------------------------------------------------------------


def test_16_concurrent_fetches_of_different_prefixes_never_cross_talk(lm, prompt, s3):
    _, kv, _ = prompt
    L, _, H, _, D = kv.shape
    n, chunk, length = 16, 64, 192
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (length,), generator=gen).tolist() for _ in range(n)]
    # distinct real KV per prefix: the model's KV shifted along the tokens by a different amount
    kvs = [torch.roll(kv[:, :, :, :length], shifts=7 * i + 1, dims=3).contiguous() for i in range(n)]
    with sidecar(s3, chunk_tokens=chunk, window=2) as sc:
        writer = KVClient(socket_path=sc.socket)
        wbuf = ipc.allocate((L, 2, H, length, D), torch.float16)
        wid = writer.register(wbuf.handle, lm.fingerprint)
        for p, k in zip(prompts, kvs):
            wbuf.tensor.copy_(k)
            assert writer.store(wid, p).queued_chunks == 3
        writer.flush()
        bufs = [ipc.allocate((L, 2, H, length + 32, D), torch.float16) for _ in range(n)]
        results = [None] * n

        def fetch(i):
            c = KVClient(socket_path=sc.socket)
            bid = c.register(bufs[i].handle, lm.fingerprint)
            results[i] = c.fetch(bid, prompts[i], offset=i % 32, options=FetchOptions(recompute_tokens_per_s=SLOW_MODEL_TPS))

        threads = [threading.Thread(target=fetch, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i in range(n):
        assert results[i].error is None and results[i].loaded_tokens == length, results[i]
        assert torch.equal(bufs[i].tensor[:, :, :, i % 32 : i % 32 + length], kvs[i]), f"prefix {i} got another's KV"
        bufs[i].close()
    wbuf.close()
