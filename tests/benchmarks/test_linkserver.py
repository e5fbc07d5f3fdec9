"""The benchmark's link server: S3 subset through the real S3Store, ranges, and the shared rate."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("minio")

from benchmarks.lib import linkserver
from kvfetcher.store import NotFound
from kvfetcher.store.s3 import S3Store


@pytest.fixture
def server(tmp_path):
    (tmp_path / "bench" / "kv" / "ab").mkdir(parents=True)
    srv = linkserver.start_thread(tmp_path)
    yield srv
    srv.shutdown()
    srv.server_close()


def store(srv) -> S3Store:
    return S3Store(srv.url, "bench", "k", "s")


def test_parse_range():
    assert linkserver.parse_range(None, 10) is None
    assert linkserver.parse_range("bytes=2-4", 10) == (2, 5)
    assert linkserver.parse_range("bytes=2-", 10) == (2, 10)
    assert linkserver.parse_range("bytes=5-99", 10) == (5, 10)
    assert linkserver.parse_range("bytes=-3", 10) == (7, 10)
    assert linkserver.parse_range("items=1-2", 10) is None
    with pytest.raises(ValueError):
        linkserver.parse_range("bytes=10-", 10)


def test_s3store_reads_ranges_lists_and_writes(server, tmp_path):
    data = bytes(range(256)) * 4096  # 1 MiB
    (tmp_path / "bench" / "kv" / "ab" / "q8.kvfc").write_bytes(data)
    s = store(server)
    s.ping()
    assert s.get("kv/ab/q8.kvfc") == data
    assert s.get("kv/ab/q8.kvfc", 1000, 5000) == data[1000:6000]
    assert s.get("kv/ab/q8.kvfc", len(data) - 10, 100) == data[-10:]  # short at the end
    assert s.get("kv/ab/q8.kvfc", len(data) + 5, 10) == b""  # InvalidRange: past the end
    assert s.list("kv/ab/") == {"kv/ab/q8.kvfc": len(data)}
    assert s.exists("kv/ab/q8.kvfc") and not s.exists("kv/ab/raw.kvfc")
    with pytest.raises(NotFound):
        s.get("kv/ab/raw.kvfc")
    assert s.put("kv/cd/raw.kvfc", b"hello") and not s.put("kv/cd/raw.kvfc", b"hello")
    assert s.get("kv/cd/raw.kvfc", 1, 3) == b"ell"
    s.delete("kv/cd/raw.kvfc")
    assert not s.exists("kv/cd/raw.kvfc")


def test_rate_is_shared_by_all_connections(server, tmp_path):
    size, rate = 2 * 1024 * 1024, 20e6  # 2 MiB objects at 20 MB/s
    for i in range(2):
        (tmp_path / "bench" / f"o{i}").write_bytes(b"x" * size)
    s = store(server)
    s.get("o0", 0, 10)  # connect outside the timed part
    linkserver.set_rate(server.url, rate)
    t = time.perf_counter()
    assert len(s.get("o0")) == size
    one = time.perf_counter() - t
    t = time.perf_counter()
    with ThreadPoolExecutor(2) as ex:
        assert [len(b) for b in ex.map(s.get, ["o0", "o1"])] == [size, size]
    two = time.perf_counter() - t
    assert 0.85 * size / rate < one < 2.0 * size / rate
    assert 0.85 * 2 * size / rate < two < 2.0 * 2 * size / rate  # two GETs share one link
    linkserver.set_rate(server.url, 0)
    assert linkserver.stats(server.url)["bytes_sent"] >= 3 * size


def test_multipart_uploads_through_s3store(server, tmp_path):
    """The minio SDK uploads objects over 5 MiB in parts (POST ?uploads ... POST ?uploadId): the
    sidecar's saves of large chunks go through, and are counted."""
    data = os.urandom(1 << 20) * 12  # 12 MiB: three parts of 5 MiB, 5 MiB, 2 MiB
    s = store(server)
    assert s.put("kv/ef/raw.kvfc", data)
    assert s.get("kv/ef/raw.kvfc") == data
    st = linkserver.stats(server.url)
    assert st["objects_put"] == 1 and st["bytes_received"] == len(data)
    assert not any((tmp_path / "_uploads").iterdir())  # the parts are gone
    assert s.list("kv/ef/") == {"kv/ef/raw.kvfc": len(data)}


def test_server_processes_share_one_link(tmp_path):
    """Two server processes on one port (SO_REUSEPORT) pace against one shared budget."""
    size, rate = 2 * 1024 * 1024, 20e6
    (tmp_path / "bench").mkdir()
    for i in range(4):
        (tmp_path / "bench" / f"o{i}").write_bytes(b"x" * size)
    url, group = linkserver.start_process(tmp_path, rate, procs=2)
    try:
        stores = [S3Store(url, "bench", "k", "s") for _ in range(4)]  # separate connections
        for s in stores:
            s.get("o0", 0, 10)
        t = time.perf_counter()
        with ThreadPoolExecutor(4) as ex:
            assert [len(b) for b in ex.map(lambda i: stores[i].get(f"o{i}"), range(4))] == [size] * 4
        took = time.perf_counter() - t
        assert 0.85 * 4 * size / rate < took < 2.0 * 4 * size / rate
        st = linkserver.stats(url)
        assert st["procs"] == 2 and st["bytes_sent"] >= 4 * size and st["rate"] == rate
    finally:
        group.terminate()


def test_the_self_check_times_its_readers_only_once_all_have_started(tmp_path, monkeypatch):
    """A reader process slow to start (a heavy environment) must not read as a slow link: paced at
    100 MB/s the check reports the pace, though every process it spawns takes 2 s to start."""
    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(2.0)\n")  # run by every new Python process
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    res = linkserver.self_check(2, 2, seconds=1.5, rate=100e6, object_mib=16)
    assert res["delivered_gbit"] == pytest.approx(0.8, rel=0.15) and res["seconds"] == pytest.approx(1.5, abs=0.3)
