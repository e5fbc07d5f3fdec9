"""HEVC on NVIDIA video engines through PyNvVideoCodec: NVDEC decode, NVENC encode.

NVDEC is a fixed-function unit: decoding here takes no streaming multiprocessors from the
model. Decoded frames stay in GPU memory and are copied (one device-to-device copy per frame)
into the uint8 planes the layout unpacks; with ``OutputColorType.NATIVE`` a 4:4:4 frame comes
back planar as ``[3*H, W]`` and a 4:2:0 frame as NV12 ``[H*3/2, W]`` whose first ``H`` rows
are luma. The bitstream is handed to PyNvVideoCodec's demuxer from memory, so no file is
written. Many data-centre GPUs have no NVENC; :func:`probe` finds out rather than assumes.

Decoders are created in torch's own CUDA context (the device's primary context,
:func:`torch_context`), and decoding puts back whatever context was current before it
(:func:`_same_context`). Invariant: a thread that decoded can go on doing torch work (a pinned
copy's event, a side stream); with PyNvVideoCodec's default ``cudacontext=0`` another context is
left current and such work fails with "invalid resource handle".
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading

import numpy as np
import torch

from kvfetcher.codec.base import CodecError, CodecParams

_nvc = None


def _lib():
    global _nvc
    if _nvc is None:
        import PyNvVideoCodec as nvc  # noqa: N813

        _nvc = nvc
    return _nvc


@functools.lru_cache(maxsize=None)
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


@functools.lru_cache(maxsize=None)
def torch_context(gpu: int) -> int:
    """The CUcontext handle torch uses on ``gpu`` (the primary context), for PyNvVideoCodec."""
    torch.cuda.init()
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    if _libcuda().cuDeviceGet(ctypes.byref(dev), gpu) or _libcuda().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev):
        raise CodecError(f"cannot retain the primary CUDA context of GPU {gpu}")
    return int(ctx.value)


@contextlib.contextmanager
def _same_context():
    """Whatever PyNvVideoCodec makes current in this thread, put back the context that was."""
    before = ctypes.c_void_p()
    _libcuda().cuCtxGetCurrent(ctypes.byref(before))
    try:
        yield
    finally:
        _libcuda().cuCtxSetCurrent(before)


def probe(gpu: int = 0) -> tuple[bool, bool]:
    """(has NVDEC for HEVC, has NVENC for HEVC) on ``gpu``, by trying to open each."""
    nvc = _lib()
    nvdec = nvenc = False
    with _same_context():
        try:
            nvc.CreateDecoder(gpuid=gpu, codec=nvc.cudaVideoCodec.HEVC, cudacontext=torch_context(gpu), cudastream=0, usedevicememory=True)
            nvdec = True
        except Exception:
            nvdec = False
        try:
            nvc.CreateEncoder(256, 256, "YUV444", True, codec="hevc", gpu_id=gpu)
            nvenc = True
        except Exception:
            nvenc = False
    return nvdec, nvenc


class _Feeder:
    """Hands an in-memory bitstream to the demuxer's read callback, chunk by chunk."""

    def __init__(self, data: bytes):
        self.data = memoryview(data)
        self.pos = 0

    def __call__(self, buf) -> int:
        n = min(len(buf), len(self.data) - self.pos)
        if n > 0:
            buf[:n] = self.data[self.pos : self.pos + n]
            self.pos += n
        return n


