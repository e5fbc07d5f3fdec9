"""Reader processes: ranged reads of a real store (a directory, or S3 on loopback) in processes of
their own, into shared staging memory; fetches through them restore what fetches in threads do,
a bad object still never reaches the buffer, and a reader that dies costs one read."""

import os
import pickle
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvfetcher.fetch import executor
from kvfetcher.fetch.plan import FetchOptions
from kvfetcher.fetch.readers import ReadProcs, SharedStaging
from kvfetcher.kvbuffer import Destination
from kvfetcher.store import NotFound, Unavailable
from kvfetcher.store.local import LocalStore

from kvtest import SENTINEL, corrupt_segment, corrupt_side, fetch, open_store, put_chunks

L, H, D, TOKENS, CHUNK = 3, 2, 32, 96, 32


@pytest.fixture(autouse=True)
def segments_arrive_by_ranged_reads(monkeypatch):
    """Test chunks are KBs, real ones MBs: one segment per layer and a short header read, so that
    segments reach the staging buffer by ranged reads, as with real chunks."""
    from dataclasses import replace

    from kvfetcher.format import presets

    monkeypatch.setitem(presets.PRESETS, "raw", replace(presets.get("raw"), segment_bytes=1))
    monkeypatch.setattr(executor, "HEADER_GUESS", 256)


@pytest.fixture
def readers(tmp_path):
    made = []

    def make(store, procs=2):
        r = ReadProcs(store.opener(), procs, SharedStaging())
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def kv_of(dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, H, TOKENS, D, generator=g).to(dtype)


def test_a_read_lands_in_shared_staging_and_errors_keep_their_type(tmp_path, readers):
    store = LocalStore(tmp_path)
    data = os.urandom(100_000)
    store.put("kv/a", data)
    r = readers(store)
    buf = r.staging.take(70_000, pinned=False)
    view = memoryview(buf.numpy())[1000:61_000]
    assert r.read_into("kv/a", 5, view) == 60_000
    assert bytes(view) == data[5:60_005]
    assert r.read_into("kv/a", 90_000, memoryview(buf.numpy())[:20_000]) == 10_000  # the object's end
    with pytest.raises(NotFound):
        r.read_into("kv/missing", 0, view)
    with pytest.raises(ValueError, match="no shared staging buffer"):
        r.read_into("kv/a", 0, memoryview(bytearray(10)))
    with pytest.raises(ValueError, match="at least one"):
        ReadProcs(store.opener(), 0, SharedStaging())


def test_closing_the_readers_frees_their_staging(tmp_path):
    """Kept buffers are freed (on a GPU: unpinned, or a later pool mapping the same addresses is
    refused by cudaHostRegister), and a buffer given back after the close is freed too."""
    r = ReadProcs(LocalStore(tmp_path).opener(), 1, SharedStaging())
    kept, out = r.staging.take(10_000, pinned=False), r.staging.take(10_000, pinned=False)
    r.staging.give(kept, pinned=False)
    r.close()
    with pytest.raises(ValueError, match="no shared staging buffer"):
        r.staging.place(memoryview(kept.numpy()))
    r.staging.place(memoryview(out.numpy()))  # still in use: still mapped and known
    r.staging.give(out, pinned=False)
    with pytest.raises(ValueError, match="no shared staging buffer"):
        r.staging.place(memoryview(out.numpy()))


def test_a_reader_that_dies_fails_one_read_and_is_replaced(tmp_path, readers):
    store = LocalStore(tmp_path)
    store.put("kv/a", b"x" * 1000)
    r = readers(store, procs=1)
    view = memoryview(r.staging.take(1000, pinned=False).numpy())
    assert r.read_into("kv/a", 0, view) == 1000
    (victim,) = list(r._idle.queue)
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.join(5)
    with pytest.raises(Unavailable, match="died"):
        r.read_into("kv/a", 0, view)
    assert r.read_into("kv/a", 0, view) == 1000


