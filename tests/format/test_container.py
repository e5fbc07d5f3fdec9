"""Every kind of bad stored object raises its own error and never yields (or writes) a tensor."""

import struct
import zlib

import pytest
import torch

from kvtest import rewrite_header, synthetic_kv
from kvfetcher.format import calibration, container
from kvfetcher import chunk
from kvfetcher.chunk import decode_chunk, encode_chunk, restore_chunk
from kvfetcher.kvbuffer import ChunkRef, Destination

FP = "test-model/fp16"


@pytest.fixture(scope="module")
def obj():
    return encode_chunk(synthetic_kv(tokens=64), "q8", FP)


def test_round_trip_and_header(obj):
    kv = synthetic_kv(tokens=64)
    h = container.parse_header(obj)
    assert h.fingerprint == FP and h.preset == "q8" and h.shape == tuple(kv.shape)
    assert h.total_size == len(obj) and len(h.segments) >= 1
    back = decode_chunk(obj, FP)
    assert back.shape == kv.shape and (back.float() - kv.float()).abs().max() < 0.1


def test_exact_preset_is_bit_exact():
    kv = synthetic_kv(tokens=50, dtype=torch.bfloat16)
    back = decode_chunk(encode_chunk(kv, "exact", FP), FP)
    assert torch.equal(back.view(torch.uint8), kv.view(torch.uint8))


@pytest.mark.parametrize(
    "mangle, error",
    [
        (lambda b: b"PK\x03\x04" + b[4:], container.ForeignObjectError),
        (lambda b: b"", container.TruncatedError),
        (lambda b: b[:10], container.TruncatedError),
        (lambda b: b[:40], container.TruncatedError),
        (lambda b: b[:-1], container.TruncatedError),
        (lambda b: b + b"\x00", container.CorruptError),
        (lambda b: b[:4] + struct.pack("<H", container.FORMAT_VERSION + 1) + b[6:], container.FutureVersionError),
        (lambda b: b[:4] + struct.pack("<H", 1) + b[6:], container.ForeignObjectError),  # before tags
        (lambda b: b[:4] + struct.pack("<H", 0) + b[6:], container.CorruptError),
        (lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:], container.CorruptError),  # header byte
        (lambda b: b[:-100] + bytes([b[-100] ^ 0x40]) + b[-99:], container.CorruptError),  # video byte
    ],
)
def test_bad_objects_raise_specific_errors(obj, mangle, error):
    with pytest.raises(error):
        decode_chunk(mangle(obj), FP)


def test_corrupt_side_information_is_caught(obj):
    h = container.parse_header(obj)
    at = h.header_size + h.side.offset + 7
    bad = obj[:at] + bytes([obj[at] ^ 0xFF]) + obj[at + 1 :]
    with pytest.raises(container.CorruptError):
        decode_chunk(bad, FP)


@pytest.mark.parametrize(
    "edit, error",
    [
        (lambda d: d.update(layout_version=99), container.FutureVersionError),
        (lambda d: d.update(layout_version=1), container.ForeignObjectError),
        (lambda d: d.update(start=-1), container.CorruptError),
        (lambda d: d.update(dtype="int8"), container.CorruptError),
        (lambda d: d.pop("shape"), container.CorruptError),
        (lambda d: d.update(frame_shape=[1, 3, 144, 144]), container.CorruptError),
        (lambda d: d["segments"].pop(), container.CorruptError),
        (lambda d: d.update(side=None), container.CorruptError),
        (lambda d: d["codec"].update(format="av1"), container.CorruptError),
    ],
)
def test_well_checksummed_but_inconsistent_headers_are_refused(obj, edit, error):
    with pytest.raises(error):
        decode_chunk(rewrite_header(obj, edit), FP)


