"""The fetch pipeline on a local store: streaming, exactness, and every way a chunk can be bad."""

import asyncio
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvfetcher.fetch import executor
from kvfetcher.kvbuffer import Destination
from kvfetcher.store.local import LocalStore
from kvfetcher.fetch.plan import FetchOptions

from kvtest import CODED_DAMAGES, DAMAGES, SENTINEL, decoded, fetch, put_chunks, rebuild, sentinel_like, synthetic_kv


class Recording(LocalStore):
    """A local store that remembers when each GET started and can act before one (real I/O)."""

    def __init__(self, root, delay_s: float = 0.0, hook=None):
        super().__init__(root)
        self.delay_s, self.hook, self.gets = delay_s, hook, []

    def _before(self, name, offset):
        self.gets.append((time.perf_counter(), name, offset))
        if self.hook:
            self.hook(self, name, offset)
        if self.delay_s:
            time.sleep(self.delay_s)

    def get(self, name, offset=0, length=None):
        self._before(name, offset)
        return super().get(name, offset, length)

    def get_into(self, name, offset, buf):  # the direct path's reads (raw preset)
        self._before(name, offset)
        return super().get_into(name, offset, buf)


class RecordingDest(Destination):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.writes = []

    def finish(self):  # the end of every chunk's write, on every path
        super().finish()
        self.writes.append(time.perf_counter())


async def test_a_hundred_chunks_stream_through_a_bounded_window(tmp_path):
    kv = synthetic_kv(layers=4, heads=2, tokens=800, head_dim=64)
    store = Recording(tmp_path)
    refs = put_chunks(store, kv, 8)
    assert len(refs) == 100
    buf = sentinel_like(kv)
    dest = RecordingDest(buf, tokens=800)
    out = await fetch(store, refs, dest, window=4)
    assert out.error is None and out.loaded_tokens == 800
    assert torch.equal(buf, kv)
    first_get = {}
    for t, name, _ in store.gets:
        first_get.setdefault(name, t)
    # streaming: chunk 0 was in the buffers long before the last chunk was even requested
    assert dest.writes[0] < first_get[refs[-1].name]
    # bounded: never more than `window` chunks between their first GET and their write
    events = sorted([(t, +1) for t in first_get.values()] + [(t, -1) for t in dest.writes])
    open_, peak = 0, 0
    for _, d in events:
        open_ += d
        peak = max(peak, open_)
    assert peak <= 4
    assert out.bytes_read == sum(r.size for r in refs)


async def test_scattered_slots_and_hevc(tmp_path):
    kv = synthetic_kv(layers=3, heads=2, tokens=64, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset="q8")
    slots = torch.randperm(100)[:64].tolist()
    buf = sentinel_like(kv, capacity=100)
    out = await fetch(store, refs, Destination(buf, slots=slots))
    assert out.error is None and out.loaded_tokens == 64
    assert torch.equal(buf[:, :, :, slots], decoded(store, refs))
    untouched = sorted(set(range(100)) - set(slots))
    assert bool((buf[:, :, :, untouched] == SENTINEL).all())


@pytest.mark.parametrize("preset, damage, reason", [("raw", *d) for d in DAMAGES]
                         + [(p, *d) for p in ("q8", "q8-zstd") for d in DAMAGES + CODED_DAMAGES])
async def test_a_bad_chunk_stops_the_fetch_and_is_never_written(tmp_path, preset, damage, reason):
    """Raw chunks take the direct path, q8 and q8-zstd ones are verified and decoded in the decode pool."""
    kv = synthetic_kv(layers=2, heads=2, tokens=128, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset=preset)
    first = decoded(store, refs[:2])
    refs[2] = damage(store, refs[2])
    buf = sentinel_like(kv)
    out = await fetch(store, refs, Destination(buf, tokens=128), window=1)
    assert out.error == reason, out.detail
    assert out.loaded_tokens == 64
    assert torch.equal(buf[:, :, :, :64], first)
    assert bool((buf[:, :, :, 64:96] == SENTINEL).all())  # the bad chunk never reached the buffer