@pytest.mark.parametrize("kind", ["local", "s3"])
@pytest.mark.parametrize("preset", ["raw", "q8-zstd"])
async def test_fetches_through_reader_processes_restore_what_threads_restore(kind, preset, request, readers):
    store = open_store(kind, request)
    kv = kv_of()
    refs = put_chunks(store, kv, CHUNK, preset)
    r = readers(store)
    outs = []
    for rd in (None, r):
        buf = torch.full((L, 2, H, 128, D), SENTINEL, dtype=torch.float16)
        with ThreadPoolExecutor(8) as io, ThreadPoolExecutor(2) as dec:
            out = await executor.fetch(store, refs, Destination(buf, tokens=TOKENS), fingerprint="fp", io_pool=io, decode_pool=dec,
                                       readers=rd)
        assert out.error is None and out.loaded_tokens == TOKENS, out.detail
        outs.append(buf)
    assert r.reads >= len(refs)  # the segments came through the readers
    assert torch.equal(outs[0], outs[1])
    assert bool((outs[1][:, :, :, TOKENS:] == SENTINEL).all())


async def test_a_corrupt_segment_read_by_a_reader_never_reaches_the_buffer(tmp_path, readers):
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv_of(), CHUNK)
    corrupt_segment(store, refs[1])
    buf = torch.full((L, 2, H, TOKENS, D), SENTINEL, dtype=torch.float16)
    with ThreadPoolExecutor(8) as io, ThreadPoolExecutor(2) as dec:
        out = await executor.fetch(store, refs, Destination(buf, tokens=TOKENS), fingerprint="fp", io_pool=io, decode_pool=dec,
                                   readers=readers(store))
    assert out.loaded_tokens <= CHUNK and out.bad_object == refs[1].name and out.error == "corrupt"
    assert bool((buf[:, :, :, CHUNK : 2 * CHUNK] == SENTINEL).all())  # (a later chunk, verified, may have landed)


def test_a_stores_opener_is_picklable_and_opens_the_same_store(tmp_path, s3):
    for store in (LocalStore(tmp_path), s3):
        store.put("kv/o", b"abc")
        again = pickle.loads(pickle.dumps(store.opener()))()
        assert again.get("kv/o") == b"abc" and type(again) is type(store)


async def test_a_sidecar_with_read_processes_stores_and_fetches_through_them(tmp_path, shm):
    from kvfetcher.config import Config
    from kvfetcher.service import Sidecar

    kv = kv_of()
    tokens = list(range(500, 500 + TOKENS))
    sc = Sidecar(LocalStore(tmp_path), Config(chunk_tokens=CHUNK, presets=("raw",), decode_procs=0, warm_up=False, read_procs=2))
    await sc.start()
    try:
        src = sc.register(shm((L, 2, H, TOKENS, D), fill=kv).handle, "fp")
        await sc.store(src, tokens)
        await sc.flush()
        dst_buf = shm((L, 2, H, TOKENS, D), fill=SENTINEL)
        # a recompute priced far above any load: the load's break-even cannot pass on a busy 2-core machine
        reply = await sc.fetch(sc.register(dst_buf.handle, "fp"), tokens, options=FetchOptions(recompute_tokens_per_s=1.0))
        assert reply.loaded_tokens == TOKENS and sc.readers.reads >= TOKENS // CHUNK
        assert torch.equal(dst_buf.tensor, kv)
    finally:
        await sc.close()


