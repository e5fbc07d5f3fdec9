"""container: the stored object for one chunk — versioned, self-describing, checksummed, and
authenticated where a key is configured.

Byte layout (all integers little-endian)::

    0   4s  magic  b"KVFC"
    4   u16 format version (FORMAT_VERSION)
    6   u16 flags (FLAG_AUTHENTICATED, or 0)
    8   u32 header length N
    12  u32 CRC-32 of bytes 16..48+N (the tag and the header)
    16  32s header tag (:mod:`format.mac`), zeros when not authenticated
    48  N   header: UTF-8 JSON (model fingerprint, dtype, shape, preset + layout + codec
            parameters, frame shape, and an index of the side-information and video segments,
            each with its CRC-32 and, when authenticated, its tag)
    48+N    segments back to back; offsets in the index are relative to this point

Authentication (:mod:`format.mac`): a reader given an :class:`~format.mac.ObjectMAC` (the key
and the name it read the object from) refuses, as :class:`UnauthenticatedError`, an object whose
header tag or any part's tag does not verify, including every unauthenticated object; a reader
given none checks CRC-32s only and reads both kinds. Objects of an older format (v1: no tags; v2:
part tags of HMAC-SHA256) are refused as foreign: a fetch deletes them and the next store writes
them anew; an older reader refuses a newer object as a newer version and leaves it.

The side information (quantised layouts: offsets, steps, exact tokens, sparse corrections) is
stored zstd-compressed: with a basis its steps repeat and its offsets are small.

Each video segment is an independent bitstream (it starts with its own parameter sets and an
IDR frame) covering a run of frames, i.e. a run of layers, with its own CRC-32. A reader does
one ranged read for the prefix and header, then fetches and decodes segment by segment.
Parsing is strict: anything corrupt, truncated, foreign or from a future version raises a
:class:`ContainerError` subclass and never yields a tensor.
"""

from __future__ import annotations

import ctypes
import json
import struct
from dataclasses import dataclass, field

import numpy as np
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
    OtherKeyError,
    TruncatedError,
    UnauthenticatedError,
)
from kvfetcher.format.mac import PART_TAG_SIZE, TAG_SIZE, ObjectMAC
from kvfetcher.kvbuffer import DTYPES, bytes_per_value

MAGIC = b"KVFC"
FORMAT_VERSION = 3  # 2: header and part tags; 3: part tags are AES-GMAC
FLAG_AUTHENTICATED = 1
PREFIX = struct.Struct(f"<4sHHII{TAG_SIZE}s")
PREFIX_SIZE = PREFIX.size  # 48
_TAGGED = struct.Struct("<4sHHI")  # the prefix's fields the header tag covers (magic .. header length)
MAX_HEADER = 1 << 20


@dataclass(frozen=True)
class Segment:
    offset: int
    length: int
    crc32: int
    frames: tuple[int, int] = (0, 0)  # [start, end) frame indices; side info has (0, 0)
    mac: bytes | None = None  # the part's tag (:meth:`ObjectMAC.part`), when authenticated


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
    authenticated: bool = False  # written with a key (its tags verified only if read with one)

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

    def fields(self) -> dict:
        """The header's own fields, as :func:`build` takes them (it adds the layout version and the
        parts' index itself): to build an object again from a parsed one's parts."""
        return {k: v for k, v in self.to_json().items() if k not in ("layout_version", "side", "segments")}

    def to_json(self) -> dict:
        seg = lambda s: {"offset": s.offset, "length": s.length, "crc32": s.crc32, "frames": list(s.frames),  # noqa: E731
                         **({"mac": s.mac.hex()} if s.mac is not None else {})}
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


def side_bytes(side: torch.Tensor) -> bytes:
    """Side information as stored: its raw bytes, zstd-compressed at level 1 (its ranges and sparse rows are
    noise-like: higher levels save little of an object and cost a GPU encoder's store path host time;
    docs/architecture.md). Releases the GIL while it compresses."""
    return zstandard.ZstdCompressor(level=1).compress(side.to("cpu").contiguous().view(torch.uint8).numpy())


def build(
    header_fields: dict,
    side: bytes | None,
    segments: list[tuple[tuple[int, int], bytes | memoryview]],
    auth: ObjectMAC | None = None,
) -> bytes:
    """Assemble an object from already-coded parts: ``side`` as stored (:func:`side_bytes`),
    ``segments`` ``[((f0, f1), bitstream)]``. With ``auth`` (the key and the name it will be stored
    at) the object carries its tags."""
    blobs: list[bytes | memoryview] = []

    def entry(data: bytes | memoryview, frames: list[int]) -> dict:
        offset = sum(len(b) for b in blobs)
        blobs.append(data)
        return {"offset": offset, "length": len(data), "crc32": crc32(data), "frames": frames,
                **({"mac": auth.part(offset, data).hex()} if auth else {})}

    side_seg = entry(side, [0, 0]) if side is not None else None
    index = [entry(data, [f0, f1]) for (f0, f1), data in segments]
    head = dict(header_fields, layout_version=layout.LAYOUT_VERSION, side=side_seg, segments=index,
                **({"key_id": auth.key_id} if auth else {}))
    hb = json.dumps(head, separators=(",", ":"), sort_keys=True).encode()
    flags = FLAG_AUTHENTICATED if auth else 0
    tag = auth.header(_TAGGED.pack(MAGIC, FORMAT_VERSION, flags, len(hb)), hb) if auth else bytes(TAG_SIZE)
    prefix = PREFIX.pack(MAGIC, FORMAT_VERSION, flags, len(hb), crc32(tag + hb), tag)
    return _join([prefix, hb, *blobs])


