"""The sidecar over real HTTP (TCP and Unix socket) with a real S3 server: API, auth, back-pressure."""

import json
import time

import pytest
import torch

from kvfetcher.api.client import KVClient, SidecarError
from kvfetcher.api.schemas import StoreReply
from kvfetcher.fetch.prefill import PrefillModel
from kvfetcher.fetch.plan import FetchOptions

from kvtest import TOKEN, raw_request, sidecar, synthetic_kv, unreachable_s3

FP = "test-model"


@pytest.fixture
def buf(shm):
    return shm((2, 2, 2, 256, 32))


def test_store_then_load_round_trip_and_metrics(s3, buf):
    kv = synthetic_kv(layers=2, heads=2, tokens=256, head_dim=32)
    tokens = list(range(1000, 1256))
    with sidecar(s3, chunk_tokens=64, presets=("raw", "q8")) as sc:
        c = KVClient(socket_path=sc.socket)
        bid = c.register(buf.handle, FP)
        assert c.hit_tokens(bid, tokens) == 0
        buf.tensor[:, :, :, :256] = kv
        assert c.store(bid, tokens[:250]) == StoreReply(queued_chunks=3, dropped=False)  # complete chunks only
        buf.tensor.zero_()  # the sidecar copied at request time: the model may reuse its buffer at once
        c.flush()
        assert c.hit_tokens(bid, tokens) == 192
        assert c.hit_tokens(None, tokens, model=FP, dtype="float16") == 192  # a scheduler without buffers
        assert c.hit_tokens(None, tokens, model=FP, dtype="float16", tp_rank=1, kv_shape=(2, 2, 32)) == 0  # another TP rank's namespace
        assert len(s3.list("kv/")) == 6  # two representations of three chunks
        raw = json.loads(raw_request(sc.where["port"], "POST", "/v1/fetch", json.dumps({"buffer": bid, "tokens": tokens, "offset": 0, "options": {"recompute_tokens_per_s": 1}}),
                                     {"Authorization": f"Bearer {TOKEN}"})[1])
        assert (raw["loaded_tokens"], raw["not_loaded"]) == (192, [192, 256])  # chunk 4 was never stored
        assert 0 < raw["lookup_s"] < 30  # the listing's share of the fetch
        # a slow model (1 token/s) makes fetching the cost model's choice whatever this machine's load
        r = c.fetch(bid, tokens[:240], offset=10, options=FetchOptions(recompute_tokens_per_s=1.0))  # whole chunks only: 192 of 240
        assert (r.loaded_tokens, r.requested_tokens, r.error) == (192, 192, None)
        assert r.decision.preset in ("raw", "q8") and set(r.decision.options) == {"raw", "q8", "recompute"}
        got = buf.tensor[:, :, :, 10:202]
        if r.decision.preset == "raw":
            assert torch.equal(got, kv[:, :, :, :192])
        assert (got.float() - kv[:, :, :, :192].float()).abs().max() < 0.1
        # re-storing is a no-op: nothing more is written
        written = s3.list("kv/")
        c.store(bid, tokens[:250])
        c.flush()
        assert s3.list("kv/") == written
        text = c.metrics()
    for name in [
        "kvfetcher_lookups_total 4.0",
        "kvfetcher_hit_tokens_total 384.0",
        "kvfetcher_bytes_read_total",
        "kvfetcher_bytes_written_total",
        'kvfetcher_compression_ratio{preset="q8"}',
        "kvfetcher_decode_bytes_per_second",
        "kvfetcher_preset_decisions_total",
        "kvfetcher_fetch_seconds_count 2.0",
        "kvfetcher_lookup_seconds_count",
        "kvfetcher_store_seconds_count",
        "kvfetcher_store_queue_depth 0.0",
        "kvfetcher_fetch_predicted_seconds_count 2.0",
        "kvfetcher_fetch_actual_seconds_count 2.0",
        "kvfetcher_cost_model_fit{preset=",
        "kvfetcher_cost_model_overhead_seconds{preset=",
        "kvfetcher_cost_model_ratio{preset=",
        'kvfetcher_fetch_stage_chunks_in_flight{stage="written"}',  # where the last fetch's chunks spent their time
        'kvfetcher_fetch_stage_median_seconds{stage="read"}',
    ]:
        assert name in text, name