async def test_object_deleted_mid_fetch(tmp_path, monkeypatch):
    kv = synthetic_kv(layers=2, heads=2, tokens=96, head_dim=32)

    def delete_after_header(store, name, offset):
        if name.startswith("kv/0001/") and offset > 0:  # header read, now the segments: gone
            LocalStore.delete(store, name)

    store = Recording(tmp_path)
    refs = put_chunks(store, kv, 32, preset="q8")  # q8: side info and segments after the header
    store.hook = delete_after_header
    monkeypatch.setattr(executor, "HEADER_GUESS", 64)  # the first read stops before the segments
    buf = sentinel_like(kv)
    out = await fetch(store, refs, Destination(buf, tokens=96), window=1)
    assert out.error == "missing"
    assert out.loaded_tokens == 32
    assert bool((buf[:, :, :, 32:] == SENTINEL).all())


async def test_deadline_on_a_slow_store_and_nothing_written_after_return(tmp_path):
    kv = synthetic_kv(layers=2, heads=2, tokens=256, head_dim=32)
    store = Recording(tmp_path, delay_s=0.15)
    refs = put_chunks(store, kv, 32)
    buf = sentinel_like(kv)
    t = time.perf_counter()
    out = await fetch(store, refs, Destination(buf, tokens=256), deadline_s=0.5, window=2)
    assert time.perf_counter() - t < 1.5
    assert out.error == "deadline"
    assert 0 <= out.loaded_tokens < 256
    n = out.loaded_tokens
    assert torch.equal(buf[:, :, :, :n], kv[:, :, :, :n])
    snapshot = buf.clone()
    await asyncio.sleep(0.6)  # GETs still sleeping in threads must not lead to writes now
    assert torch.equal(buf, snapshot)


async def test_cancellation_leaves_no_late_writes(tmp_path):
    kv = synthetic_kv(layers=2, heads=2, tokens=256, head_dim=32)
    store = Recording(tmp_path, delay_s=0.1)
    refs = put_chunks(store, kv, 32)
    buf = sentinel_like(kv)
    task = asyncio.create_task(fetch(store, refs, Destination(buf, tokens=256), window=2))
    await asyncio.sleep(0.35)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    snapshot = buf.clone()
    await asyncio.sleep(0.4)
    assert torch.equal(buf, snapshot)
    assert not torch.equal(buf, kv)


async def test_chunk_that_does_not_fit_the_buffer_is_refused(tmp_path):
    kv = synthetic_kv(layers=2, heads=2, tokens=64, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32)
    buf = torch.full((2, 2, 4, 64, 32), SENTINEL, dtype=torch.float16)  # 4 heads, not 2
    out = await fetch(store, refs, Destination(buf, tokens=64))
    assert out.error == "geometry" and out.loaded_tokens == 0 and out.bad_object is None  # the request's fault: never deleted
    assert bool((buf == SENTINEL).all())


async def test_zstd_chunks_stream_into_the_buffer_as_decoded(tmp_path, monkeypatch):
    """Entropy-coded chunks are staged as raw ones are: every part past the header read lands in a
    reused staging buffer by ``get_into`` (no part comes back as bytes), and the KV is each object's.
    Of a known size (as a plan lists it), each is read whole in that one GET."""
    from kvfetcher.fetch.staging import StagingPool

    class Into(Recording):
        into = 0

        def get_into(self, name, offset, buf):
            self.into += 1
            return super().get_into(name, offset, buf)

    kv = synthetic_kv(layers=2, heads=2, tokens=256, head_dim=32)
    store = Into(tmp_path)
    refs = put_chunks(store, kv, 32, preset="q8-zstd")
    monkeypatch.setattr(executor, "HEADER_GUESS", 64)  # the header read brings no part: all staged
    pool = StagingPool()
    for sized in (False, True):
        for _ in range(2):
            store.into, store.gets = 0, []
            buf = sentinel_like(kv)
            chunks = refs if sized else [dataclasses.replace(r, size=0) for r in refs]
            out = await fetch(store, chunks, Destination(buf, tokens=256), window=2, staging_pool=pool)
            gets, into = len(store.gets), store.into
            assert out.error is None and out.loaded_tokens == 256
            assert torch.equal(buf, decoded(store, refs))
            assert out.bytes_read == sum(r.size for r in refs)
            if sized:  # one GET a chunk, the whole object
                assert gets == into == 8
            else:  # after the header's read, one a part: its side information and its segment
                assert into == 8 * 2
    assert len({r.size for r in refs}) > 1 and pool.allocated <= 6  # coded sizes differ: size classes still reuse buffers


