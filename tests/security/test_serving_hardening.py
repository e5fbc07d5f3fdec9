"""The sidecar's serving path against careless and
hostile clients and a failing store. Real sidecars, real local stores, real HTTP."""

from __future__ import annotations

import asyncio
import errno
import http.client
import json
import subprocess
import threading
import time

import pytest
import torch

from kvfetcher import keys
from kvfetcher.api.client import KVClient
from kvfetcher.api.server import Embedded, Token
from kvfetcher.chunk import encode_chunk
from kvfetcher.config import Config
from kvfetcher.errors import RequestError
from kvfetcher.service import Sidecar
from kvfetcher.store import ReadOnly, StoreError, StoreFull, from_os_error
from kvfetcher.store.local import LocalStore
from kvfetcher.fetch.plan import FetchOptions
from kvtest import synthetic_kv

FP = "model/fp16"
N = 32  # tokens per chunk
TOKENS = list(range(1000, 1000 + 8 * N))


@pytest.fixture
def shm(shm):
    """KV buffers of this module's geometry, filled with synthetic KV."""
    return lambda heads=2, capacity=8 * N: shm((2, 2, heads, capacity, 16), fill=synthetic_kv(layers=2, heads=heads, tokens=capacity, head_dim=16))


def sidecar(store, **kw) -> Sidecar:
    return Sidecar(store, Config(**{"chunk_tokens": N, "presets": ("raw",), "decode_procs": 0, "warm_up": False, **kw}))


async def started(store, **kw) -> Sidecar:
    sc = sidecar(store, **kw)
    await sc.start()
    return sc


