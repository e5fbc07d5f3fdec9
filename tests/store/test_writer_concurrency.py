"""The writer keeps ``store_encoders`` chunks encoding at once and uploads while it encodes; the
first failure stops the job, leaving the objects before it written."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvfetcher import keys
from kvfetcher.config import Config
from kvfetcher.metrics import Metrics
from kvfetcher.save import writer as writer_mod
from kvfetcher.store import Unavailable
from kvfetcher.store.local import LocalStore

NS = keys.Namespace(model="m", dtype="float16", shape=(2, 2, 8))
KEYS = [f"{i:02d}" * 32 for i in range(6)]


class SlowStore(LocalStore):
    """A local store whose uploads take ``put_s`` and, from the ``fail_at``-th on, fail."""

    def __init__(self, root, put_s: float = 0.0, fail_at: int | None = None):
        super().__init__(root)
        self.put_s, self.fail_at, self.puts = put_s, fail_at, []
        self.lock = threading.Lock()

    def put(self, name, data):
        with self.lock:
            n = len(self.puts)
            self.puts.append((time.perf_counter(), name))
        time.sleep(self.put_s)
        if self.fail_at is not None and n >= self.fail_at:
            raise Unavailable(f"refused {name}")
        return super().put(name, data)


def store_job(store, encoders: int, monkeypatch, encode_s: float = 0.0, batch: int = 1):
    """Write one job of six chunks; (encodes at once at most, the upload and encode spans, the chunks of each encode)."""
    spans = {"encode": [], "busy": 0, "most": 0, "groups": []}
    lock = threading.Lock()
    real = writer_mod._encode

    def timed(chunks, *a, **kw):
        with lock:
            spans["busy"] += 1
            spans["most"] = max(spans["most"], spans["busy"])
            spans["groups"].append([c.start for c in chunks])
        t = time.perf_counter()
        try:
            time.sleep(encode_s)
            return real(chunks, *a, **kw)
        finally:
            with lock:
                spans["busy"] -= 1
                spans["encode"].append((t, time.perf_counter()))

    monkeypatch.setattr(writer_mod, "_encode", timed)
    metrics = Metrics()

    async def run():
        with ThreadPoolExecutor(4) as pool:
            cfg = Config.from_env({"KVFETCHER_PRESET": "raw", "KVFETCHER_CHUNK_TOKENS": "16", "KVFETCHER_STORE_ENCODERS": str(encoders),
                                   "KVFETCHER_STORE_ENCODE_BATCH": str(batch)})
            w = writer_mod.Writer(store, cfg, metrics, pool, pool)
            w.start()
            assert w.reserve(len(KEYS), 2 * 2 * 2 * 16 * 8 * 2) == len(KEYS)
            w.submit(writer_mod.Job(NS, KEYS, torch.randn(2, 2, 2, 16 * len(KEYS), 8).half()))
            await w.flush()
            assert w.pending_chunks == 0
            await w.close(1.0)

    asyncio.run(run())
    return spans, metrics


@pytest.mark.parametrize("encoders", [1, 3])
def test_at_most_store_encoders_chunks_encode_at_once_and_all_are_written(tmp_path, monkeypatch, encoders):
    store = SlowStore(tmp_path)
    spans, _ = store_job(store, encoders, monkeypatch, encode_s=0.05)
    assert spans["most"] == encoders
    assert sorted(name for _, name in store.puts) == sorted(keys.object_name(k, "raw") for k in KEYS)


def test_uploads_overlap_the_next_chunks_encode(tmp_path, monkeypatch):
    """With one encoder, chunk i+1 is encoded while chunk i uploads (they took turns before)."""
    store = SlowStore(tmp_path, put_s=0.1)
    spans, _ = store_job(store, 1, monkeypatch)
    starts = sorted(t for t, _ in spans["encode"])
    puts = sorted(t for t, _ in store.puts)
    # the second chunk's encode starts before the first chunk's upload has ended
    assert starts[1] < puts[0] + store.put_s


def test_a_failed_upload_stops_the_job_and_keeps_what_was_written(tmp_path, monkeypatch):
    store = SlowStore(tmp_path, put_s=0.02, fail_at=2)
    _, metrics = store_job(store, 1, monkeypatch)
    written = [k for k in KEYS if store.exists(keys.object_name(k, "raw"))]
    assert written == KEYS[:2]  # the two before the failure
    assert len(store.puts) < len(KEYS)  # the job stopped: not every chunk was tried
    assert metrics.errors.labels(Unavailable.reason)._value.get() == 1  # logged and counted once, for the job


def test_a_batch_of_consecutive_chunks_not_stored_yet_is_encoded_in_one_call(tmp_path, monkeypatch):
    store = SlowStore(tmp_path)
    store.put(keys.object_name(KEYS[1], "raw"), b"there already")  # skipped, not encoded again
    spans, metrics = store_job(store, 2, monkeypatch, batch=4)
    assert sorted(spans["groups"]) == [[0, 32, 48], [64, 80]]  # chunks 0-3 less the stored one, then 4-5 (16 tokens each)
    assert all(store.exists(keys.object_name(k, "raw")) for k in KEYS)
    assert metrics.store_seconds._sum.get() > 0 and sum(b.get() for b in metrics.store_seconds._buckets) == 5
