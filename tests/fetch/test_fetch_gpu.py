"""GPU data path: the pipeline restores chunks into a CUDA KV buffer (NVDEC for HEVC presets),
byte-identical to the CPU path. Skipped without CUDA (CI); run on the lent GPU machine."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from kvfetcher import codec, ipc
from kvfetcher.fetch import decode_worker
from kvfetcher.fetch.readers import ReadProcs, SharedStaging
from kvfetcher.fetch.slab import Slab
from kvfetcher.fetch.workers import DecodeWorkers, warmup_object
from kvfetcher.kvbuffer import Destination
from kvfetcher.chunk import decode_chunk, encode_chunk
from kvfetcher.format import container
from kvfetcher.api.client import KVClient
from kvfetcher.store.local import LocalStore
from kvfetcher.fetch.plan import FetchOptions

from kvtest import SENTINEL, corrupt_segment, crafted, decoded, fetch, free_port, put_chunks, raw_request, synthetic_kv

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preset", ["raw", "exact", "q8"])
def test_fetch_into_a_cuda_buffer_matches_the_cpu_path(tmp_path, preset):
    kv = synthetic_kv(layers=6, heads=2, tokens=256, head_dim=64)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 128, preset=preset)
    buf = torch.full((6, 2, 2, 300, 64), SENTINEL, dtype=torch.float16, device="cuda")
    out = asyncio.run(fetch(store, refs, Destination(buf, offset=20, tokens=256), device=torch.device("cuda")))
    assert out.error is None and out.loaded_tokens == 256, out
    assert torch.equal(buf[:, :, :, 20:276].cpu(), decoded(store, refs))
    assert bool((buf[:, :, :, :20] == SENTINEL).all()) and bool((buf[:, :, :, 276:] == SENTINEL).all())
    if preset != "raw":
        assert codec.decoder("hevc", "cuda").name.startswith("nvdec")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_raw_chunk_with_non_finite_values_never_reaches_a_cuda_buffer(tmp_path, bad):
    """The direct path checks a GPU buffer's chunks finite on the device, before the copy into the slots."""
    kv = synthetic_kv(layers=2, heads=2, tokens=256, head_dim=64)
    kv[1, 0, 1, 130, 7] = bad  # in the second chunk
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 128)
    buf = torch.full((2, 2, 2, 256, 64), SENTINEL, dtype=kv.dtype, device="cuda")
    out = asyncio.run(fetch(store, refs, Destination(buf, offset=0, tokens=256), device=torch.device("cuda")))
    assert (out.error, out.loaded_tokens, out.bad_object) == ("corrupt", 128, refs[1].name), out
    assert torch.equal(buf[:, :, :, :128].cpu(), kv[:, :, :, :128])
    assert bool((buf[:, :, :, 128:] == SENTINEL).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scattered", [False, True])
def test_raw_direct_path_copies_pinned_host_memory_into_a_cuda_buffer(tmp_path, dtype, scattered):
    """raw: ranged GETs into pinned staging buffers, CRC, one non-blocking host-to-device copy,
    waited for before the chunk counts: bit-exact, and nothing outside the slots."""
    from kvfetcher.fetch.staging import StagingPool

    g = torch.Generator().manual_seed(0)
    kv = torch.randint(0, 256, (6 * 2 * 2 * 512 * 64 * 2,), dtype=torch.uint8, generator=g).view(dtype).view(6, 2, 2, 512, 64)
    kv = kv.masked_fill(~torch.isfinite(kv), 0)  # every finite bit pattern (a restore refuses NaNs and infinities)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 128)
    buf = torch.full((6, 2, 2, 700, 64), SENTINEL, dtype=dtype, device="cuda")
    slots = torch.randperm(700, generator=g)[:512].tolist() if scattered else list(range(90, 602))
    dest = Destination(buf, slots=slots)
    pool = StagingPool()
    for _ in range(2):  # the second fetch reuses the first one's pinned buffers
        out = asyncio.run(fetch(store, refs, dest, device=torch.device("cuda"), staging_pool=pool, window=2))
        assert out.error is None and out.loaded_tokens == 512 and out.direct_chunks == 4, out
    assert pool.allocated <= 2
    assert all(b.is_pinned() for bufs in pool._free.values() for b in bufs)
    got = buf[:, :, :, slots].cpu()
    assert torch.equal(got.view(torch.uint8), kv.view(torch.uint8))
    rest = sorted(set(range(700)) - set(slots))
    assert bool((buf[:, :, :, rest] == SENTINEL).all())


@pytest.mark.parametrize("preset", ["raw", "q8"])
def test_decode_worker_processes_write_through_cuda_ipc(tmp_path, preset):
    """NVDEC in worker processes, each opening the buffer's CUDA IPC handle: same bytes as in-process."""
    kv = synthetic_kv(layers=6, heads=2, tokens=512, head_dim=64)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 128, preset=preset)
    buf = ipc.allocate((6, 2, 2, 600, 64), torch.float16, "cuda")
    buf.tensor.fill_(SENTINEL)
    workers = DecodeWorkers(3)
    try:
        dest = Destination(buf.tensor, offset=40, tokens=512, handle=buf.handle)
        out = asyncio.run(fetch(store, refs, dest, device=torch.device("cuda"), workers=workers))
    finally:
        workers.close()
    assert out.error is None and out.loaded_tokens == 512, out
    assert torch.equal(buf.tensor[:, :, :, 40:552].cpu(), decoded(store, refs))
    assert bool((buf.tensor[:, :, :, :40] == SENTINEL).all()) and bool((buf.tensor[:, :, :, 552:] == SENTINEL).all())


