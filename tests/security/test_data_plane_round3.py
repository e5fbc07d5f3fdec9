"""The data plane's third-round findings: request bodies bounded by the token cap and parsed off
the event loop; registrations bounded, received within one deadline, and deep JSON a bad request;
a stale plan never deletes the object another writer stored since."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch

from kvfetcher import ipc, keys
from kvfetcher.api import server
from kvfetcher.api.server import Embedded
from kvfetcher.chunk import encode_chunk
from kvfetcher.config import Config
from kvfetcher.errors import RequestError
from kvfetcher.service import Sidecar
from kvfetcher.store.local import LocalStore
from kvfetcher.fetch.plan import FetchOptions
from kvtest import rewrite_header, synthetic_kv

FP = "model/fp16"
N = 32
TOKENS = list(range(1000, 1000 + 4 * N))


@pytest.fixture
def shm(shm):
    """KV buffers of this module's geometry, filled with synthetic KV (``seed``)."""
    return lambda heads=2, capacity=4 * N, seed=0: shm((2, 2, heads, capacity, 16), fill=synthetic_kv(
        layers=2, heads=heads, tokens=capacity, head_dim=16, seed=seed))


def sidecar(store, **kw) -> Sidecar:
    return Sidecar(store, Config(**{"chunk_tokens": N, "presets": ("raw",), "decode_procs": 0, "warm_up": False, **kw}))


def post(port: int, path: str, data: bytes) -> int:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, data, {"Authorization": "Bearer t", "Content-Type": "application/json"})
        return conn.getresponse().status
    except (ConnectionError, OSError):  # the server may close the connection on a body over its limit
        return 413
    finally:
        conn.close()


# --- finding 4: bodies ---------------------------------------------------------------------------


def test_the_body_limit_follows_the_token_cap_and_large_bodies_are_parsed_off_the_loop(tmp_path, monkeypatch):
    threads = []
    decode = server._decode
    monkeypatch.setattr(server, "_decode", lambda raw, cls: (threads.append(threading.get_ident()), decode(raw, cls))[1])
    with Embedded(sidecar(LocalStore(tmp_path / "store"), max_request_tokens=20_000), "t") as e:
        port = e.where["port"]
        model = {"model": FP, "dtype": "float16", "kv_shape": [2, 2, 16]}
        assert post(port, "/v1/lookup", json.dumps(model | {"tokens": [1]}).encode()) == 200
        assert post(port, "/v1/lookup", json.dumps(model | {"tokens": [2**62] * 20_000}).encode()) == 200
        assert threads[0] != threads[1]  # the large one in a worker thread, the small one on the loop
        over = server.body_limit(20_000) + 1
        assert post(port, "/v1/lookup", b" " * over) == 413


# --- finding 5: registrations --------------------------------------------------------------------


async def test_registrations_are_bounded_and_the_least_recently_used_goes_first(tmp_path, shm, monkeypatch):
    from kvfetcher import service

    monkeypatch.setattr(service, "MAX_BUFFERS", 2)
    sc = sidecar(LocalStore(tmp_path / "store"))
    await sc.start()
    try:
        a, b = sc.register(shm().handle, FP), sc.register(shm().handle, FP)
        await sc.lookup(a, TOKENS)  # a used since b registered
        c = sc.register(shm().handle, FP)
        assert set(sc.buffers) == {a, c}
        with pytest.raises(RequestError, match="unknown buffer"):
            await sc.lookup(b, TOKENS)
    finally:
        await sc.close()


def test_a_registration_is_received_within_one_deadline_however_the_client_paces_it():
    ours, theirs = socket.socketpair()
    stop = threading.Event()

    def drip():  # one byte every 0.1 s, forever: each receive alone would be within any per-receive timeout
        socket.send_fds(theirs, [b"{"], [])
        while not stop.wait(0.1):
            try:
                theirs.send(b" ")
            except OSError:
                return

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            ipc.receive_buffer(ours, 0.5)
        assert time.monotonic() - t0 < 1.5
    finally:
        stop.set()
        ours.close()
        theirs.close()


def test_deep_json_on_the_buffer_socket_is_a_malformed_message():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"[" * 60_000)
        theirs.shutdown(socket.SHUT_WR)
        with pytest.raises(ValueError):  # was a RecursionError, answered `internal` with a trace
            ipc.receive_buffer(ours, 5.0)


# --- finding 6: a stale plan ---------------------------------------------------------------------


