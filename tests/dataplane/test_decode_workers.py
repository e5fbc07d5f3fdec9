"""Decode worker processes: fetches restored by other processes into a shared buffer (CPU: /dev/shm).

The same code drives NVDEC in worker processes on a GPU (tests/dataplane/test_gpu_dataplane.py);
here the workers decode with libavcodec and write through the buffer's shared-memory handle.
"""

import os
import signal

import pytest
import torch

from kvfetcher import container, ipc, pipeline
from kvfetcher.chunk import decode_chunk, encode_chunk
from kvfetcher.decode_workers import DecodeWorkers
from kvfetcher.store.local import LocalStore

from dptest import SENTINEL, fetch, put_chunks
from kvtest import synthetic_kv
from test_pipeline import corrupt_segment, foreign, truncate_after_listing


@pytest.fixture(scope="module")
def workers():
    w = DecodeWorkers(2)
    w.start()
    yield w
    w.close()


@pytest.fixture
def shared():
    bufs = []

    def make(kv, capacity=None):
        L, _, H, T, D = kv.shape
        b = ipc.allocate((L, 2, H, capacity or T, D), kv.dtype)
        b.tensor.fill_(SENTINEL)
        bufs.append(b)
        return b

    yield make
    for b in bufs:
        b.close()


def expected(store, refs):
    return torch.cat([decode_chunk(store.get(r.name), "fp") for r in refs], dim=3)


@pytest.mark.parametrize("preset", ["raw", "q8"])
async def test_workers_restore_what_threads_restore_and_raw_bypasses_them(tmp_path, workers, shared, preset):
    kv = synthetic_kv(layers=3, heads=2, tokens=96, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset=preset)
    slots = torch.randperm(130)[:96].tolist()  # scattered, as in a paged cache
    buf = shared(kv, capacity=130)
    dest = pipeline.Destination(buf.tensor, slots=slots, handle=buf.handle)
    before = workers.stats["chunks"]
    out = await fetch(store, refs, dest, workers=workers)
    assert out.error is None and out.loaded_tokens == 96, out.detail
    # raw is the buffer's own bytes: restored by the direct path, never through a worker's slab
    direct = preset == "raw"
    assert (out.direct_chunks, workers.stats["chunks"] - before) == ((3, 0) if direct else (0, 3))
    assert out.kv_bytes == kv.numel() * kv.element_size()
    assert torch.equal(buf.tensor[:, :, :, slots], expected(store, refs))
    untouched = sorted(set(range(130)) - set(slots))
    assert bool((buf.tensor[:, :, :, untouched] == SENTINEL).all())


def garbage_bitstream(store, ref):
    """A well-formed object whose checksums match but whose HEVC does not decode."""
    obj = store.get(ref.name)
    h = container.parse_header(obj)
    fields = {k: v for k, v in h.to_json().items() if k not in ("layout_version", "side", "segments")}
    side = container.side_tensor(h, container.slice_segment(obj, h, h.side)) if h.side else None
    segs = [(s.frames, b"\x00\x00\x01" + os.urandom(s.length)) for s in h.segments]
    bad = container.build(fields, side, segs)
    store.delete(ref.name)
    store.put(ref.name, bad)
    return pipeline.ChunkRef(ref.name, len(bad), ref.start, ref.tokens)


async def test_undecodable_chunk_in_a_worker_is_never_written(tmp_path, workers, shared):
    kv = synthetic_kv(layers=2, heads=2, tokens=96, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset="q8")
    refs[1] = garbage_bitstream(store, refs[1])
    buf = shared(kv)
    out = await fetch(store, refs, pipeline.Destination(buf.tensor, tokens=96, handle=buf.handle), window=1, workers=workers)
    assert out.error == "corrupt", out.detail
    assert out.loaded_tokens == 32
    assert bool((buf.tensor[:, :, :, 32:64] == SENTINEL).all())


async def test_a_dead_worker_fails_the_fetch_and_is_replaced(tmp_path, shared):
    kv = synthetic_kv(layers=2, heads=2, tokens=64, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset="q8")  # a worker's format (raw takes the direct path)
    w = DecodeWorkers(1)
    try:
        w.start()
        os.kill(w._workers[0].proc.pid, signal.SIGKILL)
        w._workers[0].proc.join(5)
        buf = shared(kv)
        dest = pipeline.Destination(buf.tensor, tokens=64, handle=buf.handle)
        out = await fetch(store, refs, dest, workers=w)
        # the chunk the dead worker held fails; one that reached the replacement may have landed
        assert out.error == "decoder" and out.loaded_tokens < 64, out
        assert torch.equal(buf.tensor[:, :, :, : out.loaded_tokens], expected(store, refs)[:, :, :, : out.loaded_tokens])
        out = await fetch(store, refs, dest, workers=w)  # a fresh worker took its place
        assert out.error is None and torch.equal(buf.tensor, expected(store, refs))
    finally:
        w.close()


async def test_workers_need_the_buffer_handle(tmp_path, workers):
    kv = synthetic_kv(layers=2, heads=2, tokens=32, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32)
    with pytest.raises(ValueError, match="IPC handle"):
        await fetch(store, refs, pipeline.Destination(torch.zeros_like(kv), tokens=32), workers=workers)


@pytest.mark.parametrize("damage, reason", [(corrupt_segment, "corrupt"), (truncate_after_listing, "truncated"), (foreign, "foreign")])
async def test_a_damaged_chunk_is_caught_before_any_worker_writes(tmp_path, workers, shared, damage, reason):
    """Checksums are computed in the workers on this path: still nothing unverified is written."""
    kv = synthetic_kv(layers=2, heads=2, tokens=96, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset="q8")
    first = expected(store, refs[:1])
    refs[1] = damage(store, refs[1])
    buf = shared(kv)
    out = await fetch(store, refs, pipeline.Destination(buf.tensor, tokens=96, handle=buf.handle), window=1, workers=workers)
    assert out.error == reason, out.detail
    assert out.loaded_tokens == 32 and torch.equal(buf.tensor[:, :, :, :32], first)
    assert bool((buf.tensor[:, :, :, 32:64] == SENTINEL).all())


async def test_a_buffer_the_workers_cannot_open_is_restored_in_process(tmp_path, workers, shared):
    """If workers cannot map the buffer (seen with a later CUDA IPC buffer on an H200), the chunk is
    decoded in the calling process from the bytes already read: the fetch still completes."""
    kv = synthetic_kv(layers=2, heads=2, tokens=64, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset="q8")
    buf = shared(kv)
    gone = dict(buf.handle, path=str(tmp_path / "no-such-shm-file"))  # a handle no worker can open
    out = await fetch(store, refs, pipeline.Destination(buf.tensor, tokens=64, handle=gone), workers=workers)
    assert out.error is None and out.loaded_tokens == 64, out.detail
    assert torch.equal(buf.tensor, expected(store, refs))
    assert out.bytes_read == sum(r.size for r in refs)  # nothing downloaded twice