def test_cost_model_can_choose_recompute(s3, buf):
    kv = synthetic_kv(layers=2, heads=2, tokens=128, head_dim=32)
    tokens = list(range(128))
    with sidecar(s3, chunk_tokens=64) as sc:
        c = KVClient(socket_path=sc.socket)
        bid = c.register(buf.handle, FP)
        buf.tensor[:, :, :, :128] = kv
        c.store(bid, tokens)
        c.flush()
        buf.tensor.fill_(7)
        r = c.fetch(bid, tokens, options=FetchOptions(recompute_tokens_per_s=1e12))  # a model that prefills instantly
        assert (r.loaded_tokens, r.reason, r.error, r.decision.preset) == (0, "cost_model", None, "recompute")
        assert bool((buf.tensor == 7).all())
        assert 'kvfetcher_fallbacks_total{reason="cost_model"} 1.0' in c.metrics()
        # the engine's prefill model wins over a constant rate: with attention this costly, 128 tokens take hours
        r = c.fetch(bid, tokens, options=FetchOptions(recompute_tokens_per_s=1e12, prefill_model=PrefillModel(c2=1.0)))
        assert r.loaded_tokens == 128 and r.decision.options["recompute"] == pytest.approx(128 * 64)
        assert 'kvfetcher_prefill_model{term="c2"} 1.0' in c.metrics()
        # what a load costs the engine is paid by every load option: 128 tokens of 64 s each do not pay 10^4 s
        r = c.fetch(bid, tokens, options=FetchOptions(prefill_model=PrefillModel(c2=1.0), load_overhead_s=1e4))
        assert r.loaded_tokens == 0 and r.decision.preset == "recompute"
        assert "kvfetcher_load_overhead_seconds 10000.0" in c.metrics()
        # nor while the engine's prefill model is off by more than the load would win by
        r = c.fetch(bid, tokens, options=FetchOptions(prefill_model=PrefillModel(c2=1.0), prefill_error=1.0))
        assert r.decision.preset != "recompute" and "kvfetcher_prefill_error_ratio 1.0" in c.metrics()  # hours against ms: capped, still a win
        buf.tensor.fill_(7)
        # on a busy GPU the model server gives a TTFT budget: a fetch within it wins anyway
        r = c.fetch(bid, tokens, options=FetchOptions(recompute_tokens_per_s=1e12, ttft_budget_s=30.0))
        assert r.loaded_tokens == 128 and r.decision.preset != "recompute"
        assert torch.equal(buf.tensor[:, :, :, :128], kv)
        for bad in (-1, "2s", True):
            with pytest.raises(SidecarError, match="ttft_budget_s"):
                c.fetch(bid, tokens, options=FetchOptions(ttft_budget_s=bad))


def test_allowed_presets_bound_the_choice(s3, buf):
    kv = synthetic_kv(layers=2, heads=2, tokens=128, head_dim=32)
    tokens = list(range(128))
    with sidecar(s3, chunk_tokens=64, presets=("raw", "q8"), allowed_presets=("q8",)) as sc:
        c = KVClient(socket_path=sc.socket)
        bid = c.register(buf.handle, FP)
        buf.tensor[:, :, :, :128] = kv
        c.store(bid, tokens)
        c.flush()
        r = c.fetch(bid, tokens, options=FetchOptions(recompute_tokens_per_s=1.0))
        assert r.decision.preset == "q8" and "raw" not in r.decision.options
        r = c.fetch(bid, tokens, options=FetchOptions(recompute_tokens_per_s=1.0, presets=["raw"]))  # not allowed here
        assert r.decision.preset == "recompute" and r.loaded_tokens == 0


def test_auth_tcp_token_and_unix_socket(s3, buf, tmp_path):
    sock = str(tmp_path / "run" / "kvfetcher.sock")
    with sidecar(s3, socket_path=sock, chunk_tokens=64) as sc:
        port = sc.where["port"]
        body = json.dumps({"handle": buf.handle, "model": FP})
        assert raw_request(port, "POST", "/v1/buffers", body)[0] == 401
        status, reply = raw_request(port, "POST", "/v1/buffers", body, {"Authorization": "Bearer wrong"})
        assert status == 401 and json.loads(reply)["error"] == "unauthenticated"
        with pytest.raises(SidecarError) as e:
            KVClient(sc.url, token="nope").hit_tokens("x", [1])
        assert e.value.status == 401
        with pytest.raises(ValueError, match="Unix socket"):  # a host buffer's fd is passed, never over TCP
            KVClient(sc.url, token=TOKEN).register(buf.handle, FP)
        # over the Unix socket, the socket's permissions are the authentication
        assert oct(__import__("os").stat(sock).st_mode & 0o777) == "0o660"
        u = KVClient(socket_path=sock, token="")
        bid = u.register(buf.handle, FP)
        assert u.hit_tokens(bid, list(range(100))) == 0
        # probes and metrics are open
        assert raw_request(port, "GET", "/healthz")[0] == 200
        assert raw_request(port, "GET", "/readyz")[0] == 200
        assert raw_request(port, "GET", "/metrics")[0] == 200


def test_no_configured_token_refuses_tcp(s3, buf):
    with sidecar(s3, token=None) as sc:
        with pytest.raises(SidecarError, match="no token is configured"):
            KVClient(sc.url, token="anything").hit_tokens("x", [1])