def test_bitstream_that_does_not_decode_is_corrupt(obj):
    """Valid checksums over a broken bitstream (e.g. written by a buggy encoder) still fail."""
    h = container.parse_header(obj)
    seg = h.segments[0]
    junk = bytes(range(256)) * (seg.length // 256 + 1)
    junk = junk[: seg.length]

    def edit(d):
        d["segments"][0]["crc32"] = zlib.crc32(junk)

    start = h.header_size + seg.offset
    swapped = obj[:start] + junk + obj[start + seg.length :]
    with pytest.raises(container.CorruptError):
        decode_chunk(rewrite_header(swapped, edit), FP)


def test_foreign_model_is_refused(obj):
    with pytest.raises(container.FingerprintMismatchError):
        decode_chunk(obj, "another-model/fp16")


def test_destination_is_untouched_when_an_object_is_bad(obj):
    kv = synthetic_kv(tokens=64)
    out = torch.full(kv.shape, 7.0, dtype=kv.dtype)
    with pytest.raises(container.ContainerError):
        decode_chunk(obj[:-5], FP, out=out)
    assert torch.all(out == 7.0)
    decode_chunk(obj, FP, out=out)
    assert not torch.all(out == 7.0)


def test_pre_rope_preset_carries_theta_and_start_in_the_header():
    from dataclasses import replace

    from kvfetcher.format import presets

    kv = synthetic_kv(tokens=64)
    p = replace(presets.get("q8"), name="q8r", pre_rope=True)
    with pytest.raises(ValueError):
        encode_chunk(kv, p, FP, start=256)  # the model's theta is required
    obj = encode_chunk(kv, p, FP, start=256, rope_theta=10000.0)
    h = container.parse_header(obj)
    assert h.start == 256 and h.layout.rope_theta == 10000.0
    assert (decode_chunk(obj, FP).float() - kv.float()).abs().max() < 0.1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_raw_preset_stores_the_buffers_bytes_and_decodes_bit_exactly(dtype):
    n = 4 * 2 * 2 * 50 * 64 * torch.finfo(dtype).bits // 8
    kv = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)).view(dtype).view(4, 2, 2, 50, 64)
    kv = kv.masked_fill(~torch.isfinite(kv), 0)  # every finite bit pattern: a restore refuses NaN and infinity
    obj = encode_chunk(kv, "raw", FP)
    h = container.parse_header(obj)
    assert container.is_native(h) and h.layout.mode == "native"
    assert obj[h.header_size :] == kv.view(torch.uint8).numpy().tobytes()  # payload = the KV, in buffer order
    back = decode_chunk(obj, FP)  # the generic path (decoder + layout.unpack) agrees with the direct one
    assert torch.equal(back.view(torch.uint8), kv.view(torch.uint8))


def _gap(d):  # the second segment starts one byte late: a byte of the chunk would be left unread
    d["segments"][1]["offset"] += 1


def _hevc(d):
    d["codec"]["format"] = "hevc"


@pytest.mark.parametrize("edit", [_gap, _hevc])
def test_native_headers_must_cover_the_chunk_back_to_back(edit):
    """The direct path copies the payload as the KV: every byte of it must be a checksummed segment."""
    from dataclasses import replace

    from kvfetcher.format import presets

    obj = encode_chunk(synthetic_kv(layers=8, tokens=64), replace(presets.get("raw"), segment_bytes=70_000), FP)
    assert len(container.parse_header(obj).segments) == 4  # 2 layers of 32 KB each
    with pytest.raises(container.CorruptError):
        decode_chunk(rewrite_header(obj, edit), FP)


def test_objects_of_an_older_layout_are_foreign():
    """Keys carry the layout version, so a fetch never looks older objects up; one read directly
    (side information was uncompressed before v5) is refused as foreign, not decoded wrongly."""
    obj = encode_chunk(synthetic_kv(tokens=64), "q8", FP)
    with pytest.raises(container.ForeignObjectError):
        decode_chunk(rewrite_header(obj, lambda d: d.update(layout_version=4)), FP)


def test_side_information_is_stored_compressed_and_checked():
    kv = synthetic_kv(tokens=64)
    obj = encode_chunk(kv, "q8", FP)
    h = container.parse_header(obj)
    from kvfetcher.codec import layout

    raw = layout.side_numel(h.shape, h.layout) * 2
    assert h.side.length < raw  # zstd
    side = container.side_tensor(h, container.slice_segment(obj, h, h.side))
    assert side.numel() == layout.side_numel(h.shape, h.layout)
    with pytest.raises(container.CorruptError):  # well checksummed but not zstd
        container.side_tensor(h, b"\x00" * h.side.length)


