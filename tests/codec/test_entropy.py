"""The entropy formats on the CPU: the block bitstream, the zstd backend, the *-zstd presets
restoring exactly what their layout's unpack gives, bad bitstreams refused, ans refused cleanly."""

import dataclasses

import pytest
import torch
import zstandard

from kvfetcher import chunk, codec
from kvfetcher.codec import entropy, layout
from kvfetcher.errors import ContainerError
from kvfetcher.format import container, presets

from kvtest import flip, noise_frames, rebuild

SHIPPED_FP = "smollm2-135m-instruct-q4_1/float32"  # the model whose basis the lossy presets use
ZSTD_PRESETS = [p for p in presets.PRESETS if p.endswith("-zstd")]
VIDEO_OF = {"transform-zstd": "balanced"}  # the video preset whose quantisation an entropy-coded one shares


def _kv(tokens: int = 40, dtype=torch.float16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(30, 2, 3, tokens, 64, generator=g) * 2  # the shipped model's geometry (its basis fits)
    kv[:, :, :, 7] *= 6  # an outlier token
    return kv.to(dtype)


def _frames(seed: int = 0, shape=(2, 3, 200, 304)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 6 + 128).clamp(0, 255).to(torch.uint8)


def test_zstd_round_trips_planes_in_blocks_of_standard_frames():
    f = _frames()
    params = codec.CodecParams(format="zstd", block_bytes=1 << 14)
    data = codec.encoder("zstd").encode(f, params)
    assert torch.equal(codec.decoder("zstd", backend="zstd").decode(data, tuple(f.shape)), f)
    block, sizes, offsets, payload = entropy.split(data, f.numel())
    assert block == 1 << 14 and len(sizes) == -(-f.numel() // block)
    flat = f.view(-1).numpy()
    for i, (at, n) in enumerate(zip(offsets, sizes)):  # every block: one plain zstd frame, readable by anyone
        assert at % entropy.ALIGN == 0
        frame = bytes(payload[at : at + n])
        assert zstandard.get_frame_parameters(frame).content_size == min(block, f.numel() - i * block)
        assert zstandard.ZstdDecompressor().decompress(frame) == flat[i * block : (i + 1) * block].tobytes()


def test_a_bitstream_of_blocks_coded_elsewhere_decodes():
    """Blocks made by plain zstd at any level (as another encoder would make them) decode."""
    f = _frames(1, (1, 1, 96, 160))
    raw = f.view(-1).numpy().tobytes()
    blocks = [zstandard.ZstdCompressor(level=lvl).compress(raw[a : a + 4096]) for lvl, a in zip([1, 19, -5, 3], range(0, len(raw), 4096))]
    data = entropy.join_blocks(4096, blocks)
    assert torch.equal(entropy.ZstdCodec().decode(data, tuple(f.shape)), f)


def _sorted_planes() -> torch.Tensor:
    """Planes as the transform family writes them: rows of samples about 128, spreads from 0.3 to 20 in order."""
    g = torch.Generator().manual_seed(3)
    spread = torch.logspace(-0.5, 1.3, 512).view(512, 1)
    return (torch.randn(512, 256, generator=g) * spread + 128).round().clamp(0, 255).to(torch.uint8).view(1, 1, 512, 256)


def test_the_encoder_codes_quantised_planes_as_literals_smaller_than_level_3():
    """With no level the CPU encoder uses LITERAL_PARAMS: standard frames, smaller than level 3 on
    noise-like planes (whose short matches cost more than their literals); a level is honoured."""
    f = _sorted_planes()
    p = codec.CodecParams(format="zstd", block_bytes=1 << 16)
    lit = entropy.ZstdCodec().encode(f, p)
    lvl3 = entropy.ZstdCodec().encode(f, dataclasses.replace(p, level=3))
    assert len(lit) < 0.97 * len(lvl3)
    for data in (lit, lvl3):
        assert torch.equal(entropy.ZstdCodec().decode(data, tuple(f.shape)), f)
    _, sizes, offsets, payload = entropy.split(lit, f.numel())
    frame = bytes(payload[offsets[0] : offsets[0] + sizes[0]])
    assert zstandard.ZstdDecompressor().decompress(frame) == f.view(-1).numpy()[: 1 << 16].tobytes()


@pytest.mark.parametrize("bad", ["short", "table", "sizes", "frame", "length", "zero"])
def test_a_bad_bitstream_is_a_codec_error(bad):
    f = _frames(2, (1, 1, 64, 128))  # 4 blocks
    data = entropy.ZstdCodec().encode(f, codec.CodecParams(format="zstd", block_bytes=2048))
    b = {"short": data[:6], "table": data[:20], "sizes": data[:-16],
         "frame": data[:8 + 4 * 4] + bytes(len(data) - 8 - 4 * 4),  # the table intact, the frames zeros
         "length": data, "zero": entropy.join(2048, [0, 0, 0, 0], b"")}[bad]
    with pytest.raises(codec.CodecError):
        entropy.ZstdCodec().decode(b, (1, 1, 64, 128) if bad != "length" else (1, 1, 64, 129))


def test_ans_has_no_cpu_backend_and_is_never_planned_without_a_gpu():
    if codec.decodable("ans"):
        pytest.skip("this machine decodes ans")
    with pytest.raises(codec.CodecError, match="GPU"):
        codec.decoder("ans", "cpu")
    with pytest.raises(codec.CodecError, match="GPU"):
        codec.encoder("ans", "cpu")
    from kvfetcher.fetch import plan

    assert not any(p.endswith("-ans") for p in plan.FORMATS) and "balanced-zstd" in plan.FORMATS


@pytest.mark.parametrize("name", ZSTD_PRESETS)
def test_zstd_presets_restore_exactly_their_layouts_unpack(name):
    """The same planes as the video preset (same layout and quantisation; ``transform``: balanced's,
    the samples in another order), coded losslessly: the KV restored is bit for bit what the
    layout's own unpack of those planes gives."""
    kv = _kv()
    p, video = presets.get(name, SHIPPED_FP), presets.get(VIDEO_OF.get(name, name.removesuffix("-zstd")), SHIPPED_FP)
    assert dataclasses.replace(p.layout, sort_components=False) == video.layout
    assert p.pre_rope == video.pre_rope and p.codec.format == "zstd"
    obj = chunk.encode_chunk(kv, name, SHIPPED_FP, start=0, rope_theta=1e5)
    h = container.parse_header(obj)
    packed = layout.pack(kv, h.layout, 0)
    assert h.layout.basis is not None or name == "q8-zstd"
    reference = layout.unpack(packed.frames, packed.side, tuple(kv.shape), kv.dtype, h.layout)
    assert torch.equal(chunk.decode_chunk(obj, SHIPPED_FP), reference)


def test_zstd_and_hevc_objects_of_one_chunk_restore_the_same_kv():
    kv = _kv(24)
    a = chunk.decode_chunk(chunk.encode_chunk(kv, "q8-zstd", "fp"), "fp")
    b = chunk.decode_chunk(chunk.encode_chunk(kv, "q8", "fp"), "fp")
    assert torch.equal(a, b)



@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "hevc"])
def test_a_bad_zstd_object_never_reaches_the_buffer(damage):
    kv = _kv(24)
    obj = chunk.encode_chunk(kv, "q8-zstd", "fp")
    h = container.parse_header(obj)
    seg = h.segments[0]
    bad = {
        "flip": lambda: flip(obj, h.header_size + seg.offset + seg.length // 2),
        "truncate": lambda: obj[:-100],
        # checksums valid, the block table intact, the frames noise
        "garbage": lambda: rebuild(obj, segment=noise_frames),
        # a foreign bitstream under a valid header: HEVC bytes where zstd blocks belong
        "hevc": lambda: rebuild(chunk.encode_chunk(kv, "q8", "fp"), fmt="zstd"),
    }[damage]()
    out = torch.full(kv.shape, 7.0, dtype=kv.dtype)
    with pytest.raises(ContainerError):
        chunk.decode_chunk(bad, "fp", out=out, backend="zstd")  # (the CPU's decoder: nvCOMP does not validate its input)
    assert bool((out == 7.0).all())


def test_an_ans_object_on_a_cpu_reader_is_refused_without_blaming_the_object():
    if codec.decodable("ans"):
        pytest.skip("this machine decodes ans")
    kv = _kv(24)
    obj = rebuild(chunk.encode_chunk(kv, "q8-zstd", "fp"), fmt="ans")  # as a GPU sidecar would store it
    out = torch.full(kv.shape, 7.0, dtype=kv.dtype)
    with pytest.raises(codec.CodecError, match="GPU"):
        chunk.decode_chunk(obj, "fp", out=out)
    assert bool((out == 7.0).all())


def test_untrusted_bytes_reach_only_decoders_that_validate_their_input(monkeypatch):
    """nvCOMP does not validate its input (crafted frames under right CRC-32s can fault the GPU
    context): bytes not from a trusted source decode as zstd on the CPU, and ans not at all."""
    from kvfetcher.codec import nvcomp, raw

    assert entropy.ZstdCodec.validates_input and raw.RawCodec.validates_input and not nvcomp.NvcompCodec.validates_input
    monkeypatch.setattr(nvcomp, "available", lambda: True)  # as on a GPU with nvCOMP (nothing runs on it here)
    assert codec.decoder("zstd", "cuda:0").name == "nvcomp-zstd" and codec.decoder("ans", "cuda:0").name == "nvcomp-ans"
    assert codec.decoder("zstd", "cuda:0", trusted=False).name == "zstd"
    with pytest.raises(codec.CodecError, match="does not validate its input"):
        codec.decoder("ans", "cuda:0", trusted=False)
    assert codec.decodable("ans") and not codec.decodable("ans", trusted=False) and codec.decodable("zstd", trusted=False)