@pytest.mark.parametrize(
    "path, body, detail",
    [
        ("/v1/lookup", b"not json", "JSON"),
        ("/v1/lookup", b"[1, 2]", "object"),
        ("/v1/lookup", json.dumps({"buffer": "nope", "tokens": [1]}).encode(), "unknown buffer"),
        ("/v1/lookup", json.dumps({"model": "m", "tokens": [1]}).encode(), "'dtype'"),
        ("/v1/lookup", json.dumps({"model": "m", "dtype": "int8", "tokens": [1]}).encode(), "unsupported dtype"),
        ("/v1/fetch", json.dumps({"buffer": "nope", "tokens": ["a"]}).encode(), "'tokens' must be an array of int64 integers"),
        ("/v1/fetch", json.dumps({"buffer": "b", "tokens": [1], "recompute_tps": 5}).encode(), "unknown field(s) ['recompute_tps']"),
        ("/v1/fetch", json.dumps({"buffer": "b", "tokens": [1], "plan": {"model": "m"}}).encode(), "'dtype' is required in plan"),
        ("/v1/store", json.dumps({"tokens": [1]}).encode(), "'buffer' is required"),
        ("/v1/buffers", json.dumps({"handle": {"kind": "shm", "path": "/etc/passwd", "shape": [1], "dtype": "float16"}, "model": "m"}).encode(), "only a CUDA handle"),
        ("/v1/buffers", json.dumps({"handle": {"kind": "memfd", "pid": 1, "fd": 3}, "model": "m"}).encode(), "only a CUDA handle"),
    ],
)
def test_bad_requests_get_clear_400s(s3, path, body, detail):
    with sidecar(s3) as sc:
        status, reply = raw_request(sc.where["port"], "POST", path, body, {"Authorization": f"Bearer {TOKEN}"})
    assert status == 400, reply
    assert detail in json.loads(reply)["detail"]


def test_bad_slots_are_refused(s3, buf):
    with sidecar(s3, chunk_tokens=64) as sc:
        c = KVClient(socket_path=sc.socket)
        bid = c.register(buf.handle, FP)
        with pytest.raises(SidecarError, match="slots"):
            c.fetch(bid, list(range(128)), offset=200)  # 200 + 128 > 256 slots
        with pytest.raises(SidecarError, match="slots"):
            c.store(bid, list(range(128)), slots=[0] * 128)


def test_store_down_readyz_lookup_and_store(buf):
    with sidecar(unreachable_s3(), chunk_tokens=64) as sc:
        assert raw_request(sc.where["port"], "GET", "/readyz")[0] == 503
        assert raw_request(sc.where["port"], "GET", "/healthz")[0] == 200
        c = KVClient(socket_path=sc.socket)
        bid = c.register(buf.handle, FP)
        assert c.hit_tokens(bid, list(range(128))) == 0
        r = c.fetch(bid, list(range(128)))
        assert (r.loaded_tokens, r.error) == (0, "store_down")
        assert c.store(bid, list(range(128))).queued_chunks == 2  # accepted; the upload fails later...
        c.flush()
        assert 'kvfetcher_errors_total{reason="store_down"}' in c.metrics()  # ...and is counted


def test_store_queue_is_bounded_and_never_blocks(s3, buf):
    with sidecar(s3, chunk_tokens=64, presets=("q8",), store_queue_chunks=4) as sc:
        c = KVClient(socket_path=sc.socket)
        bid = c.register(buf.handle, FP)
        buf.tensor.copy_(synthetic_kv(layers=2, heads=2, tokens=256, head_dim=32))
        t = time.perf_counter()
        replies = [c.store(bid, list(range(i, i + 256))) for i in range(3)]  # 4 chunks each
        assert time.perf_counter() - t < 1.0  # encoding runs in the background
        assert [r.dropped for r in replies] == [False, True, True]
        assert "kvfetcher_store_dropped_chunks_total 8.0" in c.metrics()
        c.flush()
        assert "kvfetcher_store_queue_depth 0.0" in c.metrics()
        assert len(s3.list("kv/")) == 4


def counting_lists(store):
    """``store`` with its LIST requests of chunks counted (the real store answers them)."""
    calls = []
    real = store.list

    def list_(prefix):
        if prefix.startswith("kv/"):  # not a registration's look for its model's calibration
            calls.append(prefix)
        return real(prefix)

    store.list = list_
    return calls


