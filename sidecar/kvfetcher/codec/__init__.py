"""codecs: pick a backend for a bitstream format, probing the GPU's video engines once.

``encoder(fmt)`` prefers NVENC when the GPU has one, else libx265 on the CPU (many data-centre
GPUs have NVDEC but no NVENC: encoding there runs on CPU cores, off the request path).
``decoder(fmt, device)`` prefers NVDEC for a CUDA device, else libavcodec.
"""

from __future__ import annotations

import functools
import logging

import torch

from kvfetcher.codec.base import CodecError, CodecParams, Decoder, Encoder
from kvfetcher.codec.raw import RawCodec

log = logging.getLogger("kvfetcher.codec")

__all__ = ["CodecError", "CodecParams", "Decoder", "Encoder", "capabilities", "encoder", "decoder"]


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


def encoder(fmt: str) -> Encoder:
    if fmt == "raw":
        return RawCodec()
    if fmt != "hevc":
        raise CodecError(f"unknown bitstream format {fmt!r}")
    caps = capabilities()
    if caps["nvenc"]:
        from kvfetcher.codec.nvidia import NvencEncoder

        return NvencEncoder()
    from kvfetcher.codec.pyav import X265Encoder

    return X265Encoder()


def decoder(fmt: str, device: torch.device | str = "cpu", backend: str | None = None) -> Decoder:
    """A decoder for ``fmt`` that leaves frames on ``device``; ``backend`` forces a choice."""
    if fmt == "raw":
        return RawCodec()
    if fmt != "hevc":
        raise CodecError(f"unknown bitstream format {fmt!r}")
    dev = torch.device(device)
    use_nvdec = backend == "nvdec" or (backend is None and dev.type == "cuda" and capabilities()["nvdec"])
    if use_nvdec:
        from kvfetcher.codec.nvidia import NvdecDecoder

        return NvdecDecoder(dev.index or 0)
    from kvfetcher.codec.pyav import LibavDecoder

    return LibavDecoder()
