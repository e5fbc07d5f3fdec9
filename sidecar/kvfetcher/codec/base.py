"""The codec interface: uint8 planes <-> one bitstream, interchangeable backends per format.

A *format* is what is stored: ``hevc``, ``raw``, or an entropy coding of the planes in blocks
(``zstd``, ``ans``; entropy.py). A *backend* is what codes it (``x265``/``libavcodec`` on the CPU
through PyAV, ``nvdec``/``nvenc`` on the GPU through PyNvVideoCodec, ``raw``, ``zstd`` through the
zstandard package, ``nvcomp-zstd``/``nvcomp-ans`` on the GPU through nvCOMP). Any backend of a
format decodes any other's bitstream of that format, so a chunk encoded on a CPU node decodes on
the GPU and vice versa; ``ans`` has GPU backends only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch


#: Bitstream formats a container may hold.
FORMATS = ("hevc", "raw", "zstd", "ans")
#: Formats that entropy-code the planes in independent blocks (entropy.py)
ENTROPY_FORMATS = ("zstd", "ans")


class CodecError(RuntimeError):
    """A bitstream could not be coded or decoded (raised instead of returning bad planes)."""


@dataclass(frozen=True)
class CodecParams:
    """Encoder settings, stored in the container header so a chunk says how it was made."""

    format: str = "hevc"  # one of FORMATS
    lossless: bool = True
    qp: int | None = None  # constant QP when lossy; None with lossless
    speed: str = "fast"  # x265 preset
    gop: int = 0  # frames between IDRs; 0 = one IDR at the start
    # x265 rate-distortion level (--rd); None: the preset's. An encoder choice only: any HEVC
    # decoder reads the result
    rd: int | None = None
    # entropy formats: bytes of planes per independently coded block (nvCOMP's chunk), and the
    # zstd level of the CPU encoder (None: parameters tuned for quantised planes, entropy.py;
    # nvCOMP's GPU encoder has its own)
    block_bytes: int = 0
    level: int | None = None

    def to_dict(self) -> dict:
        """The header's record; the entropy fields only for an entropy format (so the other
        formats' headers are what they were before those fields existed)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # immutable fields: no deep copy (asdict's)
        if self.format not in ENTROPY_FORMATS:
            del d["block_bytes"], d["level"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CodecParams":
        return cls(**d)


class Encoder(Protocol):
    name: str
    format: str

    def encode(self, frames: torch.Tensor, params: CodecParams) -> bytes | memoryview:
        """``frames``: uint8 ``[n, planes, H, W]`` (planes 1 or 3) -> one bitstream (a view is valid
        while ``frames`` is unchanged: the caller copies it before then). A backend that codes
        several such parts in one call also has ``encode_parts(parts, params) -> [bitstream]``
        (each the bitstream ``encode`` would give), which :func:`codec.encode_parts` prefers."""
        ...


class Decoder(Protocol):
    name: str
    format: str
    #: Malformed input is refused (a :class:`CodecError`) or concealed, never harms the process.
    #: False for nvCOMP: crafted frames under right checksums can fault the GPU context, so it
    #: decodes only bytes from a trusted source (:func:`codec.decoder`).
    validates_input: bool

    def decode(self, data: bytes, frame_shape: tuple[int, int, int, int], device: torch.device | str = "cpu") -> torch.Tensor:
        """One bitstream -> uint8 ``frame_shape`` on ``device``; raises :class:`CodecError`."""
        ...
