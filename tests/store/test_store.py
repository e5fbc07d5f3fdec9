"""Both backends, one contract: atomic writes, no-op re-store, ranged reads, clear errors."""

import threading
import time

import pytest

from kvfetcher.store import NotFound, StoreError, Unavailable
from kvfetcher.store.local import LocalStore
from kvfetcher.store.s3 import S3Store

from kvtest import unreachable_s3


def test_put_get_ranges_list(store):
    data = bytes(range(256)) * 40
    assert store.put("kv/ab/key/raw.kvfc", data) is True
    assert store.get("kv/ab/key/raw.kvfc") == data
    assert store.get("kv/ab/key/raw.kvfc", 100, 50) == data[100:150]
    assert store.get("kv/ab/key/raw.kvfc", len(data) - 10, 100) == data[-10:]  # short at the end
    assert store.get("kv/ab/key/raw.kvfc", 5000) == data[5000:]
    store.put("kv/ab/key/q8.kvfc", b"x" * 7)
    store.put("kv/cd/other/raw.kvfc", b"y")
    assert store.list("kv/ab/key/") == {"kv/ab/key/raw.kvfc": len(data), "kv/ab/key/q8.kvfc": 7}
    assert store.exists("kv/ab/key/q8.kvfc") and not store.exists("kv/ab/key/nope.kvfc")
    store.delete("kv/ab/key/q8.kvfc")
    assert not store.exists("kv/ab/key/q8.kvfc")
    store.ping()


def test_restore_is_a_noop(store):
    assert store.put("a/b", b"first") is True
    assert store.put("a/b", b"second, longer") is False
    assert store.get("a/b") == b"first"


def test_missing_object_is_not_found(store):
    with pytest.raises(NotFound):
        store.get("no/such")
    assert store.list("no/") == {}


def test_concurrent_writers_leave_one_whole_object(store):
    blobs = [bytes([i]) * 300_000 for i in range(6)]
    results = []

    def put(b):
        try:
            results.append(store.put("race/obj", b))
        except StoreError as e:  # moto (not S3) may answer 500 to simultaneous PUTs of one key
            assert isinstance(store, S3Store), e
            results.append(e)

    threads = [threading.Thread(target=put, args=(b,)) for b in blobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert True in results
    got = store.get("race/obj")
    assert got in blobs
    assert list(store.list("race/")) == ["race/obj"]  # no temporary file is ever listed


def test_local_store_refuses_escaping_names(tmp_path):
    s = LocalStore(tmp_path / "s")
    with pytest.raises(Exception, match="escapes"):
        s.put("../outside", b"x")


def test_s3_down_fails_fast_and_clearly():
    s = unreachable_s3()
    t = time.perf_counter()
    with pytest.raises(Unavailable, match="unreachable"):
        s.get("kv/x")
    with pytest.raises(Unavailable):
        s.ping()
    assert time.perf_counter() - t < 5
