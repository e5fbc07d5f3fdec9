"""The raw preset's direct path: the KV buffer's own bytes, ranged GETs into host memory,
checksums per segment, one copy into the destination. On a local directory and on a real S3
server (moto on loopback), and through a store without ``get_into`` (the benchmarks' LinkStore)."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvfetcher.format import container
from kvfetcher.fetch import executor
from kvfetcher.kvbuffer import Destination
from kvfetcher.store import read_into
from kvfetcher.store.local import LocalStore
from kvfetcher.fetch.plan import FetchOptions

from benchmarks.lib.linkstore import LinkStore
from kvtest import DAMAGES, SENTINEL, corrupt_segment, fetch, open_store, put_chunks, running

L, H, D, TOKENS, CHUNK = 3, 2, 32, 96, 32


@pytest.fixture(autouse=True)
def segments_arrive_by_ranged_reads(monkeypatch):
    """Test chunks are KBs, real ones MBs: give raw objects one segment per layer and make the
    header read short, so that segments reach the staging buffer by ranged reads (``get_into``),
    the first one partly from the header read, as with real chunks."""
    from dataclasses import replace

    from kvfetcher.format import presets

    monkeypatch.setitem(presets.PRESETS, "raw", replace(presets.get("raw"), segment_bytes=1))
    monkeypatch.setattr(executor, "HEADER_GUESS", 1024)


def random_bits(dtype: torch.dtype, tokens: int = TOKENS, seed: int = 0) -> torch.Tensor:
    """Every finite bit pattern (a restore refuses NaNs and infinities): bit-exact means exactly that."""
    g = torch.Generator().manual_seed(seed)
    n = L * 2 * H * tokens * D * torch.finfo(dtype).bits // 8
    kv = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(L, 2, H, tokens, D)
    return kv.masked_fill(~torch.isfinite(kv), 0)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture(params=["local", "s3", "linkstore"])
def store(request):
    """Both store backends, and a store without get_into: the fallback (get, then one copy)."""
    return LinkStore() if request.param == "linkstore" else open_store(request.param, request)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("where", ["offset", "scattered", "buffer-is-a-view"])
async def test_raw_round_trip_is_bit_exact(store, dtype, where):
    kv = random_bits(dtype)
    refs = put_chunks(store, kv, CHUNK)
    big = torch.full((L, 2, H, 300, D), SENTINEL, dtype=dtype)
    if where == "offset":  # contiguous slots: a strided view buffer[:, :, :, a:a+T]
        dest, slots = Destination(big, offset=17, tokens=TOKENS), list(range(17, 17 + TOKENS))
    elif where == "scattered":  # a paged cache: index_copy_
        slots = torch.randperm(300, generator=torch.Generator().manual_seed(1))[:TOKENS].tolist()
        dest = Destination(big, slots=slots)
    else:  # the registered buffer is itself a non-contiguous view of a larger allocation
        dest, slots = Destination(big[:, :, :, 100:250], offset=10, tokens=TOKENS), list(range(110, 110 + TOKENS))
    out = await fetch(store, refs, dest)
    assert out.error is None and out.loaded_tokens == TOKENS, out.detail
    assert out.direct_chunks == len(refs) and out.kv_bytes == kv.numel() * kv.element_size()
    assert out.bytes_read == sum(r.size for r in refs)  # nothing read twice
    assert same_bits(big[:, :, :, slots], kv)
    untouched = sorted(set(range(300)) - set(slots))
    assert bool((big[:, :, :, untouched] == SENTINEL).all())


@pytest.mark.parametrize("damage, reason", DAMAGES)
async def test_a_bad_raw_chunk_never_touches_the_buffer(store, damage, reason):
    kv = random_bits(torch.float16, tokens=128)
    refs = put_chunks(store, kv, CHUNK)
    refs[2] = damage(store, refs[2])
    buf = torch.full((L, 2, H, 128, D), SENTINEL, dtype=torch.float16)
    out = await fetch(store, refs, Destination(buf, tokens=128), window=1)
    assert out.error == reason, out.detail
    assert out.loaded_tokens == 64 and same_bits(buf[:, :, :, :64], kv[:, :, :, :64])
    assert bool((buf[:, :, :, 64:] == SENTINEL).all())  # the bad chunk (and what follows) never written
    assert out.bad_object == refs[2].name  # the service deletes it, so the next store repairs it


async def test_a_corrupt_last_segment_is_caught_with_wide_windows(tmp_path):
    """All chunks in flight at once: the bad one and everything after it stay out of the buffer."""
    kv = random_bits(torch.bfloat16, tokens=256)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, CHUNK)
    corrupt_segment(store, refs[5])
    buf = torch.full((L, 2, H, 256, D), SENTINEL, dtype=torch.bfloat16)
    out = await fetch(store, refs, Destination(buf, tokens=256), window=8)
    assert out.error == "corrupt" and out.loaded_tokens == 5 * CHUNK
    assert same_bits(buf[:, :, :, : 5 * CHUNK], kv[:, :, :, : 5 * CHUNK])
    assert bool((buf[:, :, :, 5 * CHUNK : 6 * CHUNK] == SENTINEL).all())


def test_read_into_uses_get_into_or_falls_back(store):
    data = bytes(range(256)) * 40
    store.put("kv/x/raw.kvfc", data)
    buf = bytearray(100)
    assert read_into(store, "kv/x/raw.kvfc", 1000, memoryview(buf)) == 100 and bytes(buf) == data[1000:1100]
    assert read_into(store, "kv/x/raw.kvfc", len(data) - 30, memoryview(buf)) == 30  # short at the end
    assert bytes(buf[:30]) == data[-30:]
    assert read_into(store, "kv/x/raw.kvfc", len(data) + 5, memoryview(buf)) == 0  # past the end


def test_native_objects_are_the_buffers_bytes():
    """The stored payload is the chunk's KV bytes in [layers, 2, kv_heads, tokens, head_dim] order."""
    from kvfetcher.chunk import encode_chunk

    kv = random_bits(torch.bfloat16, tokens=CHUNK)
    obj = encode_chunk(kv, "raw", "fp")
    h = container.parse_header(obj)
    assert container.is_native(h) and h.side is None
    assert obj[h.header_size :] == kv.contiguous().view(torch.uint8).numpy().tobytes()