async def test_an_ans_chunk_without_a_gpu_is_a_decoder_failure_and_kept(tmp_path):
    """A reader that cannot decode ans (never planned, but a load may be handed one) recomputes from
    there; the object is not bad, so it is not named for deletion, and nothing is written."""
    from kvfetcher import codec
    from kvfetcher.kvbuffer import ChunkRef

    if codec.decodable("ans"):
        pytest.skip("this machine decodes ans")
    kv = synthetic_kv(layers=2, heads=2, tokens=64, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset="q8-zstd")
    obj = rebuild(store.get(refs[1].name), fmt="ans")
    store.delete(refs[1].name)
    store.put(refs[1].name, obj)
    refs[1] = ChunkRef(refs[1].name, len(obj), 32, 32)
    buf = sentinel_like(kv)
    out = await fetch(store, refs, Destination(buf, tokens=64), window=1)
    assert out.error == "decoder" and out.bad_object is None and out.loaded_tokens == 32
    assert bool((buf[:, :, :, 32:] == SENTINEL).all())


@pytest.mark.parametrize("whole", [True, False])
async def test_a_store_not_trusted_has_its_zstd_decoded_on_the_cpu_even_where_nvcomp_runs(tmp_path, monkeypatch, whole):
    """Without an object key a sidecar does not trust its store (``trust_store=False``): its zstd
    bytes go to the CPU's decoder, which validates them, not to nvCOMP (faked present here: a decode
    handed to it would fail on this machine), whether the chunk is read whole or part by part."""
    from kvfetcher.codec import nvcomp

    kv = synthetic_kv(layers=2, heads=2, tokens=64, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset="q8-zstd")
    want = decoded(store, refs)
    monkeypatch.setattr(nvcomp, "available", lambda: True)
    monkeypatch.setattr(executor, "WHOLE_OBJECT_BYTES", executor.WHOLE_OBJECT_BYTES if whole else 0)
    buf = sentinel_like(kv)
    out = await fetch(store, refs, Destination(buf, tokens=64), trust_store=False)
    assert out.error is None and torch.equal(buf, want), out.detail
    out = await fetch(store, refs, Destination(sentinel_like(kv), tokens=64))  # trusted: handed to nvCOMP, which fails here
    assert out.error is not None


async def test_a_sidecar_stores_zstd_and_loads_it_back_through_its_plan(tmp_path, shm):
    """Writer, plan and executor: a q8-zstd store restores what q8's HEVC object of each chunk
    restores (the same planes); a sidecar without a GPU refuses to be configured to store ans."""
    from kvfetcher import chunk, codec
    from kvfetcher.store.local import LocalStore as Local

    from kvtest import running

    kv = synthetic_kv(layers=2, heads=2, tokens=64, head_dim=32)
    buf = shm(kv.shape, kv.dtype)
    async with running(Local(tmp_path), chunk_tokens=32, presets=("q8-zstd",), decode_procs=0, device="cpu") as sc:
        buf.tensor.copy_(kv)
        bid = sc.register(buf.handle, "m")
        await sc.store(bid, list(range(64)))
        await sc.flush()
        buf.tensor.fill_(SENTINEL)
        r = await sc.fetch(bid, list(range(64)), options=FetchOptions(recompute_tokens_per_s=1e-9))
        assert (r.error, r.loaded_tokens, r.decision.preset) == (None, 64, "q8-zstd"), r
    names = sorted(n for n in Local(tmp_path).list("kv/"))
    assert len(names) == 2 and all(n.endswith("/q8-zstd.kvfc") for n in names)
    want = torch.cat([chunk.decode_chunk(chunk.encode_chunk(kv[:, :, :, a : a + 32].contiguous(), "q8", "m")) for a in (0, 32)], 3)
    assert torch.equal(buf.tensor, want)
    if not codec.decodable("ans"):
        with pytest.raises(ValueError, match="GPU"):
            async with running(Local(tmp_path), chunk_tokens=32, presets=("q8-ans",), decode_procs=0, device="cpu"):
                pass