#: where a bytes object's data starts (CPython's ``PyBytesObject.ob_sval``)
_BYTES_DATA = bytes.__basicsize__ - 1
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype, _new_bytes.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t)
# a writable memoryview of memory at an address (no ctypes array type per size: ctypes keeps those forever)
_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_memory.restype, _memory.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_WRITE = 0x200
#: objects at least this large are joined outside the GIL
GIL_FREE_JOIN = 1 << 20


def _join(parts: list[bytes | memoryview]) -> bytes:
    """``b"".join(parts)``, a large result's bytes copied outside the GIL.

    ``bytes.join`` holds the GIL while it copies: for a chunk's object of tens of MB that is
    milliseconds in which the sidecar's event loop answers no lookup (docs/results.md, "lookups
    while storing"). Here the object is made uninitialised and numpy fills it, releasing the GIL;
    no one else holds the object until it is returned."""
    n = sum(memoryview(p).nbytes for p in parts)
    if n < GIL_FREE_JOIN:
        return b"".join(parts)
    out = _new_bytes(None, n)
    dst = np.frombuffer(_memory(id(out) + _BYTES_DATA, n, _PYBUF_WRITE), np.uint8)
    at = 0
    for p in parts:
        src = np.frombuffer(p, np.uint8)
        dst[at : at + src.size] = src
        at += src.size
    return out


def header_length(prefix: bytes) -> int:
    """Total bytes of prefix + header, from the first :data:`PREFIX_SIZE` bytes."""
    if len(prefix) < PREFIX_SIZE:
        raise TruncatedError(f"object is {len(prefix)} bytes, shorter than the {PREFIX_SIZE}-byte prefix")
    magic, version, _flags, hlen, _crc, _tag = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise ForeignObjectError(f"not a kvfetcher chunk (magic {magic!r})")
    if version > FORMAT_VERSION:
        raise FutureVersionError(f"chunk format v{version} is newer than this reader (v{FORMAT_VERSION})")
    if version < 1:
        raise CorruptError(f"chunk format version {version} is invalid")
    if version < FORMAT_VERSION:
        raise ForeignObjectError(f"chunk format v{version} predates this reader's (v{FORMAT_VERSION})")
    if hlen > MAX_HEADER:
        raise CorruptError(f"header length {hlen} exceeds {MAX_HEADER}")
    return PREFIX_SIZE + hlen


def _int(x) -> int:
    """A JSON integer (not a bool, float or string that ``int`` would accept)."""
    if type(x) is not int:
        raise ValueError(f"{x!r} is not an integer")
    return x


def _ints(xs, n: int) -> tuple[int, ...]:
    """A JSON list of exactly ``n`` integers."""
    if not isinstance(xs, list) or len(xs) != n:
        raise ValueError(f"{xs!r} is not a list of {n} integers")
    return tuple(_int(x) for x in xs)


def _segment(d: dict) -> Segment:
    mac = d.get("mac")
    s = Segment(_int(d["offset"]), _int(d["length"]), _int(d["crc32"]), _ints(d["frames"], 2),
                None if mac is None else bytes.fromhex(mac))
    if s.offset < 0 or s.length < 0:
        raise CorruptError("negative segment offset or length")
    return s


def _verify_tag(data: bytes, hb: bytes, auth: ObjectMAC | None) -> bool:
    """Whether the object says it is authenticated; with ``auth``, raise unless its header tag verifies."""
    magic, version, flags, hlen, _crc, tag = PREFIX.unpack_from(data)
    if flags & ~FLAG_AUTHENTICATED:
        raise CorruptError(f"unknown flags {flags:#x}")
    authenticated = bool(flags & FLAG_AUTHENTICATED)
    if auth is not None:
        if not authenticated:
            raise UnauthenticatedError("the object carries no tags (written without the object key)")
        kid = _key_id(hb)
        if kid is not None and not auth.knows(kid):
            raise OtherKeyError(f"tagged under key {kid}, which this reader does not hold")
        if not auth.verify_header(_TAGGED.pack(magic, version, flags, hlen), hb, tag):
            raise UnauthenticatedError(f"header tag does not verify for {auth.name}")
    return authenticated


def _key_id(hb: bytes) -> str | None:
    """The key id an (as yet unverified) header names; None for none or a malformed header."""
    try:
        kid = json.loads(hb).get("key_id")
    except (ValueError, RecursionError, AttributeError):
        return None
    return kid if isinstance(kid, str) else None


