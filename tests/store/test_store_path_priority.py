"""A store's encoding yields the CPU to the serving engine beside it: the writer's encode thread
(and the threads an encoder starts from it) runs niced."""

import os
import sys
import threading

import pytest

from kvfetcher.config import Config
from kvfetcher.metrics import Metrics
from kvfetcher.save.writer import ENCODE_NICE, Writer
from kvfetcher.store.local import LocalStore


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_the_writers_encode_thread_runs_at_a_lower_priority(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        w = Writer(LocalStore(tmp_path), Config.from_env({"KVFETCHER_PRESET": "raw"}), Metrics(), pool, pool)
        own = lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # noqa: E731

        def started_by_the_encoder():  # a thread an encoder starts (x265's pool) inherits the niceness
            got = []
            t = threading.Thread(target=lambda: got.append(own()))
            t.start()
            t.join()
            return own(), got[0]

        assert w.encode_pool.submit(started_by_the_encoder).result() == (min(19, ENCODE_NICE), min(19, ENCODE_NICE))
        assert own() == 0 or own() < ENCODE_NICE  # the caller's own priority is untouched
        w.encode_pool.shutdown()