async def test_auto_waits_for_no_warm_up(tmp_path, shm):
    """While a warm-up holds the decode workers, ``auto`` chooses only what needs none (raw) or
    recompute: a load would wait behind it. A preset the caller names is still planned."""
    from kvfetcher.store.local import LocalStore as Local

    from kvtest import running

    kv = synthetic_kv(layers=2, heads=2, tokens=64, head_dim=32)
    buf = shm(kv.shape, kv.dtype)
    async with running(Local(tmp_path), chunk_tokens=32, presets=("q8", "raw"), decode_procs=0, device="cpu") as sc:
        buf.tensor.copy_(kv)
        bid = sc.register(buf.handle, "m")
        await sc.store(bid, list(range(64)))
        await sc.flush()
        slow_model = FetchOptions(recompute_tokens_per_s=1e-9)
        q8_only = FetchOptions(recompute_tokens_per_s=1e-9, presets=("q8",))
        assert {"q8", "raw"} <= set((await sc.lookup(bid, list(range(64)), slow_model)).options)
        sc._warming = asyncio.get_running_loop().create_future()  # a registration's warm-up, still running
        assert set((await sc.lookup(bid, list(range(64)), slow_model)).options) == {"raw", "recompute"}
        assert (await sc.lookup(bid, list(range(64)), q8_only)).preset == "q8"
        sc._warming.set_result(None)
        assert "q8" in (await sc.lookup(bid, list(range(64)), slow_model)).options


@pytest.mark.parametrize("preset, stages", [("raw", ["admitted", "header", "read", "started", "written"]),
                                            ("q8", ["admitted", "header", "read", "decoded", "started", "written"]),
                                            ("q8-zstd", ["admitted", "header", "read", "decoded", "started", "written"])])
async def test_every_chunk_leaves_a_timeline_of_its_stages_in_order(tmp_path, preset, stages):
    kv = synthetic_kv(layers=2, heads=2, tokens=128, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset=preset)
    out = await fetch(store, refs, Destination(sentinel_like(kv), tokens=128), window=2)
    assert out.error is None and out.loaded_tokens == 128
    for i in range(len(refs)):
        marks = [(stage, t) for c, stage, t in out.timeline if c == i]
        assert [s for s, _ in marks] == stages  # each stage once, in the pipeline's order
        assert [t for _, t in marks] == sorted(t for _, t in marks) and 0 <= marks[0][1] and marks[-1][1] <= out.seconds
    summary = executor.stage_summary(out.timeline, out.seconds)
    assert list(summary) == stages
    # a window of 2: the chunks past the admission step are never more than 2 on average
    assert sum(v["in_flight"] for k, v in summary.items() if k != "admitted") <= 2.0 + 1e-9


class _Finishing(Destination):
    """A flat destination that remembers the threads that finished writes into it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.threads: set[str] = set()

    def finish(self) -> None:
        self.threads.add(threading.current_thread().name)
        super().finish()


@pytest.mark.parametrize("preset, by_the_write_pool", [("raw", True), ("q8-zstd", False)])
async def test_raw_chunks_are_written_by_the_write_pool_and_entropy_coded_ones_unpacked_by_the_decode_threads(tmp_path, preset,
                                                                                                          by_the_write_pool):
    kv = synthetic_kv(layers=2, heads=2, tokens=128, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset=preset)
    dest = _Finishing(sentinel_like(kv), tokens=128)
    with ThreadPoolExecutor(2, thread_name_prefix="test-write") as writes:
        out = await fetch(store, refs, dest, window=2, write_pool=writes)
    assert out.error is None and out.loaded_tokens == 128
    assert torch.equal(dest.buffer, decoded(store, refs))
    assert dest.threads and all(t.startswith("test-write") == by_the_write_pool for t in dest.threads), dest.threads


def test_the_stage_summary_is_each_steps_median_and_its_chunks_in_flight():
    timeline = [(0, "admitted", 0.0), (0, "header", 0.1), (0, "read", 0.3), (0, "written", 0.4),
                (1, "admitted", 0.0), (1, "header", 0.2), (1, "read", 0.3), (1, "written", 0.8),
                (2, "admitted", 0.4), (2, "header", 0.5), (2, "read", 0.7), (2, "written", 1.0)]
    s = executor.stage_summary(timeline, 1.0)
    assert list(s) == ["admitted", "header", "read", "written"]  # no decode step: raw's direct path
    assert s["admitted"] == {"median_ms": 0.0, "in_flight": 0.4}  # chunk 2 waited 0.4 s for the window
    assert s["header"] == {"median_ms": 100.0, "in_flight": 0.4}
    assert s["written"] == {"median_ms": 300.0, "in_flight": 0.9}  # 0.1 + 0.5 + 0.3 s of writing over 1 s
    assert executor.stage_summary([], 0.0) == {}