async def test_a_sidecar_whose_readers_cannot_start_serves_with_its_threads(tmp_path, shm, monkeypatch):
    from kvfetcher import service
    from kvfetcher.config import Config

    def refuse(*a, **kw):
        raise OSError("no process may be started here")

    monkeypatch.setattr(service, "ReadProcs", refuse)
    kv, tokens = kv_of(), list(range(500, 500 + TOKENS))
    sc = service.Sidecar(LocalStore(tmp_path), Config(chunk_tokens=CHUNK, presets=("raw",), decode_procs=0, warm_up=False, read_procs=2))
    await sc.start()
    try:
        assert sc.readers is None and 'reason="readers"} 1.0' in sc.metrics.exposition().decode()
        await sc.store(sc.register(shm((L, 2, H, TOKENS, D), fill=kv).handle, "fp"), tokens)
        await sc.flush()
        dst_buf = shm((L, 2, H, TOKENS, D), fill=SENTINEL)
        assert (await sc.fetch(sc.register(dst_buf.handle, "fp"), tokens)).loaded_tokens == TOKENS
        assert torch.equal(dst_buf.tensor, kv)
    finally:
        await sc.close()


@pytest.mark.parametrize("damage", [None, corrupt_segment, corrupt_side])
async def test_decode_workers_restore_entropy_chunks_from_the_readers_staging(tmp_path, readers, workers, shm, damage):
    """An entropy-coded chunk read into the readers' shared staging is restored there by a decode
    worker, no copy between (each worker a GIL of its own): what the sidecar's threads restore,
    and a damaged part still never reaches the buffer."""
    store = LocalStore(tmp_path)
    kv = kv_of()
    refs = put_chunks(store, kv, CHUNK, "q8-zstd")
    want = torch.full((L, 2, H, TOKENS, D), SENTINEL, dtype=torch.float16)
    out = await fetch(store, refs, Destination(want, tokens=TOKENS))  # in this process, from bytes
    assert out.error is None, out.detail
    if damage is not None:
        refs[1] = damage(store, refs[1])
    buf = shm((L, 2, H, TOKENS, D), fill=SENTINEL)
    before = workers.stats["chunks"]
    out = await fetch(store, refs, Destination(buf.tensor, tokens=TOKENS, handle=buf.handle), readers=readers(store), workers=workers, window=1)
    if damage is None:
        assert out.error is None and out.loaded_tokens == TOKENS, out.detail
        assert workers.stats["chunks"] - before == len(refs)  # every chunk restored by a worker
        assert torch.equal(buf.tensor, want)
    else:
        assert out.error == "corrupt" and out.loaded_tokens == CHUNK and out.bad_object == refs[1].name
        assert torch.equal(buf.tensor[:, :, :, :CHUNK], want[:, :, :, :CHUNK])
        assert bool((buf.tensor[:, :, :, CHUNK : 2 * CHUNK] == SENTINEL).all())  # (a later chunk, verified, may have landed)


@pytest.mark.parametrize("damage", [None, corrupt_segment, corrupt_side])
async def test_whole_objects_left_to_workers_are_checked_here_when_no_worker_can_map_the_buffer(tmp_path, readers, workers, shm, damage):
    """A chunk read whole is checked by the worker that restores it, not before; when the workers
    cannot map the KV buffer after all, this process decodes it and checks it first: a damaged part
    still never reaches the buffer."""
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv_of(), CHUNK, "q8-zstd")
    want = torch.full((L, 2, H, TOKENS, D), SENTINEL, dtype=torch.float16)
    assert (await fetch(store, refs, Destination(want, tokens=TOKENS))).error is None
    if damage is not None:
        refs[1] = damage(store, refs[1])
    buf = shm((L, 2, H, TOKENS, D), fill=SENTINEL)
    gone = dict(buf.handle, inode=[0, 0])  # a handle no worker can open: it names another file
    before = workers.stats["chunks"]
    out = await fetch(store, refs, Destination(buf.tensor, tokens=TOKENS, handle=gone), readers=readers(store), workers=workers, window=1)
    assert workers.stats["chunks"] == before  # every chunk restored in this process
    if damage is None:
        assert out.error is None and torch.equal(buf.tensor, want), out.detail
    else:
        assert out.error == "corrupt" and out.loaded_tokens == CHUNK and out.bad_object == refs[1].name
        assert bool((buf.tensor[:, :, :, CHUNK : 2 * CHUNK] == SENTINEL).all())
