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


@pytest.fixture
def keepalive_s3(tmp_path):
    """An S3Store on an S3 server that keeps connections alive (moto's closes each one)."""
    from benchmarks.lib import linkserver

    (tmp_path / "bench").mkdir()
    srv = linkserver.start_thread(tmp_path)
    yield S3Store(srv.url, "bench", "k", "s")
    srv.shutdown()
    srv.server_close()


def test_s3_ranged_reads_land_whole_and_reuse_one_connection(keepalive_s3, monkeypatch):
    import urllib3

    s3 = keepalive_s3
    data = bytes(range(256)) * 4096  # 1 MiB
    s3.put("kv/big", data)
    connects = []
    real = urllib3.connection.HTTPConnection.connect
    monkeypatch.setattr(urllib3.connection.HTTPConnection, "connect", lambda self: connects.append(1) or real(self))
    for offset, size in [(0, 10), (5, 300_000), (1000, 1 << 20), (len(data) - 7, 100), (0, len(data))]:
        buf = bytearray(size)
        n = s3.get_into("kv/big", offset, memoryview(buf))
        assert n == min(size, len(data) - offset)
        assert bytes(buf[:n]) == data[offset : offset + n]
        assert s3.get("kv/big", offset, size) == data[offset : offset + size]
    assert len(connects) <= 1  # keep-alive: every read above went over one connection


def _bad_server(body_sent: int, then: str):
    """An HTTP server that answers one GET with a 206 promising 1000 bytes, sends ``body_sent`` of
    them, then hangs (``then="hang"``) or closes the connection: (url, stop)."""
    import socket

    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        conn, _ = srv.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 1000\r\nContent-Range: bytes 0-999/5000\r\n\r\n"
                     + b"x" * body_sent)
        if then == "hang":
            stop.wait(10)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}", stop


@pytest.mark.parametrize("then", ["hang", "close"])
def test_s3_body_that_stalls_or_ends_early_is_unavailable_not_short(then):
    url, stop = _bad_server(10, then)
    s = S3Store(url, "bucket", "k", "s", read_timeout_s=0.5)
    t = time.perf_counter()
    try:
        with pytest.raises(Unavailable):
            s.get_into("kv/x", 0, memoryview(bytearray(1000)))
    finally:
        stop.set()
    assert time.perf_counter() - t < 5
