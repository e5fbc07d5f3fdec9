"""nvCOMP on the GPU: ans and zstd round trips, GPU and CPU zstd reading each other's bitstreams,
and chunks coded and restored on the GPU giving the CPU path's KV bit for bit."""

import pytest
import torch

from kvfetcher import chunk, codec
from kvfetcher.codec import entropy, layout, nvcomp
from kvfetcher.errors import ContainerError
from kvfetcher.format import container
from kvfetcher.kvbuffer import Destination

from kvtest import flip

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not nvcomp.available(), reason="needs a CUDA GPU and nvCOMP")]
SHIPPED_FP = "smollm2-135m-instruct-q4_1/float32"


def _frames(shape=(3, 3, 1024, 512), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 5 + 128).clamp(0, 255).to(torch.uint8)


@pytest.mark.parametrize("fmt", ["ans", "zstd"])
@pytest.mark.parametrize("block", [1 << 14, 1 << 16, 1 << 18])
def test_gpu_round_trip(fmt, block):
    f = _frames().cuda()
    enc = codec.encoder(fmt, "cuda")
    assert enc.name == f"nvcomp-{fmt}"
    data = enc.encode(f, codec.CodecParams(format=fmt, block_bytes=block))
    assert len(data) < f.numel()
    out = codec.decoder(fmt, "cuda").decode(data, tuple(f.shape), "cuda")
    assert out.is_cuda and torch.equal(out, f)


@pytest.mark.parametrize("fmt", ["ans", "zstd"])
def test_parts_coded_in_one_batch_are_the_bitstreams_coded_one_by_one(fmt):
    """Parts of any size (a last block shorter than the others) each get the bitstream of their own."""
    parts = [_frames((2, 3, 256, 512), seed=i).cuda().view(-1)[: n] for i, n in enumerate((786432, 700000, 65536 * 3))]
    params = codec.CodecParams(format=fmt, block_bytes=1 << 16)
    enc = nvcomp.NvcompCodec(fmt)
    together = [bytes(b) for b in enc.encode_parts(parts, params)]
    assert together == [bytes(enc.encode(f, params)) for f in parts]
    for f, data in zip(parts, together):
        assert torch.equal(codec.decoder(fmt, "cuda").decode(data, (1, 1, 1, f.numel()), "cuda").view(-1), f)


@pytest.mark.parametrize("graphs", ["0", "2"])
def test_chunks_encoded_together_on_the_gpu_are_the_ones_encoded_alone(graphs, monkeypatch):
    monkeypatch.setenv("KVFETCHER_ENCODE_GRAPHS", graphs)
    g = torch.Generator().manual_seed(3)
    kvs = [(torch.randn(30, 2, 3, 256, 64, generator=g) * 2).to(torch.float16).cuda() for _ in range(3)]
    todo = [chunk.ToEncode(kv, 256 * i, {"i": i}) for i, kv in enumerate(kvs)]
    for _ in range(2):  # (the second time from graphs, where allowed)
        alone = [chunk.encode_chunk(t.kv, "transform-ans", SHIPPED_FP, t.meta, t.start, rope_theta=1e5) for t in todo]
        assert chunk.encode_chunks(todo, "transform-ans", SHIPPED_FP, rope_theta=1e5) == alone


def test_gpu_zstd_is_read_by_the_cpu_and_the_cpus_by_the_gpu():
    f = _frames(seed=1)
    params = codec.CodecParams(format="zstd", block_bytes=1 << 16)
    gpu = nvcomp.NvcompCodec("zstd").encode(f.cuda(), params)
    assert torch.equal(entropy.ZstdCodec().decode(gpu, tuple(f.shape)), f)
    cpu = entropy.ZstdCodec().encode(f, params)
    assert torch.equal(nvcomp.NvcompCodec("zstd").decode(cpu, tuple(f.shape), "cpu"), f)