def request(port, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest(method, path)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.putheader("Content-Length", str(len(data or b"")))
        conn.endheaders(data)
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


# --- geometry in the namespace ----------------------------------------------------------------


async def test_differently_shaped_buffers_never_share_or_delete_chunks(tmp_path, shm):
    store = LocalStore(tmp_path)
    sc = await started(store)
    try:
        a, b = sc.register(shm(heads=2).handle, FP), sc.register(shm(heads=4).handle, FP)
        await sc.store(a, TOKENS)
        await sc.flush()
        stored = store.list("kv/")
        r = await sc.fetch(b, TOKENS)  # same model and dtype, other geometry: a clean miss
        assert (r.loaded_tokens, r.reason, r.error) == (0, "miss", None)
        assert store.list("kv/") == stored  # nothing deleted
        assert (await sc.fetch(a, TOKENS)).loaded_tokens == len(TOKENS)
    finally:
        await sc.close()


async def test_a_chunk_that_does_not_fit_is_a_miss_and_is_never_deleted(tmp_path, shm):
    store = LocalStore(tmp_path)
    sc = await started(store)
    try:
        bid = sc.register(shm(heads=2).handle, FP)
        key = keys.chunk_keys(sc.buffers[bid].ns, TOKENS, N)[0]
        other = encode_chunk(synthetic_kv(layers=2, heads=4, tokens=N, head_dim=16), "raw", FP)  # another geometry
        store.put(keys.object_name(key, "raw"), other)
        r = await sc.fetch(bid, TOKENS[:N])
        assert (r.loaded_tokens, r.reason) == (0, "geometry")
        assert store.exists(keys.object_name(key, "raw"))
    finally:
        await sc.close()


# --- separate I/O pools, deadlines, abandoned work cancelled ------------------------------------


class StalledReads(LocalStore):
    """A real local store whose data reads hang until released (a stalled S3 GET)."""

    def __init__(self, root):
        super().__init__(root)
        self.stalled, self.release, self.reads = False, threading.Event(), 0

    def _stall(self):
        if self.stalled:
            self.reads += 1
            self.release.wait(30)

    def get(self, name, offset=0, length=None):
        self._stall()
        return super().get(name, offset, length)

    def get_into(self, name, offset, buf):
        self._stall()
        return super().get_into(name, offset, buf)


async def test_stalled_reads_do_not_starve_lookups_and_abandoned_reads_are_cancelled(tmp_path, shm):
    store = StalledReads(tmp_path)
    sc = await started(store, io_workers=2, meta_io_workers=2)
    try:
        bid = sc.register(shm().handle, FP)
        await sc.store(bid, TOKENS)
        await sc.flush()
        store.stalled = True
        loads = await asyncio.gather(*(sc.fetch(bid, TOKENS, options=FetchOptions(deadline_s=0.3)) for _ in range(6)))
        assert {r.reason for r in loads} == {"deadline"}
        p = await sc.lookup(bid, TOKENS, options=FetchOptions(deadline_s=2.0))  # LISTs are not queued behind the stalled GETs
        assert (p.hit_tokens, p.reason) == (len(TOKENS), None)
        store.release.set()
        await asyncio.sleep(0.5)
        assert store.reads <= 2  # only the reads that had a thread ran; the queued ones were cancelled
    finally:
        store.release.set()
        await sc.close()


async def test_a_stores_copy_out_of_the_buffer_does_not_hold_up_lookups(tmp_path, shm, monkeypatch):
    from kvfetcher import kvbuffer

    real = kvbuffer.Destination.read

    def slow_read(self, start, tokens):  # a long device-to-host copy (a 64K-token prompt's raw KV)
        time.sleep(0.6)
        return real(self, start, tokens)

    monkeypatch.setattr(kvbuffer.Destination, "read", slow_read)
    sc = await started(LocalStore(tmp_path))
    try:
        bid = sc.register(shm().handle, FP)
        storing = asyncio.ensure_future(sc.store(bid, TOKENS))
        await asyncio.sleep(0.1)  # the copy has started
        t = time.perf_counter()
        p = await sc.lookup(bid, TOKENS[:64], options=FetchOptions(deadline_s=2.0))
        assert time.perf_counter() - t < 0.3 and not storing.done()  # answered while the copy ran
        assert p.hit_tokens == 0
        assert (await storing)["queued_chunks"] == len(TOKENS) // N  # and the store still took the KV
    finally:
        await sc.close()


# --- typed store errors, readiness, _drop on a read-only store ----------------------------------


def test_every_os_error_of_the_local_store_is_a_typed_store_error(tmp_path):
    store = LocalStore(tmp_path)
    (tmp_path / "kv" / "dir.kvfc").mkdir(parents=True)  # an object name that is a directory
    for call in (lambda: store.get("kv/dir.kvfc"), lambda: store.delete("kv/dir.kvfc"),
                 lambda: store.put("kv/dir.kvfc/x", b"1") and store.put("kv/dir.kvfc/x/y", b"2")):
        with pytest.raises(StoreError):
            call()
    assert isinstance(from_os_error(OSError(errno.ENOSPC, "full"), "put"), StoreFull)
    assert isinstance(from_os_error(OSError(errno.EROFS, "ro"), "delete"), ReadOnly)
    assert from_os_error(OSError(errno.ENOSPC, "full"), "put").reason == "store_full"


@pytest.fixture
def tmpfs(tmp_path):
    """A real tiny file system (root only: skipped elsewhere)."""
    root = tmp_path / "fs"
    root.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(root)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield root
    subprocess.run(["umount", "-l", str(root)], check=False)


async def test_a_read_only_store_is_not_ready_and_a_bad_object_there_does_not_fail_the_load(tmpfs, shm):
    store = LocalStore(tmpfs)
    sc = sidecar(store)
    bid = sc.register(shm().handle, FP)
    key = keys.chunk_keys(sc.buffers[bid].ns, TOKENS, N)[0]
    store.put(keys.object_name(key, "raw"), b"KVFC" + bytes(100))  # corrupt
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    with Embedded(sc, "t") as e:
        status, text = request(e.where["port"], "GET", "/readyz")
        assert (status, text) == (503, "store not ready: store_read_only\n")  # no path, no error text
        r = await sc.fetch(bid, TOKENS[:N])  # the delete of the bad object fails: counted, not raised
        assert r.loaded_tokens == 0 and r.error in ("truncated", "corrupt")
        assert 'kvfetcher_errors_total{reason="store_read_only"} 1.0' in sc.metrics.exposition().decode()


async def test_a_full_store_is_not_ready_and_its_failed_stores_are_counted_as_such(tmpfs, shm):
    store = LocalStore(tmpfs)
    sc = await started(store)
    try:
        with open(tmpfs / "filler", "wb", buffering=0) as f:
            with pytest.raises(OSError):
                while True:
                    f.write(bytes(4096))
        with pytest.raises(StoreFull):
            store.ping()
        bid = sc.register(shm(capacity=64 * N).handle, FP)
        await sc.store(bid, list(range(64 * N)))
        await sc.flush()
        text = sc.metrics.exposition().decode()
        assert 'kvfetcher_errors_total{reason="store_full"} 1.0' in text and 'reason="internal"' not in text
    finally:
        await sc.close()


# --- lookups stop at the first miss; a cap on tokens ---------------------------------------------


class CountedLists(LocalStore):
    def __init__(self, root):
        super().__init__(root)
        self.lists = 0

    def list(self, prefix):
        self.lists += 1
        return super().list(prefix)


async def test_a_lookup_stops_at_the_first_miss_and_long_requests_are_refused(tmp_path, shm):
    store = CountedLists(tmp_path)
    sc = await started(store, max_request_tokens=4096)
    try:
        bid = sc.register(shm(capacity=128 * N).handle, FP)
        await sc.calibrations.finding  # the registration's one look for the model's calibration in the store
        store.lists = 0
        p = await sc.lookup(bid, list(range(128 * N)))
        assert (p.hit_tokens, store.lists) == (0, 0)  # answered from the index: no store request waited for
        await sc.catalog.settled()
        assert store.lists == 1  # the background listing of a miss of the first chunk: one LIST, not 128
        p = await sc.lookup(bid, list(range(128 * N)))
        await sc.catalog.settled()
        assert (p.hit_tokens, store.lists) == (0, 1)  # the miss is remembered: not listed again
        await sc.store(bid, TOKENS)  # 8 chunks stored
        await sc.flush()
        store.lists = 0
        p = await sc.lookup(bid, TOKENS + list(range(120 * N)))
        assert p.hit_tokens == len(TOKENS) and store.lists == 0  # its own writes: known without a store request
        await sc.catalog.settled()
        assert store.lists == 1  # what follows them: one LIST (chunk 9, absent), not one per chunk
        p = await sc.lookup(bid, TOKENS + list(range(120 * N)), FetchOptions(refresh=True))
        assert p.hit_tokens == len(TOKENS) and store.lists == 1  # known absent, fresh: a refresh lists nothing either
        with pytest.raises(RequestError):
            await sc.lookup(bid, list(range(4097)))
        with pytest.raises(RequestError):
            await sc.store(bid, list(range(4097)))
    finally:
        await sc.close()


# --- store admission by chunks ---------------------------------------------------------------


async def test_a_long_store_queues_the_leading_chunks_that_fit_and_skips_stored_ones(tmp_path, shm):
    store = LocalStore(tmp_path)
    sc = await started(store, store_queue_chunks=4)
    try:
        buf = shm()
        bid = sc.register(buf.handle, FP)
        r = await sc.store(bid, TOKENS)  # 8 chunks, room for 4: the first 4 are stored
        assert (r["queued_chunks"], r["skipped_chunks"], r["dropped_chunks"], r["dropped"]) == (4, 0, 4, True)
        await sc.flush()
        r = await sc.store(bid, TOKENS)  # the stored 4 take no room: the other 4 now fit
        assert (r["queued_chunks"], r["skipped_chunks"], r["dropped_chunks"]) == (4, 4, 0)
        await sc.flush()
        assert "kvfetcher_store_dropped_chunks_total 4.0" in sc.metrics.exposition().decode()
        expected = buf.tensor.clone()
        buf.tensor.zero_()
        assert (await sc.fetch(bid, TOKENS)).loaded_tokens == len(TOKENS)
        assert torch.equal(buf.tensor, expected)  # each chunk stored from its own slots
    finally:
        await sc.close()


async def test_the_queue_is_bounded_in_bytes_too_and_gives_its_bytes_back(tmp_path, shm):
    """A model of large chunks fills the queue's bytes before its chunk count: what does not fit
    is dropped, and the bytes come back as the queue is written."""
    sc = await started(LocalStore(tmp_path), store_queue_chunks=100)
    try:
        buf = shm()
        bid = sc.register(buf.handle, FP)
        sc.writer.config.store_queue_bytes = 3 * sc._chunk_kv_bytes(sc._buffer(bid))
        r = await sc.store(bid, TOKENS)  # 8 chunks, bytes for 3
        assert (r["queued_chunks"], r["dropped_chunks"]) == (3, 5)
        await sc.flush()
        assert (sc.writer.pending_chunks, sc.writer.pending_bytes) == (0, 0)
        assert (await sc.store(bid, TOKENS))["queued_chunks"] == 3  # the next 3
    finally:
        await sc.close()


async def test_stores_copying_at_once_share_the_queues_room_and_a_failed_copy_gives_it_back(tmp_path, shm, monkeypatch):
    """Two stores whose copies overlap (a loaded engine ends prefills back to back): the room the
    first took is not promised to the second, and room held for a copy that failed is free again."""
    from kvfetcher import kvbuffer

    real, fail = kvbuffer.Destination.read, []

    def slow_read(self, start, tokens):
        time.sleep(0.3)
        if fail:
            raise RuntimeError("the copy failed")
        return real(self, start, tokens)

    monkeypatch.setattr(kvbuffer.Destination, "read", slow_read)
    sc = await started(LocalStore(tmp_path), store_queue_chunks=6)
    try:
        bid = sc.register(shm().handle, FP)
        first, second = await asyncio.gather(sc.store(bid, TOKENS[: 4 * N]), sc.store(bid, TOKENS[4 * N :]))
        assert (first["queued_chunks"], second["queued_chunks"], second["dropped_chunks"]) == (4, 2, 2)
        await sc.flush()
        assert sc.writer.pending_chunks == 0
        fail.append(True)
        with pytest.raises(RuntimeError):
            await sc.store(bid, list(range(9000, 9000 + 4 * N)))
        assert sc.writer.pending_chunks == 0  # the failed copy's room is given back
    finally:
        await sc.close()


# --- strict schemas, auth that never raises, token rotation ---------------------------------


@pytest.fixture
def served(tmp_path, shm):
    sc = sidecar(LocalStore(tmp_path / "store"))
    with Embedded(sc, "secret") as e:
        client = KVClient(socket_path=e.socket)  # a host-memory buffer registers over the Unix socket
        bid = client.register(shm().handle, FP)
        yield e.where["port"], bid
        client.close()


BAD = [
    ("/v1/lookup", lambda b: {"buffer": b, "tokens": [2**63]}),  # beyond int64
    ("/v1/lookup", lambda b: {"buffer": b, "tokens": [1.0]}),  # no float truncated into an int
    ("/v1/lookup", lambda b: {"buffer": b, "tokens": [1], "deadline_s": float("nan")}),
    ("/v1/lookup", lambda b: {"buffer": b, "tokens": [1], "deadline_s": float("inf")}),
    ("/v1/lookup", lambda b: {"buffer": b, "tokens": [1], "deadline_s": 0}),
    ("/v1/lookup", lambda b: {"buffer": b, "tokens": [1], "presets": "raw"}),  # a string is not a list
    ("/v1/lookup", lambda b: {"buffer": b, "tokens": [1], "recompute_tokens_per_s": -1}),
    ("/v1/fetch", lambda b: {"buffer": b, "tokens": [1], "offset": float("inf")}),
    ("/v1/fetch", lambda b: {"buffer": b, "tokens": [1], "offset": -1}),
    ("/v1/store", lambda b: {"buffer": b, "tokens": [1], "slots": [1.5]}),
    ("/v1/lookup", lambda b: {"model": FP, "dtype": "float16", "tokens": [1], "kv_shape": [2, 0, 16]}),
    ("/v1/lookup", lambda b: b"[" * 100_000 + b"]" * 100_000),  # deeply nested
    ("/v1/buffers", lambda b: {"model": FP, "handle": json.loads('{"a":' * 40 + "1" + "}" * 40)}),  # nested inside a dict field
]


@pytest.mark.parametrize("path, body", BAD)
def test_malformed_requests_are_400_with_a_reason(served, path, body):
    port, bid = served
    data = body(bid)
    status, text = request(port, "POST", path, data if isinstance(data, bytes) else json.dumps(data).encode(), {"Authorization": "Bearer secret"})
    assert status == 400 and json.loads(text)["error"] == "bad_request", text


def test_auth_never_raises_and_accepts_any_case_of_bearer(served):
    port, bid = served
    body = {"buffer": bid, "tokens": [1]}
    for header in (b"Bearer \xff\xfe\xc3", b"\xe2\x82\xac", "Bearer s\u00e9cret".encode()):
        assert request(port, "POST", "/v1/lookup", body, {"Authorization": header})[0] == 401
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert request(port, "POST", "/v1/lookup", body, {"Authorization": f"{scheme} secret"})[0] == 200


def test_the_token_file_is_read_again_when_it_changes(tmp_path):
    path = tmp_path / "token"
    path.write_text("first\n")
    token = Token(path=str(path))
    with Embedded(sidecar(LocalStore(tmp_path / "store")), token) as e:
        auth = lambda t: request(e.where["port"], "POST", "/v1/flush", {}, {"Authorization": f"Bearer {t}"})[0]  # noqa: E731
        assert (auth("first"), auth("second")) == (200, 401)
        path.write_text("second-token\n")  # rotated (another size, so the change is seen at once)
        assert (auth("first"), auth("second-token")) == (401, 200)


def test_an_unready_store_is_not_described_to_an_unauthenticated_caller(tmp_path):
    store = LocalStore(tmp_path / "secret-store-path")
    with Embedded(sidecar(store), "t") as e:
        (tmp_path / "secret-store-path").rmdir()
        status, text = request(e.where["port"], "GET", "/readyz")
        assert status == 503 and "secret-store-path" not in text and text == "store not ready: store_error\n"