def test_a_worker_page_locks_the_shared_memory_it_maps_and_lets_it_go(monkeypatch):
    """A decode worker's mapping of shared memory is page-locked (its parts go to the GPU by DMA, in
    place), unpinned when the mapping is dropped; one larger than PIN_MAX_BYTES (an engine's arena) stays pageable."""
    owner, large = Slab(1 << 20), Slab(2 << 20)
    monkeypatch.setattr(decode_worker, "PIN_MAX_BYTES", 1 << 20)
    torch.cuda.init()  # (a worker pins only once it uses CUDA: it has opened a GPU buffer by then)
    state = decode_worker._WorkerState()
    mem, host = state.view(owner.path, owner.size)
    assert host is not None and host.is_pinned() and host.data_ptr() == torch.frombuffer(mem, dtype=torch.uint8).data_ptr()
    assert state.view(large.path, large.size)[1] is None
    del mem, host
    m = state.slabs.pop(owner.path)
    m.close()
    assert m.host is None and m.slab.mm.closed
    owner.close()
    large.close()


@pytest.mark.parametrize("damage", [None, corrupt_segment])
def test_decode_workers_restore_ans_chunks_from_the_readers_staging_in_place(tmp_path, damage):
    """nvCOMP chunks read by reader processes are decoded by the workers from the staging they map
    (page-locked there): the bytes the sidecar's threads restore, and a damaged one never written."""
    kv = synthetic_kv(layers=6, heads=2, tokens=512, head_dim=64)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 128, preset="q8-ans")
    want = torch.full((6, 2, 2, 512, 64), SENTINEL, dtype=torch.float16, device="cuda")
    assert asyncio.run(fetch(store, refs, Destination(want, tokens=512), device=torch.device("cuda"))).error is None
    if damage is not None:
        refs[2] = damage(store, refs[2])
    buf = ipc.allocate((6, 2, 2, 512, 64), torch.float16, "cuda")
    buf.tensor.fill_(SENTINEL)
    workers, readers = DecodeWorkers(2), ReadProcs(store.opener(), 2, SharedStaging())
    try:
        dest = Destination(buf.tensor, tokens=512, handle=buf.handle)
        out = asyncio.run(fetch(store, refs, dest, device=torch.device("cuda"), readers=readers, workers=workers, window=1))
        chunks = workers.stats["chunks"]
    finally:
        workers.close()
        readers.close()
    if damage is None:
        assert out.error is None and out.loaded_tokens == 512 and chunks == len(refs), out
        assert torch.equal(buf.tensor, want)
    else:
        assert out.error == "corrupt" and out.loaded_tokens == 256 and out.bad_object == refs[2].name, out
        assert torch.equal(buf.tensor[:, :, :, :256], want[:, :, :, :256])
        assert bool((buf.tensor[:, :, :, 256:384] == SENTINEL).all())