class NvdecDecoder:
    """NVDEC decode of one HEVC elementary stream into uint8 planes on the GPU.

    ``feed="packets"`` hands the whole Annex B stream to the decoder as one packet (the
    hardware parser finds the NAL units itself), then an empty end-of-stream packet to flush;
    ``feed="demuxer"`` goes through PyNvVideoCodec's FFmpeg demuxer reading from memory.
    ``reuse`` keeps one decoder per thread, GPU and frame geometry instead of creating one (a
    costly step) per stream; a decoder is not reused across geometries (4:2:0 vs 4:4:4, sizes).
    """

    name = "nvdec"
    format = "hevc"
    validates_input = True
    _local = threading.local()

    def __init__(self, gpu: int = 0, feed: str = "packets", reuse: bool = True):
        self.gpu, self.feed, self.reuse = gpu, feed, reuse

    def _decoder(self, key: tuple):
        cached = getattr(self._local, "decoders", None)
        if self.reuse and cached is not None and key in cached:
            return cached[key]
        nvc = _lib()
        dec = nvc.CreateDecoder(
            gpuid=self.gpu,
            codec=nvc.cudaVideoCodec.HEVC,
            cudacontext=torch_context(self.gpu),
            cudastream=torch.cuda.current_stream(self.gpu).cuda_stream,
            usedevicememory=True,
            outputColorType=nvc.OutputColorType.NATIVE,
        )
        if self.reuse:
            if cached is None:
                self._local.decoders = cached = {}
            cached[key] = dec
        return dec

    def _frames(self, data: bytes, key: tuple):
        nvc = _lib()
        dec = self._decoder(key)
        if self.feed == "demuxer":
            for packet in nvc.CreateDemuxer(_Feeder(data)):
                yield from dec.Decode(packet)
            return
        buf = np.frombuffer(data, np.uint8)
        pkt = nvc.PacketData()
        pkt.bsl_data, pkt.bsl = buf.ctypes.data, buf.size
        yield from dec.Decode(pkt)
        eos = nvc.PacketData()
        eos.bsl_data, eos.bsl = 0, 0
        yield from dec.Decode(eos)

    def decode(self, data: bytes, frame_shape: tuple[int, int, int, int], device: torch.device | str = "cpu") -> torch.Tensor:
        n, planes, h, w = frame_shape
        dev = torch.device("cuda", self.gpu)
        out = torch.empty(frame_shape, dtype=torch.uint8, device=dev)
        got = 0
        key = (self.gpu, planes, h, w)
        try:
            with torch.cuda.device(self.gpu), _same_context():
                for frame in self._frames(data, key):
                    if got >= n:
                        raise CodecError(f"bitstream holds more than the {n} frames announced")
                    self._copy(frame, out[got], planes, h, w)
                    got += 1
        except CodecError:
            self._forget(key)
            raise
        except Exception as e:  # the bindings raise plain RuntimeError/ValueError
            self._forget(key)
            raise CodecError(f"NVDEC decode failed: {type(e).__name__}: {e}") from e
        if got != n:
            self._forget(key)
            raise CodecError(f"bitstream decoded to {got} frames, expected {n}")
        return out if torch.device(device) == dev else out.to(device)

    def _forget(self, key: tuple) -> None:
        """Drop a cached decoder after a failure: its state is no longer trusted."""
        cached = getattr(self._local, "decoders", None)
        if cached:
            cached.pop(key, None)

    @staticmethod
    def _copy(frame, dst: torch.Tensor, planes: int, h: int, w: int) -> None:
        src = torch.from_dlpack(frame)
        if src.dim() == 3:  # some versions add a trailing channel dim of 1
            src = src.reshape(src.shape[0], src.shape[1])
        need = planes * h if planes == 3 else h
        if src.shape[0] < need or src.shape[1] < w:
            raise CodecError(f"NVDEC frame {tuple(src.shape)} too small for {planes}x{h}x{w}")
        dst.copy_(src[:need, :w].reshape(planes, h, w))


class NvencEncoder:
    """NVENC encode, on GPUs that have NVENC (e.g. L4, L40S, RTX; :func:`probe` tells)."""

    name = "nvenc"
    format = "hevc"

    def __init__(self, gpu: int = 0):
        self.gpu = gpu

    def encode(self, frames: torch.Tensor, params: CodecParams) -> bytes:
        n, planes, h, w = frames.shape
        fmt = "YUV444" if planes == 3 else "NV12"
        opts = {"codec": "hevc", "gpu_id": self.gpu, "gop": params.gop or 100000, "bf": 0}
        if params.lossless:
            opts["tuning_info"] = "lossless"
        else:
            opts.update({"rc": "constqp", "constqp": params.qp})
        enc = _lib().CreateEncoder(w, h, fmt, True, **opts)
        out = bytearray()
        host = frames.to("cpu").contiguous()
        for i in range(n):
            if planes == 3:
                buf = host[i].reshape(3 * h, w).numpy()
            else:
                chroma = torch.full((h // 2, w), 128, dtype=torch.uint8)
                buf = torch.cat([host[i, 0], chroma]).numpy()
            out += bytes(enc.Encode(buf))
        out += bytes(enc.EndEncode())
        return bytes(out)