def test_chunks_encoded_side_by_side_are_the_ones_encoded_alone():
    """Side information is compressed on a shared pool's threads while the planes are coded: each
    object still gets its own chunk's side, whatever the threads' interleaving."""
    from concurrent.futures import ThreadPoolExecutor

    kvs = [synthetic_kv(tokens=64, seed=i) for i in range(6)]
    alone = [encode_chunk(kv, "q8", FP, start=64 * i) for i, kv in enumerate(kvs)]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda i: encode_chunk(kvs[i], "q8", FP, start=64 * i), range(6)))
    assert together == alone and len(set(alone)) == 6
    todo = [chunk.ToEncode(kv, 64 * i) for i, kv in enumerate(kvs)]
    assert chunk.encode_chunks(todo, "q8", FP) == alone  # coded in one call
    with pytest.raises(ValueError, match="one device"):
        chunk.encode_chunks([todo[0], chunk.ToEncode(kvs[1].to("meta"), 64)], "q8", FP)


def test_sink_exact_only_keeps_the_first_token_exact_only_at_position_zero():
    from dataclasses import replace

    from kvfetcher.format import presets

    kv = synthetic_kv(tokens=64)
    p = replace(presets.get("q8"), name="q8s", sink_exact_only=True)
    first, later = encode_chunk(kv, p, FP, start=0), encode_chunk(kv, p, FP, start=64)
    assert container.parse_header(first).layout.exact_tokens == 1
    assert container.parse_header(later).layout.exact_tokens == 0
    assert torch.equal(decode_chunk(first, FP)[:, :, :, 0], kv[:, :, :, 0])
    assert (decode_chunk(later, FP).float() - kv.float()).abs().max() < 0.1


def test_a_basis_is_refused_for_a_model_it_was_not_made_for():
    from dataclasses import replace

    from kvfetcher.codec import basis, layout
    from kvfetcher.format import presets

    name = calibration.default().basis  # the shipped model's
    lp = layout.LayoutParams(mode="quant", sigma_steps=((0.2, 0.2),), basis=name)
    p = replace(presets.get("q8"), name="b", layout=lp)
    kv = synthetic_kv(tokens=64)  # 4 layers x 2 heads: not the shipped model's shape
    with pytest.raises(ValueError, match="not made for model"):
        encode_chunk(kv, p, FP)
    L, H, D = basis.load(name).shape
    kv = synthetic_kv(layers=L, heads=H, head_dim=D, tokens=64)
    with pytest.raises(ValueError, match="not made for model"):  # another fingerprint
        encode_chunk(kv, p, FP)
    obj = encode_chunk(kv, p, "smollm2-135m-instruct-q4_1/float32")
    assert container.parse_header(obj).layout.basis == name
    back = decode_chunk(obj)  # random KV is not what the basis was fitted to: only its shape is checked
    assert back.shape == kv.shape and torch.isfinite(back.float()).all()


def test_an_unknown_or_misfitting_basis_is_refused_before_decoding():
    from dataclasses import replace

    from kvfetcher.codec import basis, layout
    from kvfetcher.format import presets

    name = calibration.default().basis  # the shipped model's
    L, H, D = basis.load(name).shape
    fp = "smollm2-135m-instruct-q4_1/float32"
    p = replace(presets.get("q8"), name="b", layout=layout.LayoutParams(mode="quant", sigma_steps=((0.2, 0.2),), basis=name))
    obj = encode_chunk(synthetic_kv(layers=L, heads=H, head_dim=D, tokens=32), p, fp)

    def unknown(d):
        d["layout"]["basis"] = "smollm2-135m-000000000000"

    def misfit(d):
        d["shape"][0] = L - 1
        d["frame_shape"] = list(layout.geometry(tuple(d["shape"]), torch.float16, layout.LayoutParams.from_dict(d["layout"])).frame_shape)

    for edit in (unknown, misfit):
        with pytest.raises(container.CorruptError, match="basis"):
            decode_chunk(rewrite_header(obj, edit), fp)