def test_a_load_given_a_plan_does_not_list_again(s3, buf):
    kv = synthetic_kv(layers=2, heads=2, tokens=192, head_dim=32)
    tokens = list(range(192))
    lists = counting_lists(s3)
    with sidecar(s3, chunk_tokens=64, presets=("raw",)) as sc:
        c = KVClient(socket_path=sc.socket)
        bid = c.register(buf.handle, FP)
        buf.tensor[:, :, :, :192] = kv
        c.store(bid, tokens)
        c.flush()
        buf.tensor.zero_()
        lists.clear()
        plan = c.lookup(bid, tokens, options=FetchOptions(recompute_tokens_per_s=1.0))
        assert len(lists) == 0  # its own writes: answered from the sidecar's index
        assert (plan.preset, plan.hit_tokens, plan.loaded_tokens, [p for p, _ in plan.chunks]) == ("raw", 192, 192, ["raw"] * 3)
        assert plan.predicted_s > 0 and plan.lookup_s is None and plan.reason is None
        r = c.fetch(bid, tokens, plan, offset=8)
        assert len(lists) == 0  # the load listed nothing
        assert (r.loaded_tokens, r.error, r.decision.preset, r.not_loaded) == (192, None, "raw", (192, 192))
        assert torch.equal(buf.tensor[:, :, :, 8:200], kv)
        r = c.fetch(bid, tokens, options=FetchOptions(recompute_tokens_per_s=1.0))  # without a plan: it plans, from the index
        assert len(lists) == 0 and r.loaded_tokens == 192
        # a scheduler without buffers gets the plan of the namespace's registered buffer
        assert c.lookup(None, tokens, model=FP, dtype="float16", options=FetchOptions(recompute_tokens_per_s=1.0)).preset == "raw"
        # without one, the hit only; a load given that plan chooses for its buffer
        c.unregister(bid)
        listed = c.lookup(None, tokens, model=FP, dtype="float16", kv_shape=(2, 2, 32), options=FetchOptions(recompute_tokens_per_s=1.0))
        assert (listed.preset, listed.hit_tokens, listed.chunks, len(lists)) == (None, 192, (), 0)
        r = c.fetch(c.register(buf.handle, FP), tokens, listed, options=FetchOptions(recompute_tokens_per_s=1.0))
        assert (r.loaded_tokens, r.decision.preset, len(lists)) == (192, "raw", 0)
    with sidecar(s3, chunk_tokens=64, presets=("raw",)) as sc:  # a sidecar that did not write them: its index knows nothing
        c = KVClient(socket_path=sc.socket)
        bid = c.register(buf.handle, FP)
        lists.clear()
        refreshed = c.lookup(bid, tokens, options=FetchOptions(recompute_tokens_per_s=1.0, refresh=True))
        assert (refreshed.preset, refreshed.hit_tokens, len(lists)) == ("raw", 192, 3)  # one LIST per chunk, then known
        assert refreshed.lookup_s > 0
        assert c.lookup(bid, tokens, options=FetchOptions(recompute_tokens_per_s=1.0)).hit_tokens == 192 and len(lists) == 3


def test_a_plan_is_checked_before_it_is_trusted(s3, buf):
    from dataclasses import replace

    kv = synthetic_kv(layers=2, heads=2, tokens=128, head_dim=32)
    tokens = list(range(128))
    with sidecar(s3, chunk_tokens=64) as sc, sidecar(s3, chunk_tokens=64) as other:
        c = KVClient(socket_path=sc.socket)
        bid = c.register(buf.handle, FP)
        buf.tensor[:, :, :, :128] = kv
        c.store(bid, tokens)
        c.flush()
        plan = c.lookup(bid, tokens, options=FetchOptions(recompute_tokens_per_s=1.0))
        assert plan.loaded_tokens == 128
        o = KVClient(socket_path=other.socket)
        forged = [
            (tokens[:64] + [7] * 64, plan, "other tokens"),  # another prompt's plan
            (tokens, replace(plan, chunks=((plan.preset, 10**9),) * 2), "not issued by this sidecar"),  # sizes changed
            (tokens, replace(plan, model="another-model"), "not issued by this sidecar"),
            (tokens, o.lookup(o.register(buf.handle, FP), tokens), "not issued by this sidecar"),  # another sidecar's
        ]
        for toks, p, detail in forged:
            with pytest.raises(SidecarError, match=detail) as e:
                c.fetch(bid, toks, p)
            assert e.value.status == 400
        other_model = c.register(buf.handle, "another-model")
        with pytest.raises(SidecarError, match="another namespace"):
            c.fetch(other_model, tokens, plan)
        with pytest.raises(SidecarError, match="belong to the plan"):
            c.fetch(bid, tokens, plan, options=FetchOptions(recompute_tokens_per_s=1.0))
        assert s3.exists(f"kv/{plan.prefix_key[:2]}/{plan.prefix_key}/{plan.preset}.kvfc")  # nothing was dropped
        assert c.fetch(bid, tokens, plan).loaded_tokens == 128
