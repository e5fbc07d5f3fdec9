"""The scheduler's lookups never hold it: a slow or silent sidecar costs it at most ``wait_s`` per ask,
and a request at most ``timeout_s`` before it recomputes."""

import socket
import threading
import time

from kvfetcher.api.client import KVClient
from kvfetcher.integrations.lookups import NOT_YET, Lookups


def test_an_answer_in_time_is_taken_at_the_first_ask():
    lk = Lookups(wait_s=1.0, timeout_s=5.0)
    assert lk.answer("r", lambda: 42, lambda: 0) == 42
    assert lk.asking == {}
    lk.close()


def test_a_failed_lookup_is_the_fallback():
    lk = Lookups(wait_s=1.0, timeout_s=5.0)
    assert lk.answer("r", lambda: 1 / 0, lambda: "recompute") == "recompute"
    lk.close()


def test_a_silent_sidecar_never_holds_the_scheduler(tmp_path):
    """A sidecar that accepts the lookup and never answers: each ask returns within about ``wait_s``
    (vLLM then schedules the other requests), and the request recomputes after ``timeout_s``."""
    path = str(tmp_path / "silent.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    held = []
    threading.Thread(target=lambda: held.append(server.accept()), daemon=True).start()
    client = KVClient(socket_path=path, timeout_s=30.0)
    lk = Lookups(wait_s=0.002, timeout_s=0.05)
    asks, started = [], time.monotonic()
    while True:
        t = time.monotonic()
        got = lk.answer("r", lambda: client.lookup(None, list(range(4096)), model="m", dtype="float16"), lambda: "recompute")
        asks.append(time.monotonic() - t)
        if got is not NOT_YET:
            break
    assert got == "recompute"
    assert 0.05 <= time.monotonic() - started < 0.5  # recomputes once the timeout passed, not after the client's 30 s
    assert max(asks) < 0.02 and len(asks) > 3  # every ask returned at once: the scheduler went on with its step
    lk.close()
    for conn, _ in held:  # let the lookup thread's read end
        conn.close()
    server.close()


def test_a_request_may_wait_longer_than_the_default_timeout_when_it_says_so():
    """A per-request timeout (a long prompt's stake) replaces the instance's for that request."""
    lk = Lookups(wait_s=0.001, timeout_s=0.01)
    gate = threading.Event()
    started = time.monotonic()
    while (got := lk.answer("long", lambda: gate.wait(5) and "plan", lambda: "recompute", timeout_s=0.2)) is NOT_YET:
        if time.monotonic() - started > 0.05:
            gate.set()  # answered after the default timeout, before the request's own
    assert got == "plan"
    assert lk.answer("short", lambda: gate.clear() or time.sleep(0.2) or "plan", lambda: "recompute") is NOT_YET
    time.sleep(0.02)
    assert lk.answer("short", lambda: "unused", lambda: "recompute") == "recompute"
    lk.close()


def test_it_learns_how_long_answers_take_and_counts_the_asks_it_put_off():
    """What lets the scheduler wait as long as an answer usually needs, rather than put every request
    off a step for an answer a millisecond past a fixed wait."""
    lk = Lookups(wait_s=0.001, timeout_s=5.0)
    assert lk.typical_s() == 0.0
    for i in range(5):
        while (got := lk.answer(i, lambda: time.sleep(0.02) or "plan", lambda: "recompute")) is NOT_YET:
            pass
        assert got == "plan"
    time.sleep(0.01)  # the last answer's time is kept by the pool's thread
    assert lk.answered == 5 and lk.deferred >= 5
    assert 0.02 <= lk.typical_s() < 0.5
    lk.close()