@pytest.mark.parametrize("in_workers", [False, True])
def test_crafted_zstd_frames_from_a_store_not_trusted_never_reach_nvcomp(tmp_path, in_workers):
    """nvCOMP can fault the GPU's context on noise frames under right CRC-32s: a
    fetch that does not trust its store (a sidecar without an object key) decodes zstd on the CPU,
    which refuses them, in a decode worker as in this process; nothing reaches the buffer, the GPU
    stays usable, and the object is named bad."""
    kv = synthetic_kv(layers=6, heads=2, tokens=256, head_dim=64)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 128, preset="q8-zstd")
    refs[1] = crafted(store, refs[1])
    buf = ipc.allocate((6, 2, 2, 256, 64), torch.float16, "cuda")
    buf.tensor.fill_(SENTINEL)
    workers, readers = (DecodeWorkers(2), ReadProcs(store.opener(), 2, SharedStaging())) if in_workers else (None, None)
    try:
        out = asyncio.run(fetch(store, refs, Destination(buf.tensor, tokens=256, handle=buf.handle), device=torch.device("cuda"),
                                readers=readers, workers=workers, window=1, trust_store=False))
        chunks = workers.stats["chunks"] if workers else None
    finally:
        for w in (workers, readers):
            if w is not None:
                w.close()
    assert out.error == "corrupt" and out.loaded_tokens == 128 and out.bad_object == refs[1].name, out
    assert bool((buf.tensor[:, :, :, 128:] == SENTINEL).all())  # (the GPU still answers)
    assert chunks in (None, 1)  # the good chunk restored by a worker, the crafted one refused there


def test_ans_objects_from_a_store_not_trusted_are_not_decoded_and_kept(tmp_path):
    """ans decodes only with nvCOMP: a fetch that does not trust its store reads none (a decoder
    failure, the model recomputes), and the object, not shown bad, is not named for deletion."""
    kv = synthetic_kv(layers=6, heads=2, tokens=256, head_dim=64)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 128, preset="q8-ans")
    buf = torch.full((6, 2, 2, 256, 64), SENTINEL, dtype=torch.float16, device="cuda")
    out = asyncio.run(fetch(store, refs, Destination(buf, tokens=256), device=torch.device("cuda"), trust_store=False))
    assert out.error == "decoder" and out.bad_object is None and out.loaded_tokens == 0, out
    assert bool((buf == SENTINEL).all())
    out = asyncio.run(fetch(store, refs, Destination(buf, tokens=256), device=torch.device("cuda")))  # trusted: decoded
    assert out.error is None and out.loaded_tokens == 256, out