def test_a_corrupt_ans_object_never_reaches_the_buffer():
    kv = torch.randn(30, 2, 3, 64, 64, dtype=torch.float16, device="cuda")
    obj = chunk.encode_chunk(kv, "q8-ans", "fp")
    h = container.parse_header(obj)
    seg = h.segments[0]
    out = torch.full(kv.shape, 7.0, dtype=kv.dtype, device="cuda")
    with pytest.raises(ContainerError):
        chunk.decode_chunk(flip(obj, h.header_size + seg.offset + seg.length // 2), "fp", device="cuda", out=out)
    assert bool((out == 7.0).all())


@pytest.mark.parametrize("name", ["q8", "balanced", "compact", "transform"])
def test_a_chunk_coded_on_the_gpu_restores_what_its_planes_give_on_any_path(name):
    """Packed and coded on the GPU, ``-ans`` and ``-zstd`` objects hold the very planes the layout made
    (lossless), so a GPU restore, the CPU zstd decode and the layout's own unpack of those planes
    agree bit for bit (the unpack compared on one device)."""
    g = torch.Generator().manual_seed(2)
    kv = (torch.randn(30, 2, 3, 256, 64, generator=g) * 2).to(torch.float16).cuda()
    objs = {fmt: chunk.encode_chunk(kv, f"{name}-{fmt}", SHIPPED_FP, start=256, rope_theta=1e5) for fmt in ("ans", "zstd")}
    h = container.parse_header(objs["zstd"])
    planes = {}
    for fmt, obj in objs.items():
        hh = container.parse_header(obj)
        data = container.slice_segment(obj, hh, hh.segments[0])
        planes[fmt] = codec.decoder(fmt, "cuda").decode(data, tuple(hh.frame_shape), "cuda")
    planes["cpu"] = entropy.ZstdCodec().decode(container.slice_segment(objs["zstd"], h, h.segments[0]), tuple(h.frame_shape)).cuda()
    assert torch.equal(planes["ans"], planes["zstd"]) and torch.equal(planes["zstd"], planes["cpu"])
    side = container.side_tensor(h, container.slice_segment(objs["zstd"], h, h.side)).cuda()
    reference = layout.unpack(planes["cpu"], side, tuple(kv.shape), kv.dtype, h.layout, start=256)
    for obj in objs.values():
        buf = torch.zeros(kv.shape, dtype=kv.dtype, device="cuda")
        chunk.decode_chunk(obj, SHIPPED_FP, device="cuda", out=buf)
        assert torch.equal(buf, reference)
    cpu = chunk.decode_chunk(objs["zstd"], SHIPPED_FP, device="cpu", backend="zstd")  # the CPU reader's restore
    assert (cpu.float() - reference.cpu().float()).abs().max() <= 1e-2 * reference.float().abs().max()  # torch vs kernel rounding


def test_the_fused_restore_writes_a_scattered_destination():
    kv = torch.randn(30, 2, 3, 128, 64, dtype=torch.float16, device="cuda")
    obj = chunk.encode_chunk(kv, "q8-ans", "fp")
    want = chunk.decode_chunk(obj, "fp", device="cuda")
    buf = torch.zeros(30, 2, 3, 300, 64, dtype=torch.float16, device="cuda")
    slots = list(range(299, 299 - 256, -2))[:128]
    h = container.parse_header(obj)
    mem = memoryview(obj)
    part = lambda s: mem[h.header_size + s.offset : h.header_size + s.offset + s.length]  # noqa: E731
    from kvfetcher.kvbuffer import ChunkRef

    chunk.restore_chunk(Destination(buf, tokens=128, slots=slots), ChunkRef("", len(obj), 0, 128), h, part(h.side),
                        [part(s) for s in h.segments])
    assert torch.equal(buf[:, :, :, slots], want)


def test_a_bitstream_decodes_alike_from_bytes_a_pinned_tensor_and_a_pageable_one():
    f = _frames(seed=3).cuda()
    data = codec.encoder("ans", "cuda").encode(f, codec.CodecParams(format="ans", block_bytes=1 << 16))
    dec = codec.decoder("ans", "cuda")
    pinned = torch.empty(len(data), dtype=torch.uint8, pin_memory=True)
    pinned.numpy()[:] = memoryview(data)
    for src in (data, memoryview(data), pinned, pinned.clone()):
        assert torch.equal(dec.decode(src, tuple(f.shape), "cuda"), f)


def test_decodes_from_bytes_queued_back_to_back_each_get_their_own_payload():
    """A decode does not wait for the GPU, and the next one reuses the thread's pinned buffer: it
    must not overwrite a payload whose copy is still queued."""
    frames = [_frames(shape=(8, 3, 1024, 512), seed=s).cuda() for s in range(6)]
    params = codec.CodecParams(format="ans", block_bytes=1 << 16)
    datas = [codec.encoder("ans", "cuda").encode(f, params) for f in frames]
    dec = codec.decoder("ans", "cuda")
    outs = [dec.decode(d, tuple(frames[0].shape), "cuda") for d in datas * 3]
    assert all(torch.equal(o, frames[i % 6]) for i, o in enumerate(outs))


def test_a_callers_host_tensor_may_be_reused_once_the_decode_returns():
    f = _frames(shape=(8, 3, 1024, 512), seed=5).cuda()
    data = codec.encoder("ans", "cuda").encode(f, codec.CodecParams(format="ans", block_bytes=1 << 16))
    for pinned in (True, False):
        host = torch.empty(len(data), dtype=torch.uint8, pin_memory=pinned)
        host.numpy()[:] = memoryview(data)
        out = codec.decoder("ans", "cuda").decode(host, tuple(f.shape), "cuda")
        host.zero_()
        assert torch.equal(out, f)


def test_a_block_table_beyond_what_a_block_can_code_to_is_refused():
    """The decoder is configured once per geometry from the blocks' bound: a table claiming more
    (sizes still adding up to the payload) is refused before anything is queued on the GPU."""
    shape, block = (1, 1, 64, 128), 4096  # two blocks
    data = entropy.join(block, [3 * block, 16], bytes(3 * block + 16))
    with pytest.raises(codec.CodecError, match="more than"):
        codec.decoder("ans", "cuda").decode(data, shape, "cuda")


def test_threads_decoding_side_by_side_each_get_their_own_planes():
    from concurrent.futures import ThreadPoolExecutor

    frames = [_frames(shape=(2, 3, 512, 512), seed=s).cuda() for s in range(8)]
    params = codec.CodecParams(format="ans", block_bytes=1 << 16)
    datas = [codec.encoder("ans", "cuda").encode(f, params) for f in frames]
    dec = codec.decoder("ans", "cuda")
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda d: dec.decode(d, tuple(frames[0].shape), "cuda"), datas * 3))
    assert all(torch.equal(o, frames[i % 8]) for i, o in enumerate(outs))


