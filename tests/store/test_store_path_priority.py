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

        mine = own()
        want = min(19, max(ENCODE_NICE, mine))  # (a process already nicer keeps its niceness)
        assert w.encode_pool.submit(started_by_the_encoder).result() == (want, want)
        assert own() == mine  # the caller's own priority is untouched
        w.encode_pool.shutdown()


def test_a_chunks_copy_out_of_its_jobs_kv_runs_in_the_encode_thread_not_on_the_event_loop(tmp_path, monkeypatch):
    """The event loop hands the encoder a view of each chunk: a chunk's contiguous copy (33 MB for a
    256-token chunk of an 8B model) on the loop held up every lookup while a prefill was stored."""
    import asyncio

    import torch

    from kvfetcher import keys
    from kvfetcher.save import writer as writer_mod

    seen = []
    real = writer_mod.encode_chunks

    def spy(chunks, *args, **kw):
        seen.extend((threading.current_thread().name, c.kv.is_contiguous()) for c in chunks)
        return real(chunks, *args, **kw)

    monkeypatch.setattr(writer_mod, "encode_chunks", spy)
    given = []
    real_encode = writer_mod._encode
    monkeypatch.setattr(writer_mod, "_encode", lambda chunks, *a, **kw: given.extend(c.kv.is_contiguous() for c in chunks) or real_encode(chunks, *a, **kw))

    async def store_two_chunks():
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            w = Writer(LocalStore(tmp_path), Config.from_env({"KVFETCHER_PRESET": "raw", "KVFETCHER_CHUNK_TOKENS": "16"}), Metrics(), pool, pool)
            w.start()
            ns = keys.Namespace(model="m", dtype="float16", shape=(2, 2, 8))
            assert w.reserve(2, 2 * 2 * 2 * 16 * 8 * 2) == 2
            w.submit(writer_mod.Job(ns, ["a" * 64, "b" * 64], torch.randn(2, 2, 2, 32, 8).half()))
            await w.flush()
            await w.close(1.0)
            assert w.pending_chunks == 0

    asyncio.run(store_two_chunks())
    assert given == [False, False]  # the loop passed views...
    assert seen and all(name.startswith("kvf-encode") and contiguous for name, contiguous in seen)  # ...copied in the encode thread