def test_cuda_ipc_buffer_through_a_sidecar_process(tmp_path):
    """The GPU protocol end to end: a sidecar process opens the model's CUDA buffer by IPC handle,
    stores from it and restores into it (NVDEC), over HTTP."""
    port = free_port()
    env = dict(os.environ, KVFETCHER_STORE_DIR=str(tmp_path / "store"), KVFETCHER_AUTH_TOKEN="t", KVFETCHER_PRESET="q8,raw", KVFETCHER_CHUNK_TOKENS="64")
    env.pop("KVFETCHER_S3_ENDPOINT", None)
    proc = subprocess.Popen([sys.executable, "-m", "kvfetcher.cli", "serve", "--host", "127.0.0.1", "--port", str(port)], env=env)
    try:
        for _ in range(300):
            try:
                if raw_request(port, "GET", "/readyz")[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        kv = synthetic_kv(layers=4, heads=2, tokens=192, head_dim=64)
        buf = ipc.allocate((4, 2, 2, 256, 64), torch.float16, "cuda")
        buf.tensor[:, :, :, :192] = kv.cuda()
        c = KVClient(f"http://127.0.0.1:{port}", token="t")
        bid = c.register(buf.handle, "m")
        assert c.store(bid, list(range(192))).queued_chunks == 3
        c.flush()
        for preset in ("q8", "raw"):
            buf.tensor.fill_(SENTINEL)
            torch.cuda.synchronize()
            r = c.fetch(bid, list(range(192)), offset=32, options=FetchOptions(presets=[preset], recompute_tokens_per_s=1.0))
            assert (r.error, r.loaded_tokens, r.decision.preset) == (None, 192, preset), r
            got = buf.tensor[:, :, :, 32:224].cpu()
            if preset == "raw":
                assert torch.equal(got, kv)
            else:
                assert (got.float() - kv.float()).abs().max() < 0.1
            assert bool((buf.tensor[:, :, :, :32] == SENTINEL).all())
        print("decode rate:", [l for l in c.metrics().splitlines() if l.startswith("kvfetcher_decode_bytes_per_second")])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_a_thread_that_ran_nvdec_still_runs_torch_stream_work(tmp_path):
    """Decode threads are shared by NVDEC decodes and the direct raw path's pinned copies: after an
    NVDEC decode, the same thread must still record events and copy on torch's streams (with
    decoders in a context of their own this failed with 'invalid resource handle')."""
    from concurrent.futures import ThreadPoolExecutor

    obj = encode_chunk(synthetic_kv(layers=4, heads=2, tokens=128, head_dim=64), "q8", "fp")

    def work() -> bool:
        decode_chunk(obj, "fp", "cuda")
        src = torch.arange(1 << 20, dtype=torch.int32).pin_memory()
        s, done = torch.cuda.Stream(), torch.cuda.Event()
        with torch.cuda.stream(s):
            dst = src.to("cuda", non_blocking=True)
            done.record()
        done.synchronize()
        return bool(torch.equal(dst.cpu(), src))

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(work).result()
    assert work()  # and in the main thread


@pytest.mark.parametrize("preset", ["q8", "balanced"])
def test_warmed_decode_workers_restore_a_chunk_as_decode_chunk_does(preset):
    """Workers warmed on the GPU (NVDEC, unpack kernels and the basis in each, on scratch tensors),
    then a chunk restored through CUDA IPC: the bytes of decode_chunk on the GPU, nothing else touched."""
    kv = synthetic_kv(layers=6, tokens=256, dtype=torch.float16)
    obj = encode_chunk(kv, preset, "fp", start=256, rope_theta=10000.0)
    h = container.parse_header(obj)
    buf = ipc.allocate((6, 2, kv.shape[2], 512, kv.shape[4]), torch.float16, "cuda")
    workers = DecodeWorkers(2)
    try:
        w = workers.warm("cuda", [warmup_object(p) for p in ("q8", "balanced")])
        assert w.restored == [2, 2] and not w.errors, w
        side = container.slice_segment(obj, h, h.side) if h.side else None
        segments = [container.slice_segment(obj, h, s) for s in h.segments]
        n = asyncio.run(workers.restore(buf.handle, obj[: h.header_size], side, segments, range(100, 356)))
    finally:
        workers.close()
    assert n == kv.numel() * kv.element_size()
    assert torch.equal(buf.tensor[:, :, :, 100:356], decode_chunk(obj, "fp", device="cuda"))
    assert buf.tensor[:, :, :, :100].abs().sum() == 0 and buf.tensor[:, :, :, 356:].abs().sum() == 0


def test_a_gpu_buffer_is_warmed_in_the_sidecars_threads_without_decode_workers(tmp_path):
    """decode_procs=0: the registration restores a chunk of each coded preset here, on the buffer's GPU."""
    from kvfetcher.config import Config
    from kvfetcher.service import Sidecar

    async def run():
        sc = Sidecar(LocalStore(tmp_path), Config(chunk_tokens=128, presets=("raw", "q8"), decode_procs=0, read_procs=0, warm_up=True))
        await sc.start()
        buf = ipc.allocate((6, 2, 2, 256, 64), torch.float16, "cuda")
        try:
            sc.register(buf.handle, "fp")
            await sc.warmed()
            assert sc.metrics.warm_up_seconds._value.get() > 0
            assert 'kvfetcher_errors_total{reason="warm_up"}' not in sc.metrics.exposition().decode()
        finally:
            await sc.close()
            buf.close()

    asyncio.run(run())