@pytest.mark.parametrize("preset", ["q8-ans", "balanced-ans", "transform-ans"])
def test_a_fetch_restores_ans_chunks_into_a_cuda_buffer_and_stops_at_a_damaged_one(tmp_path, preset):
    """Through the executor's staged path (pinned staging, checksums in the reading threads, decode
    from the staging buffer): each chunk as decode_chunk restores it; the chunk whose segment is
    damaged, and everything after it, is left untouched."""
    import asyncio

    from kvfetcher.kvbuffer import ChunkRef
    from kvfetcher.store.local import LocalStore

    from kvtest import SENTINEL, fetch

    g = torch.Generator().manual_seed(4)
    kv = (torch.randn(30, 2, 3, 512, 64, generator=g) * 2).to(torch.float16)
    store, refs = LocalStore(tmp_path), []
    for i in range(4):
        obj = chunk.encode_chunk(kv[:, :, :, i * 128 : (i + 1) * 128].contiguous(), preset, SHIPPED_FP, start=i * 128, rope_theta=1e5)
        store.put(f"kv/{i}.kvfc", obj)
        refs.append(ChunkRef(f"kv/{i}.kvfc", len(obj), i * 128, 128))
    want = [chunk.decode_chunk(store.get(r.name), SHIPPED_FP, device="cuda") for r in refs]
    buf = torch.full((30, 2, 3, 600, 64), SENTINEL, dtype=torch.float16, device="cuda")
    out = asyncio.run(fetch(store, refs, Destination(buf, tokens=512), device=torch.device("cuda"), fingerprint=SHIPPED_FP))
    assert out.error is None and out.loaded_tokens == 512, out
    assert all(torch.equal(buf[:, :, :, i * 128 : (i + 1) * 128], w) for i, w in enumerate(want))
    obj = store.get(refs[2].name)
    h = container.parse_header(obj)
    store.delete(refs[2].name)
    store.put(refs[2].name, flip(obj, h.header_size + h.segments[0].offset + h.segments[0].length // 3))
    refs[2] = ChunkRef(refs[2].name, len(obj), 256, 128)
    buf.fill_(SENTINEL)
    out = asyncio.run(fetch(store, refs, Destination(buf, tokens=512), device=torch.device("cuda"), fingerprint=SHIPPED_FP, window=1))
    assert out.error == "corrupt" and out.loaded_tokens == 256 and out.bad_object == refs[2].name
    assert bool((buf[:, :, :, 256:] == SENTINEL).all())