async def test_staging_buffers_are_reused_across_chunks_and_fetches(tmp_path):
    from kvfetcher.fetch.staging import StagingPool

    kv = random_bits(torch.float16, tokens=256)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, CHUNK)
    pool = StagingPool()
    for _ in range(2):
        buf = torch.full((L, 2, H, 256, D), SENTINEL, dtype=torch.float16)
        out = await fetch(store, refs, Destination(buf, tokens=256), window=2, staging_pool=pool)
        assert out.error is None and same_bits(buf, kv)
    assert pool.allocated <= 2  # at most one per chunk in flight, then reused: 8 chunks x 2 fetches


async def test_a_read_abandoned_at_the_deadline_never_lands_in_a_reused_buffer(tmp_path, monkeypatch):
    """A GET still running in its thread when the fetch gives up keeps writing into its staging
    buffer: that buffer must not go back to the pool, where another chunk could be verified in it
    and then overwritten before its copy. It goes back once that read has ended."""
    import numpy as np

    from kvfetcher.fetch.staging import StagingPool

    class SlowSegments(LocalStore):  # headers come at once, segment reads take 0.5 s
        targets: list[int] = []

        def get_into(self, name, offset, buf):
            self.targets.append(np.frombuffer(buf, dtype=np.uint8).ctypes.data)
            time.sleep(0.5)
            return super().get_into(name, offset, buf)

    kv = random_bits(torch.float16, tokens=128)
    store = SlowSegments(tmp_path)
    refs = put_chunks(store, kv, CHUNK)
    monkeypatch.setattr(executor, "HEADER_GUESS", 64)  # the header read brings no segment bytes: all slow
    pool = StagingPool()
    buf = torch.full((L, 2, H, 128, D), SENTINEL, dtype=torch.float16)
    holds = lambda addr: [b for bufs in pool._free.values() for b in bufs if b.data_ptr() <= addr < b.data_ptr() + b.numel()]  # noqa: E731
    with ThreadPoolExecutor(8) as io, ThreadPoolExecutor(2) as dec:
        out = await executor.fetch(store, refs, Destination(buf, tokens=128), fingerprint="fp", io_pool=io, decode_pool=dec,
                                   deadline_s=0.2, staging_pool=pool, window=4)
        assert out.error == "deadline" and out.loaded_tokens == 0 and store.targets
        assert not any(holds(addr) for addr in store.targets)  # no free buffer contains an address a running read writes to
    assert all(holds(addr) for addr in store.targets)  # once those reads ended, their buffers are back for reuse
    assert bool((buf == SENTINEL).all())


def test_size_classes_are_at_most_an_eighth_larger_and_shared_by_nearby_sizes():
    from kvfetcher.fetch.staging import size_class

    for n in [1, 15, 16, 17, 4096, 4097, 9_700_000, 33_554_432, 33_554_433]:
        c = size_class(n)
        assert n <= c <= max(16, n + n // 8) and size_class(c) == c
    assert size_class(9_500_000) == size_class(10_400_000) == 10 << 20


def test_reserve_allocates_ahead_once_and_within_keep():
    from kvfetcher.fetch.staging import StagingPool

    pool = StagingPool(keep=4)
    assert pool.reserve(4096, False, 3) == 3 and pool.allocated == 3
    assert pool.reserve(4096, False, 3) == 0  # already there
    taken = [pool.take(4096, False) for _ in range(3)]
    assert pool.allocated == 3 and all(int(b.sum()) == 0 for b in taken)  # reserved, touched, then handed out
    assert pool.reserve(4096, False, 10) == 4 and pool.allocated == 7  # at most ``keep`` wait


async def test_a_registered_buffer_has_its_raw_staging_before_the_first_fetch(tmp_path, shm):
    """Registration reserves the direct path's staging in the background, so the first raw fetch
    allocates none (on an H100 a first raw fetch ran 7x slower than the next)."""
    from kvfetcher.fetch import staging

    kv = random_bits(torch.float16, tokens=128)
    buf = shm(kv.shape, kv.dtype)
    async with running(LocalStore(tmp_path), chunk_tokens=CHUNK, presets=("raw",), decode_procs=0, device="cpu") as sc:
        buf.tensor.copy_(kv)
        bid = sc.register(buf.handle, "m")
        await sc._warming
        before = staging.shared().allocated
        await sc.store(bid, list(range(128)))
        await sc.flush()
        buf.tensor.fill_(SENTINEL)
        r = await sc.fetch(bid, list(range(128)), options=FetchOptions(recompute_tokens_per_s=1e-9))
        assert (r.error, r.loaded_tokens, r.decision.preset) == (None, 128, "raw"), r
        assert same_bits(buf.tensor, kv) and staging.shared().allocated == before