@pytest.mark.parametrize("part", ["side", "first segment", "last segment"])
@pytest.mark.parametrize("scattered", [False, True])
def test_restore_chunk_writes_nothing_unless_every_part_verifies(part, scattered):
    """The one restore of a chunk (whole objects, decode workers and the fetch executor use it):
    a bad part raises before the buffer is touched; good parts land in the chunk's slots only."""
    from dataclasses import replace

    from kvfetcher.format import presets

    q8 = presets.get("q8")  # a frame per tile, a segment per frame: several segments
    obj = encode_chunk(synthetic_kv(layers=12, tokens=64), replace(q8, layout=replace(q8.layout, max_rows=64), segment_frames=1), FP)
    h = container.parse_header(obj)
    assert len(h.segments) > 1 and h.side is not None
    L, _, H, T, D = h.shape
    buf = torch.full((L, 2, H, 100, D), 7.0, dtype=h.torch_dtype)
    slots = torch.randperm(100, generator=torch.Generator().manual_seed(0))[:T].tolist() if scattered else list(range(20, 20 + T))
    dest, ref = Destination(buf, slots=slots), ChunkRef("x", len(obj), 0, T)

    def parts(o: bytes):
        cut = lambda s: memoryview(o)[h.header_size + s.offset : h.header_size + s.offset + s.length]  # noqa: E731
        return cut(h.side), [cut(s) for s in h.segments]

    seg = {"side": h.side, "first segment": h.segments[0], "last segment": h.segments[-1]}[part]
    at = h.header_size + seg.offset + seg.length // 2
    bad = obj[:at] + bytes([obj[at] ^ 0x40]) + obj[at + 1 :]
    with pytest.raises(container.CorruptError):
        restore_chunk(dest, ref, h, *parts(bad))
    assert bool((buf == 7.0).all())
    assert restore_chunk(dest, ref, h, *parts(obj)) == L * 2 * H * T * D * buf.element_size()
    assert torch.equal(buf[:, :, :, slots], decode_chunk(obj, FP))
    assert bool((buf[:, :, :, sorted(set(range(100)) - set(slots))] == 7.0).all())


def test_part_checksums_are_zlibs_crc32_by_isal_on_shared_memory_and_a_changed_byte_is_refused():
    """ISA-L's CRC-32 (several times zlib's speed: an engine re-checks GBs of parts) gives zlib's
    numbers, on bytes and on views of an arena's shared memory."""
    from isal import isal_zlib

    from kvfetcher import ipc

    assert container.crc32 is isal_zlib.crc32
    arena = ipc.allocate((3 << 19,), torch.float16)
    mem = memoryview(arena.tensor.view(torch.uint8).numpy())
    mem[:] = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)).numpy()
    for part in (b"", b"kv", bytes(mem[:4097]), mem[1:], mem[5 : (2 << 20) + 3]):
        assert container.crc32(part) == zlib.crc32(part)
    seg = container.Segment(0, len(mem), zlib.crc32(mem))
    container.check(seg, mem)
    mem[len(mem) // 2] ^= 1
    with pytest.raises(container.CorruptError, match="checksum"):
        container.check(seg, mem)
    arena.close()


@pytest.mark.parametrize("big", [False, True])
def test_an_object_is_joined_as_bytes_join_would_below_and_above_the_gil_free_size(big):
    """A large object's parts are copied outside the GIL into a new bytes object: the same bytes."""
    import numpy as np

    n = container.GIL_FREE_JOIN + 12345 if big else 1000
    parts = [b"KVFC", b"", memoryview(np.arange(n, dtype=np.uint8)), memoryview(torch.arange(64, dtype=torch.float16).numpy()), bytes(range(7))]
    out = container._join(parts)
    assert type(out) is bytes and out == b"".join(parts)
    if big:  # a raw chunk's object of that size takes this path, and reads back
        kv = synthetic_kv(layers=2, heads=2, tokens=1100, head_dim=64, seed=9)
        obj = encode_chunk(kv, "raw", "m")
        assert len(obj) >= container.GIL_FREE_JOIN and torch.equal(decode_chunk(obj, "m"), kv)
