"""container: the stored object for one chunk — versioned, self-describing, checksummed.

Byte layout (all integers little-endian)::

    0   4s  magic  b"KVFC"
    4   u16 format version (FORMAT_VERSION)
    6   u16 flags (0)
    8   u32 header length N
    12  u32 CRC-32 of the header bytes
    16  N   header: UTF-8 JSON (model fingerprint, dtype, shape, preset + layout + codec
            parameters, frame shape, and an index of the side-information and video segments)
    16+N    segments back to back; offsets in the index are relative to this point

The side information (quantised layouts: offsets, steps, exact tokens, sparse corrections) is
stored zstd-compressed: with a basis its steps repeat and its offsets are small.

Each video segment is an independent bitstream (it starts with its own parameter sets and an
IDR frame) covering a run of frames, i.e. a run of layers, with its own CRC-32. A reader does
one ranged read for the prefix and header, then fetches and decodes segment by segment.
Parsing is strict: anything corrupt, truncated, foreign or from a future version raises a
:class:`ContainerError` subclass and never yields a tensor.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import torch
import zstandard

try:  # ISA-L's CRC-32 is zlib's checksum, several times faster: a fetch checks GBs of segments
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same numbers
    from zlib import crc32

from kvfetcher.codec import basis, layout
from kvfetcher.codec.base import FORMATS, CodecError, CodecParams
from kvfetcher.errors import (  # noqa: F401  (the format's refusals, as container.CorruptError etc.)
    ContainerError,
    CorruptError,
    FingerprintMismatchError,
    ForeignObjectError,
    FutureVersionError,
    TruncatedError,
)
from kvfetcher.kvbuffer import DTYPES, bytes_per_value

MAGIC = b"KVFC"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<4sHHII")
PREFIX_SIZE = PREFIX.size  # 16
MAX_HEADER = 1 << 20


@dataclass(frozen=True)
class Segment:
    offset: int
    length: int
    crc32: int
    frames: tuple[int, int] = (0, 0)  # [start, end) frame indices; side info has (0, 0)


@dataclass(frozen=True)
class Header:
    fingerprint: str
    dtype: str
    shape: tuple[int, int, int, int, int]
    preset: str
    layout: layout.LayoutParams
    codec: CodecParams
    frame_shape: tuple[int, int, int, int]
    side: Segment | None
    segments: tuple[Segment, ...]
    meta: dict = field(default_factory=dict)
    start: int = 0  # position of the chunk's first token (pre-RoPE keys depend on it)
    header_size: int = 0  # prefix + JSON: where segment offsets start

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def total_size(self) -> int:
        ends = [s.offset + s.length for s in self.segments]
        if self.side is not None:
            ends.append(self.side.offset + self.side.length)
        return self.header_size + max(ends, default=0)

    @property
    def tokens(self) -> int:
        return self.shape[3]

    def to_json(self) -> dict:
        seg = lambda s: {"offset": s.offset, "length": s.length, "crc32": s.crc32, "frames": list(s.frames)}  # noqa: E731
        return {
            "fingerprint": self.fingerprint,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "preset": self.preset,
            "layout_version": layout.LAYOUT_VERSION,
            "layout": self.layout.to_dict(),
            "codec": self.codec.to_dict(),
            "frame_shape": list(self.frame_shape),
            "side": seg(self.side) if self.side else None,
            "segments": [seg(s) for s in self.segments],
            "meta": self.meta,
            "start": self.start,
        }


def _side_bytes(side: torch.Tensor | None) -> bytes:
    """Side information as stored: its raw bytes, zstd-compressed (level 19: it is small)."""
    if side is None:
        return b""
    return zstandard.ZstdCompressor(level=19).compress(side.to("cpu").contiguous().view(torch.uint8).numpy().tobytes())


def build(
    header_fields: dict,
    side: torch.Tensor | None,
    segments: list[tuple[tuple[int, int], bytes]],
) -> bytes:
    """Assemble an object from already-coded parts. ``segments``: ``[((f0, f1), bitstream)]``."""
    blobs: list[bytes] = []
    offset = 0
    side_seg = None
    sb = _side_bytes(side)
    if side is not None:
        side_seg = {"offset": 0, "length": len(sb), "crc32": crc32(sb), "frames": [0, 0]}
        blobs.append(sb)
        offset = len(sb)
    index = []
    for (f0, f1), data in segments:
        index.append({"offset": offset, "length": len(data), "crc32": crc32(data), "frames": [f0, f1]})
        blobs.append(data)
        offset += len(data)
    head = dict(header_fields, layout_version=layout.LAYOUT_VERSION, side=side_seg, segments=index)
    hb = json.dumps(head, separators=(",", ":"), sort_keys=True).encode()
    prefix = PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(hb), crc32(hb))
    return b"".join([prefix, hb, *blobs])


def header_length(prefix: bytes) -> int:
    """Total bytes of prefix + header, from the first :data:`PREFIX_SIZE` bytes."""
    if len(prefix) < PREFIX_SIZE:
        raise TruncatedError(f"object is {len(prefix)} bytes, shorter than the {PREFIX_SIZE}-byte prefix")
    magic, version, _flags, hlen, _crc = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise ForeignObjectError(f"not a kvfetcher chunk (magic {magic!r})")
    if version > FORMAT_VERSION:
        raise FutureVersionError(f"chunk format v{version} is newer than this reader (v{FORMAT_VERSION})")
    if version < 1:
        raise CorruptError(f"chunk format version {version} is invalid")
    if hlen > MAX_HEADER:
        raise CorruptError(f"header length {hlen} exceeds {MAX_HEADER}")
    return PREFIX_SIZE + hlen


def _segment(d: dict) -> Segment:
    s = Segment(int(d["offset"]), int(d["length"]), int(d["crc32"]), tuple(int(x) for x in d["frames"]))
    if s.offset < 0 or s.length < 0:
        raise CorruptError("negative segment offset or length")
    return s


def parse_header(data: bytes) -> Header:
    """Parse and verify the prefix and header (``data`` may hold more, e.g. the whole object)."""
    size = header_length(data)
    if len(data) < size:
        raise TruncatedError(f"header needs {size} bytes, got {len(data)}")
    _, _, _, hlen, crc = PREFIX.unpack_from(data)
    hb = bytes(data[PREFIX_SIZE:size])
    if crc32(hb) != crc:
        raise CorruptError("header checksum mismatch")
    try:
        d = json.loads(hb)
        if d["layout_version"] > layout.LAYOUT_VERSION:
            raise FutureVersionError(f"layout v{d['layout_version']} is newer than this reader")
        # Keys are namespaced by the layout version, so a fetch never looks older objects up; those
        # whose header this reader understands unchanged still decode (e.g. kept objects, tools).
        if d["layout_version"] < layout.MIN_READABLE_LAYOUT:
            raise ForeignObjectError(f"layout v{d['layout_version']} objects are not read by layout v{layout.LAYOUT_VERSION}")
        if d["dtype"] not in DTYPES:
            raise CorruptError(f"unknown dtype {d['dtype']!r}")
        lp = layout.LayoutParams.from_dict(d["layout"])
        header = Header(
            fingerprint=str(d["fingerprint"]),
            dtype=d["dtype"],
            shape=tuple(int(x) for x in d["shape"]),
            preset=str(d["preset"]),
            layout=lp,
            codec=CodecParams.from_dict(d["codec"]),
            frame_shape=tuple(int(x) for x in d["frame_shape"]),
            side=_segment(d["side"]) if d["side"] else None,
            segments=tuple(_segment(s) for s in d["segments"]),
            meta=dict(d.get("meta") or {}),
            start=int(d.get("start", 0)),
            header_size=size,
        )
    except ContainerError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptError(f"malformed header: {e}") from e
    _check_consistent(header)
    return header


def _check_consistent(h: Header) -> None:
    """The header must describe exactly the frames its layout implies, covered once."""
    if h.start < 0:
        raise CorruptError(f"negative start position {h.start}")
    if h.codec.format not in FORMATS:
        raise CorruptError(f"unknown bitstream format {h.codec.format!r}")
    try:
        geo = layout.geometry(h.shape, h.torch_dtype, h.layout)
    except ValueError as e:
        raise CorruptError(f"header shape/layout invalid: {e}") from e
    if tuple(geo.frame_shape) != tuple(h.frame_shape):
        raise CorruptError(f"frame shape {h.frame_shape} does not match layout {geo.frame_shape}")
    expect = 0
    for s in h.segments:
        if s.frames[0] != expect or s.frames[1] <= s.frames[0]:
            raise CorruptError("segment frame ranges are not contiguous")
        expect = s.frames[1]
    if expect != h.frame_shape[0]:
        raise CorruptError(f"segments cover {expect} frames of {h.frame_shape[0]}")
    if (h.side is None) != (h.layout.mode in layout.LOSSLESS_MODES):
        raise CorruptError("side information present/absent contrary to the layout")
    if h.layout.mode == "native":  # the payload *is* the KV: every byte covered once, in order
        if h.codec.format != "raw":
            raise CorruptError(f"native layout with a {h.codec.format!r} bitstream")
        frame_bytes, at = h.frame_shape[3], 0
        for s in h.segments:
            if s.offset != at or s.length != (s.frames[1] - s.frames[0]) * frame_bytes:
                raise CorruptError("native segments do not cover the chunk's bytes back to back")
            at += s.length
    if h.side is not None and h.side.length == 0:
        raise CorruptError("side information segment is empty")
    if h.layout.basis is not None:
        try:
            shape = basis.load(h.layout.basis).shape
        except ValueError as e:
            raise CorruptError(f"layout names a basis this reader does not have: {e}") from e
        if shape != (h.shape[0], h.shape[2], h.shape[4]):
            raise CorruptError(f"basis {h.layout.basis!r} does not fit a chunk of shape {h.shape}")


def is_native(h: Header) -> bool:
    """True when the payload is the chunk's KV bytes in buffer order, stored without a codec:
    restoring it is one copy (the fetch pipeline's direct path), no decoder involved."""
    return h.layout.mode == "native" and h.codec.format == "raw"


def check_fingerprint(h: Header, expected: str | None) -> None:
    if expected is not None and h.fingerprint != expected:
        raise FingerprintMismatchError(f"chunk belongs to model {h.fingerprint!r}, not {expected!r}")


def check_size(h: Header, size: int) -> None:
    """Raise unless a whole object of ``size`` bytes is exactly what its header promises."""
    if size < h.total_size:
        raise TruncatedError(f"object is {size} bytes, header promises {h.total_size}")
    if size > h.total_size:
        raise CorruptError(f"object has {size - h.total_size} unexpected trailing bytes")


def check(seg: Segment, data: bytes | memoryview) -> None:
    """Raise unless the segment's bytes are complete and match their checksum (no copy)."""
    if len(data) != seg.length:
        raise TruncatedError(f"segment is {len(data)} bytes, expected {seg.length}")
    if crc32(data) != seg.crc32:
        raise CorruptError(f"segment checksum mismatch at offset {seg.offset}")


def verify(seg: Segment, data: bytes | memoryview) -> bytes:
    """Return the segment's bytes if they are complete and match their checksum."""
    check(seg, data)
    return bytes(data)


def slice_segment(obj: bytes, h: Header, seg: Segment) -> bytes:
    start = h.header_size + seg.offset
    return verify(seg, memoryview(obj)[start : start + seg.length])


def side_tensor(h: Header, data: bytes) -> torch.Tensor | None:
    """Verified side-information bytes -> the flat tensor ``layout.unpack`` takes."""
    if h.side is None:
        return None
    need = layout.side_numel(h.shape, h.layout, h.torch_dtype) * bytes_per_value(h.torch_dtype)
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=need)
    except zstandard.ZstdError as e:
        raise CorruptError(f"side information does not decompress: {e}") from e
    if len(raw) != need:
        raise CorruptError(f"side information is {len(raw)} bytes, expected {need}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(h.torch_dtype)


def decode_segment(h: Header, seg: Segment, data: bytes, decoder, device: torch.device | str = "cpu") -> torch.Tensor:
    """One verified segment -> its uint8 frames on ``device``."""
    shape = (seg.frames[1] - seg.frames[0], *h.frame_shape[1:])
    try:
        return decoder.decode(data, shape, device)
    except CodecError as e:
        raise CorruptError(f"segment at offset {seg.offset} does not decode: {e}") from e