async def test_a_stale_plan_does_not_delete_the_object_stored_again_since(tmp_path, shm):
    store = LocalStore(tmp_path / "store")
    sc = sidecar(store, presets=("q8",))
    await sc.start()
    try:
        bid = sc.register(shm().handle, FP)
        await sc.store(bid, TOKENS)
        await sc.flush()
        plan = await sc.lookup(bid, TOKENS, options=FetchOptions(recompute_tokens_per_s=1e-9))
        name = keys.object_name(keys.chunk_keys(sc.buffers[bid].ns, TOKENS, N)[0], "q8")
        again = encode_chunk(synthetic_kv(layers=2, heads=2, tokens=N, head_dim=16, seed=9) * 50, "q8", FP)
        assert len(again) != store.list(name)[name]
        store.delete(name)  # evicted, and stored again by another writer
        store.put(name, again)
        r = await sc.fetch(bid, TOKENS, plan)
        assert r.loaded_tokens == 0 and store.get(name) == again  # kept
        # a truly truncated object (the plan lists what is there) is still dropped
        store.delete(name)
        store.put(name, again[: len(again) // 2])
        r = await sc.fetch(bid, TOKENS, await sc.lookup(bid, TOKENS, options=FetchOptions(recompute_tokens_per_s=1e-9, refresh=True)))
        assert r.loaded_tokens == 0 and not store.exists(name)
    finally:
        await sc.close()


# --- finding 7: the Lows ---------------------------------------------------------------------------


def test_a_header_with_rope_bases_for_other_layers_is_corrupt_so_its_prefix_heals():
    from kvfetcher.format import container

    obj = encode_chunk(synthetic_kv(layers=2, heads=2, tokens=N, head_dim=16), "lean", FP, rope_theta=(1e4, 1e6))
    assert container.parse_header(obj).layout.rope_theta == (1e4, 1e6)
    bad = rewrite_header(obj, lambda d: d["layout"].update(rope_theta=[1e4, 1e6, 1e6]))
    with pytest.raises(container.CorruptError, match="3 RoPE bases for 2 layers"):
        container.parse_header(bad)


def test_running_without_an_object_key_says_so(tmp_path, caplog):
    with caplog.at_level("WARNING", "kvfetcher.service"):
        sidecar(LocalStore(tmp_path / "a"))
    assert "no object key" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", "kvfetcher.service"):
        sidecar(LocalStore(tmp_path / "b"), object_key="a pool's object key, 32+ chars")
    assert "no object key" not in caplog.text


async def test_unknown_preset_names_are_refused(tmp_path, shm):
    sc = sidecar(LocalStore(tmp_path / "store"))
    await sc.start()
    try:
        bid = sc.register(shm().handle, FP)
        with pytest.raises(ValueError, match="unknown preset"):  # refused where the options are made (the API: a 400)
            await sc.lookup(bid, TOKENS, options=FetchOptions(presets=["raw", "rwa"]))
        assert (await sc.lookup(bid, TOKENS, options=FetchOptions(presets=["raw"]))).hit_tokens == 0
    finally:
        await sc.close()


def test_the_writer_remembers_a_bounded_number_of_models(tmp_path):
    from kvfetcher.save import writer

    sc = sidecar(LocalStore(tmp_path / "store"), presets=("raw", "balanced"))
    for i in range(writer.MAX_MODELS + 50):
        sc.writer.presets_for(f"model-{i}/fp16")
    assert len(sc.writer._refused) <= writer.MAX_MODELS


# --- finding 7: key rotation -------------------------------------------------------------------------

OLD, NEW = "the pool's old object key, 32+ chars", "the pool's new object key, 32+ chars"


async def test_during_a_key_rotation_sidecars_neither_delete_nor_lose_each_others_objects(tmp_path, shm):
    """New sidecars write under the new key and still read the old key's objects; an old sidecar meets
    a new-key object as a miss (other_key), never deleting it as unauthenticated."""
    store = LocalStore(tmp_path / "store")
    old = sidecar(store, object_key=OLD)
    new = sidecar(store, object_key=NEW, accepted_object_keys=(OLD,))
    await old.start()
    await new.start()
    try:
        a, b = old.register(shm().handle, FP), new.register(shm().handle, FP)
        await old.store(a, TOKENS[: 2 * N])  # the old key's chunks 0-1
        await old.flush()
        assert (await new.fetch(b, TOKENS[: 2 * N], options=FetchOptions(recompute_tokens_per_s=1e-9))).loaded_tokens == 2 * N  # accepted
        await new.store(b, TOKENS)  # the new key's chunks 2-3
        await new.flush()
        listed = store.list("kv/")
        r = await old.fetch(a, TOKENS, options=FetchOptions(recompute_tokens_per_s=1e-9))
        assert (r.loaded_tokens, r.error) == (2 * N, "other_key") and store.list("kv/") == listed  # nothing deleted
        assert (await new.fetch(b, TOKENS, options=FetchOptions(recompute_tokens_per_s=1e-9))).loaded_tokens == len(TOKENS)
    finally:
        await old.close()
        await new.close()


def test_a_calibration_tagged_under_an_accepted_key_is_taken(tmp_path, monkeypatch):
    from kvfetcher.format import calibration, mac, presets

    monkeypatch.setenv("KVFETCHER_CALIBRATION_DIR", str(tmp_path / "local"))
    presets.for_model.cache_clear()
    store = LocalStore(tmp_path / "store")
    doc = calibration.artefact("tiny-lm", {"basis": {"layers": [[1e-4, 2e-4]] * 2}}, None, (2, 2, 16), None, None)
    path = calibration.write(doc, tmp_path / "made")
    calibration.publish(store, path, None, mac.key_from(OLD))
    assert calibration.fetch(store, "tiny-lm/fp16", mac.key_from(NEW)) is None
    assert calibration.fetch(store, "tiny-lm/fp16", mac.key_from(NEW), accepted=(mac.key_from(OLD),)).name == path.stem
    presets.for_model.cache_clear()


def test_accepted_keys_need_a_writing_key_and_stay_out_of_reprs():
    with pytest.raises(ValueError, match="needs KVFETCHER_OBJECT_KEY"):
        Config(accepted_object_keys=(OLD,)).validate()
    with pytest.raises(ValueError, match="at least 16"):
        Config(object_key=NEW, accepted_object_keys=("short",)).validate()
    assert OLD not in repr(Config(object_key=NEW, accepted_object_keys=(OLD,)))