def parse_header(data: bytes, auth: ObjectMAC | None = None) -> Header:
    """Parse and verify the prefix and header (``data`` may hold more, e.g. the whole object).

    With ``auth`` the header tag must verify (the parts' tags are checked by :func:`check`).
    Any malformed or inconsistent header raises a :class:`ContainerError`, never anything else."""
    size = header_length(data)
    if len(data) < size:
        raise TruncatedError(f"header needs {size} bytes, got {len(data)}")
    crc, tag = PREFIX.unpack_from(data)[4:]
    hb = bytes(data[PREFIX_SIZE:size])
    if crc32(tag + hb) != crc:
        raise CorruptError("header checksum mismatch")
    authenticated = _verify_tag(data, hb, auth)
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
            shape=_ints(d["shape"], 5),
            preset=str(d["preset"]),
            layout=lp,
            codec=CodecParams.from_dict(d["codec"]),
            frame_shape=_ints(d["frame_shape"], 4),
            side=_segment(d["side"]) if d["side"] else None,
            segments=tuple(_segment(s) for s in d["segments"]),
            meta=dict(d.get("meta") or {}),
            start=_int(d.get("start", 0)),
            header_size=size,
            authenticated=authenticated,
        )
        _check_consistent(header)
    except ContainerError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError, RecursionError) as e:
        raise CorruptError(f"malformed header: {type(e).__name__}: {e}") from e
    return header


def _check_consistent(h: Header) -> None:
    """The header must describe exactly the frames its layout implies, covered once; an
    authenticated one tags every part."""
    if h.start < 0:
        raise CorruptError(f"negative start position {h.start}")
    if min(h.shape) <= 0 or min(h.frame_shape) <= 0 or h.shape[1] != 2:
        raise CorruptError(f"shape {h.shape} or frame shape {h.frame_shape} is not a chunk's")
    parts = ([h.side] if h.side else []) + list(h.segments)
    if any((p.mac is not None) != h.authenticated or (p.mac is not None and len(p.mac) != PART_TAG_SIZE) for p in parts):
        raise CorruptError("part tags present/absent contrary to the header's flags")
    if h.codec.format not in FORMATS:
        raise CorruptError(f"unknown bitstream format {h.codec.format!r}")
    try:
        geo = layout.geometry(h.shape, h.torch_dtype, h.layout)
    except ValueError as e:
        raise CorruptError(f"header shape/layout invalid: {e}") from e
    if tuple(geo.frame_shape) != tuple(h.frame_shape):
        raise CorruptError(f"frame shape {h.frame_shape} does not match layout {geo.frame_shape}")
    if isinstance(h.layout.rope_theta, tuple) and len(h.layout.rope_theta) != h.shape[0]:
        raise CorruptError(f"{len(h.layout.rope_theta)} RoPE bases for {h.shape[0]} layers")
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


def check(seg: Segment, data: bytes | memoryview, auth: ObjectMAC | None = None) -> None:
    """Raise unless the segment's bytes are complete and match their checksum and, with ``auth``,
    their tag (no copy). ``seg`` must come from a header parsed with the same ``auth``."""
    if len(data) != seg.length:
        raise TruncatedError(f"segment is {len(data)} bytes, expected {seg.length}")
    if crc32(data) != seg.crc32:
        raise CorruptError(f"segment checksum mismatch at offset {seg.offset}")
    if auth is not None and not auth.verify_part(seg.offset, data, seg.mac):
        raise UnauthenticatedError(f"tag of the part at offset {seg.offset} does not verify for {auth.name}")


def verify(seg: Segment, data: bytes | memoryview, auth: ObjectMAC | None = None) -> bytes:
    """Return the segment's bytes if they are complete and match their checksum (and tag)."""
    check(seg, data, auth)
    return bytes(data)


def slice_segment(obj: bytes, h: Header, seg: Segment, auth: ObjectMAC | None = None) -> bytes:
    start = h.header_size + seg.offset
    return verify(seg, memoryview(obj)[start : start + seg.length], auth)


#: dtype -> (the unsigned integer of its size, its exponent bits): a value is NaN or infinite
#: exactly when all its exponent bits are set
_EXPONENT = {torch.float16: (np.uint16, 0x7C00), torch.bfloat16: (np.uint16, 0x7F80),
             torch.float32: (np.uint32, 0x7F800000)}


def check_finite(values: torch.Tensor | bytes | memoryview, dtype: torch.dtype) -> None:
    """Raise :class:`CorruptError` if ``values`` (a tensor of ``dtype``, or its bytes: whole values)
    hold a NaN or an infinity. On the CPU a bit test of the exponents (numpy; torch's ``isfinite``
    on float16 is over ten times slower there)."""
    if isinstance(values, torch.Tensor) and values.is_cuda:
        ok = bool(torch.isfinite(values.contiguous().view(torch.uint8).reshape(-1).view(dtype)).all())
    else:
        if isinstance(values, torch.Tensor):
            values = values.contiguous().view(torch.uint8).reshape(-1).numpy()
        uint, bits = _EXPONENT[dtype]
        a = np.frombuffer(values, dtype=uint)
        ok = not bool(((a & uint(bits)) == bits).any())
    if not ok:
        raise CorruptError("non-finite values (NaN or infinity) in the chunk")


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
