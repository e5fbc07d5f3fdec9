"""HEVC on the CPU through PyAV: libx265 encodes, libavcodec decodes.

Frames go in as planar YUV (4:4:4 when the layout uses three planes, else 4:2:0 with constant
chroma) and the elementary stream (Annex B) comes out: no container around it, so the NVDEC
backend can be fed the same bytes. Samples are read from the decoded planes directly — a
pixel-format conversion would not be bit-exact.
"""

from __future__ import annotations

import fractions
import os

import av
import numpy as np
import torch

from kvfetcher.codec.base import CodecError, CodecParams

_THREADS = max(1, min(8, os.cpu_count() or 1))


def _pix_fmt(planes: int) -> str:
    return "yuv444p" if planes == 3 else "yuv420p"


def _x265_params(params: CodecParams) -> str:
    opts = ["log-level=error", "repeat-headers=1", "info=0"]
    if params.lossless:
        opts.append("lossless=1")
    elif params.qp is not None:
        opts += [f"qp={params.qp}", "aq-mode=0", "psy-rd=0", "psy-rdoq=0", "cutree=0"]
    else:
        raise CodecError("lossy HEVC needs a qp")
    if params.rd is not None:
        opts.append(f"rd={params.rd}")
    keyint = params.gop if params.gop > 0 else 100000
    opts += [f"keyint={keyint}", f"min-keyint={keyint}", "scenecut=0", "open-gop=0", "bframes=0"]
    return ":".join(opts)


class X265Encoder:
    name = "x265"
    format = "hevc"

    def encode(self, frames: torch.Tensor, params: CodecParams) -> bytes:
        n, planes, h, w = frames.shape
        ctx = av.CodecContext.create("libx265", "w")
        ctx.width, ctx.height = w, h
        ctx.pix_fmt = _pix_fmt(planes)
        ctx.time_base = fractions.Fraction(1, 25)
        ctx.framerate = fractions.Fraction(25, 1)
        ctx.options = {"preset": params.speed, "x265-params": _x265_params(params)}
        ctx.thread_count = _THREADS
        arr = frames.to("cpu").contiguous().numpy()
        chroma = None if planes == 3 else np.full((h // 2, w // 2), 128, np.uint8)
        out = bytearray()
        for i in range(n):
            vf = av.VideoFrame(w, h, ctx.pix_fmt)
            for p in range(3):
                src = arr[i, p] if planes == 3 else (arr[i, 0] if p == 0 else chroma)
                vf.planes[p].update(np.ascontiguousarray(src).tobytes() if vf.planes[p].line_size == src.shape[1]
                                    else _pad_lines(src, vf.planes[p].line_size))
            vf.pts = i
            for pkt in ctx.encode(vf):
                out += bytes(pkt)
        for pkt in ctx.encode(None):
            out += bytes(pkt)
        return bytes(out)


def _pad_lines(src: np.ndarray, line_size: int) -> bytes:
    padded = np.zeros((src.shape[0], line_size), np.uint8)
    padded[:, : src.shape[1]] = src
    return padded.tobytes()


def _plane_array(plane, h: int, w: int) -> np.ndarray:
    buf = np.frombuffer(plane, np.uint8)
    return buf.reshape(-1, plane.line_size)[:h, :w]


class LibavDecoder:
    name = "libavcodec"
    format = "hevc"
    validates_input = True

    def decode(self, data: bytes, frame_shape: tuple[int, int, int, int], device: torch.device | str = "cpu") -> torch.Tensor:
        n, planes, h, w = frame_shape
        out = np.empty(frame_shape, np.uint8)
        got = 0
        try:
            ctx = av.CodecContext.create("hevc", "r")
            ctx.thread_count = _THREADS
            for pkt in ctx.parse(data) + ctx.parse(None) + [None]:
                for f in ctx.decode(pkt):
                    if got >= n:
                        raise CodecError(f"bitstream holds more than the {n} frames announced")
                    if (f.width, f.height) != (w, h) or f.format.name != _pix_fmt(planes):
                        raise CodecError(f"decoded {f.width}x{f.height} {f.format.name}, expected {w}x{h} {_pix_fmt(planes)}")
                    for p in range(planes):
                        out[got, p] = _plane_array(f.planes[p], h, w)
                    got += 1
        except av.error.FFmpegError as e:  # corrupt bitstream
            raise CodecError(f"HEVC decode failed: {e}") from e
        if got != n:
            raise CodecError(f"bitstream decoded to {got} frames, expected {n}")
        return torch.from_numpy(out).to(device)
