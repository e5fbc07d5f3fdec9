"""linkstore (bench): the emulated link paces bytes and is shared by concurrent GETs."""

import threading
import time

import pytest

from benchmarks.lib.linkstore import Link, LinkStore

from kvfetcher.store import NotFound


def test_ranged_get_and_missing():
    s = LinkStore()
    assert s.put("a", b"0123456789") and not s.put("a", b"x")
    assert s.get("a", 2, 3) == b"234" and s.get("a", 8) == b"89"
    assert s.list("a") == {"a": 10}
    with pytest.raises(NotFound):
        s.get("b")
    buf = bytearray(4)
    assert s.get_into("a", 7, memoryview(buf)) == 3 and buf[:3] == b"789"  # past the end: a short read
    with pytest.raises(NotFound):
        s.get_into("b", 0, memoryview(buf))


def test_link_paces_and_is_shared():
    s = LinkStore(Link(2e6))  # 2 MB/s
    s.put("x", bytes(100_000))  # 50 ms alone
    t = time.perf_counter()
    s.get("x")
    alone = time.perf_counter() - t
    assert 0.045 < alone < 0.2
    t = time.perf_counter()
    threads = [threading.Thread(target=s.get, args=("x",)) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    shared = time.perf_counter() - t
    assert shared > 0.19  # four GETs share one pipe: 4 x 50 ms, not 50 ms
