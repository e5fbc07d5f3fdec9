import pytest
import torch

from kvfetcher import codec
from kvfetcher.codec.base import CodecError, CodecParams
from kvfetcher.codec.pyav import LibavDecoder, X265Encoder
from kvfetcher.codec.raw import RawCodec


def _frames(n=3, planes=3, h=144, w=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    smooth = torch.linspace(0, 200, w).view(1, 1, 1, w).expand(n, planes, h, w)
    return (smooth + torch.randint(0, 50, (n, planes, h, w), generator=g)).to(torch.uint8)


@pytest.mark.parametrize("planes", [1, 3])
def test_lossless_hevc_round_trip_is_bit_exact(planes):
    frames = _frames(planes=planes)
    data = X265Encoder().encode(frames, CodecParams(lossless=True))
    assert data[:4] == b"\x00\x00\x00\x01"  # Annex B elementary stream, no container
    assert torch.equal(LibavDecoder().decode(data, tuple(frames.shape)), frames)


def test_x265_rd_level_is_an_encoder_choice_the_decoder_does_not_see():
    g = torch.Generator().manual_seed(1)
    frames = (torch.randn(2, 3, 144, 192, generator=g) * 3 + 128).round().clamp(0, 255).to(torch.uint8)
    plain = X265Encoder().encode(frames, CodecParams(lossless=True, speed="ultrafast"))
    rd3 = X265Encoder().encode(frames, CodecParams(lossless=True, speed="ultrafast", rd=3))
    assert plain != rd3
    assert torch.equal(LibavDecoder().decode(rd3, tuple(frames.shape)), frames)
    assert CodecParams.from_dict(CodecParams(rd=3).to_dict()).rd == 3
    d = CodecParams().to_dict()
    del d["rd"]  # a header written before the field existed
    assert CodecParams.from_dict(d).rd is None


def test_lossy_hevc_stays_close():
    frames = _frames()
    data = X265Encoder().encode(frames, CodecParams(lossless=False, qp=4))
    back = LibavDecoder().decode(data, tuple(frames.shape))
    assert (back.float() - frames.float()).abs().mean() < 1.0


def test_decoder_refuses_garbage_and_wrong_frame_counts():
    frames = _frames()
    data = X265Encoder().encode(frames, CodecParams())
    with pytest.raises(CodecError):
        LibavDecoder().decode(b"\x00\x00\x00\x01" + bytes(range(256)) * 8, tuple(frames.shape))
    with pytest.raises(CodecError):
        LibavDecoder().decode(data, (5, 3, 144, 160))


def test_raw_codec_checks_length():
    frames = _frames()
    data = RawCodec().encode(frames, CodecParams(format="raw"))
    assert torch.equal(RawCodec().decode(data, tuple(frames.shape)), frames)
    with pytest.raises(CodecError):
        RawCodec().decode(data[:-1], tuple(frames.shape))


def test_raw_codec_encodes_host_frames_as_a_view_of_their_bytes():
    """No copy of its own: the container's join is the one copy of a raw chunk (it was two)."""
    frames = _frames()
    data = RawCodec().encode(frames, CodecParams(format="raw"))
    assert isinstance(data, memoryview) and data.nbytes == frames.numel()
    frames[0, 0, 0, 0] ^= 1  # a view: it sees the frames change
    assert bytes(data[:1])[0] == int(frames[0, 0, 0, 0])


def test_backend_choice_on_this_machine():
    caps = codec.capabilities()
    assert caps["x265"] is True
    assert codec.decoder("hevc", "cpu").name == "libavcodec"
    assert codec.encoder("raw").name == "raw"
    with pytest.raises(CodecError):
        codec.encoder("av1")
