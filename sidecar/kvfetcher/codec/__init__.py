"""codecs: pick a backend for a bitstream format, probing the GPU's video engines once.

``encoder(fmt, device)`` prefers NVENC for HEVC when the GPU has one, else libx265 on the CPU
(many data-centre GPUs have NVDEC but no NVENC: encoding there runs on CPU cores, off the request
path); the entropy formats code on the GPU with nvCOMP when the planes are on one and nvCOMP loads,
``zstd`` else on the CPU. ``decoder(fmt, device)`` prefers NVDEC for a CUDA device, else libavcodec;
for the entropy formats nvCOMP wherever this process has it (frames are moved to ``device``),
else the CPU's ``zstd``. ``ans`` has no CPU backend: :func:`decodable` says so before anyone
plans to read it, and asking for its coder here raises a :class:`CodecError`.

Bytes not from a trusted source (a stored object read without an object key: anyone who can write
the store can craft it) only go to a decoder that validates its input (``Decoder.validates_input``):
``zstd`` then decodes on the CPU, and ``ans``, which only nvCOMP decodes, not at all.
"""

from __future__ import annotations

import functools
import logging

import torch

from kvfetcher.codec import nvcomp
from kvfetcher.codec.base import ENTROPY_FORMATS, CodecError, CodecParams, Decoder, Encoder
from kvfetcher.codec.entropy import ZstdCodec
from kvfetcher.codec.raw import RawCodec

log = logging.getLogger("kvfetcher.codec")

__all__ = ["ENTROPY_FORMATS", "CodecError", "CodecParams", "Decoder", "Encoder", "capabilities", "decodable", "encoder", "encode_parts",
           "decoder"]


@functools.lru_cache(maxsize=None)
def capabilities() -> dict[str, bool | str]:
    """What this machine can do, probed (not assumed) once per process."""
    caps: dict[str, bool | str] = {"cuda": torch.cuda.is_available(), "nvdec": False, "nvenc": False, "x265": False}
    try:
        from kvfetcher.codec.pyav import X265Encoder  # noqa: F401

        caps["x265"] = True
    except ImportError as e:
        caps["x265_error"] = str(e)
    if caps["cuda"]:
        try:
            from kvfetcher.codec import nvidia

            caps["nvdec"], caps["nvenc"] = nvidia.probe()
        except Exception as e:  # missing wheel, driver without libnvcuvid, ...
            caps["nvidia_error"] = f"{type(e).__name__}: {e}"
        if caps["nvdec"] and not caps["nvenc"]:
            log.warning("GPU has NVDEC but no NVENC: HEVC encoding runs on CPU cores (libx265)")
    return caps


def decodable(fmt: str, trusted: bool = True) -> bool:
    """Whether this process can decode bitstreams of ``fmt`` (``ans`` needs a GPU with nvCOMP, and
    bytes from a ``trusted`` source: module doc)."""
    return fmt != "ans" or (trusted and nvcomp.available())


def encoder(fmt: str, device: torch.device | str = "cpu") -> Encoder:
    """An encoder for ``fmt``, for planes on ``device``."""
    if fmt == "raw":
        return RawCodec()
    if fmt in ENTROPY_FORMATS:
        if fmt == "ans" or (torch.device(device).type == "cuda" and nvcomp.available()):
            return nvcomp.NvcompCodec(fmt, device if torch.device(device).type == "cuda" else None)
        return ZstdCodec()
    if fmt != "hevc":
        raise CodecError(f"unknown bitstream format {fmt!r}")
    caps = capabilities()
    if caps["nvenc"]:
        from kvfetcher.codec.nvidia import NvencEncoder

        return NvencEncoder()
    try:
        from kvfetcher.codec.pyav import X265Encoder
    except ImportError as e:
        raise CodecError(f"HEVC encoding needs a GPU with NVENC or PyAV's libx265, and neither is here ({e})") from e
    return X265Encoder()


def encode_parts(enc: Encoder, parts: list[torch.Tensor], params: CodecParams) -> list[bytes | memoryview]:
    """Each part's bitstream: in one call where the backend codes parts together (an
    ``encode_parts`` of its own: nvCOMP's one batch), else part by part."""
    together = getattr(enc, "encode_parts", None)
    return together(parts, params) if together is not None else [enc.encode(f, params) for f in parts]


def decoder(fmt: str, device: torch.device | str = "cpu", backend: str | None = None, trusted: bool = True) -> Decoder:
    """A decoder for ``fmt`` that leaves frames on ``device``; ``backend`` forces a choice. Unless the
    bytes come from a ``trusted`` source, one that validates its input, or a :class:`CodecError`."""
    if fmt == "raw":
        return RawCodec()
    dev = torch.device(device)
    if fmt in ENTROPY_FORMATS:
        if backend == "zstd" or (backend is None and fmt == "zstd" and not nvcomp.available()):
            return ZstdCodec()
        if not (trusted or nvcomp.NvcompCodec.validates_input):
            if fmt == "zstd" and backend is None:
                return ZstdCodec()
            raise CodecError(f"nvCOMP does not validate its input: {fmt!r} objects are read only with the pool's "
                             "object key (KVFETCHER_OBJECT_KEY) or from a trusted store (KVFETCHER_TRUST_STORE)")
        return nvcomp.NvcompCodec(fmt, dev if dev.type == "cuda" else None)  # raises for ans without a GPU
    if fmt != "hevc":
        raise CodecError(f"unknown bitstream format {fmt!r}")
    use_nvdec = backend == "nvdec" or (backend is None and dev.type == "cuda" and capabilities()["nvdec"])
    if use_nvdec:
        from kvfetcher.codec.nvidia import NvdecDecoder

        return NvdecDecoder(dev.index or 0)
    from kvfetcher.codec.pyav import LibavDecoder

    return LibavDecoder()
