"""nvCOMP on the GPU: the entropy formats (``zstd``, ``ans``) coded on the streaming multiprocessors.

Every block of a bitstream (entropy.py) is one entry of one nvCOMP batch in the ``RAW`` bitstream
kind: the algorithm's own block format with no nvCOMP header, so a ``zstd`` block is a standard
Zstandard frame that the CPU backend reads (and the other way round). Encoding reads planes
already on the GPU and copies only the coded bytes to the host (compacted on the GPU first, the
padding zeroed); decoding copies the payload to the GPU in one copy (through a reused pinned
buffer) and decodes every block straight into the frames' memory.

Each thread has its own CUDA stream and nvCOMP codecs on it; a call orders its stream after the
caller's current stream and waits for its own work before returning, so the tensors it hands back
are ready on any stream, and memory it allocated is the caller's stream's.
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np
import torch

from kvfetcher.codec import entropy
from kvfetcher.codec.base import CodecError, CodecParams

ALGORITHM = {"zstd": "Zstd", "ans": "ANS"}

_local = threading.local()


@functools.lru_cache(maxsize=1)
def _nvcomp():
    from nvidia import nvcomp  # the nvidia-nvcomp-cu13 wheel (imports its library wheel)

    return nvcomp


def available() -> bool:
    """Whether this process can code on a GPU with nvCOMP (probed once)."""
    return _available()


@functools.lru_cache(maxsize=1)
def _available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        _nvcomp()
    except Exception:  # missing wheel, library that does not load
        return False
    return True


def _device(device: torch.device | str | None) -> torch.device:
    d = torch.device("cuda" if device is None else device)
    return d if d.type == "cuda" and d.index is not None else torch.device("cuda", torch.cuda.current_device())


def _state(dev: torch.device, fmt: str):
    """This thread's (stream, codec) for ``fmt`` on ``dev``."""
    cache = getattr(_local, "codecs", None)
    if cache is None:
        cache = _local.codecs = {}
    key = (dev.index, fmt)
    if key not in cache:
        nv = _nvcomp()
        stream = torch.cuda.Stream(dev)
        codec = nv.Codec(algorithm=ALGORITHM[fmt], device_id=dev.index, cuda_stream=stream.cuda_stream,
                         bitstream_kind=nv.BitstreamKind.RAW)
        cache[key] = (stream, codec)
    return cache[key]


def _pinned(nbytes: int) -> torch.Tensor:
    """This thread's pinned staging buffer, grown to at least ``nbytes`` (reused: pinning is slow)."""
    buf = getattr(_local, "pinned", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.pinned = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
    return buf[:nbytes]


class NvcompCodec:
    """One entropy format on one GPU, both directions."""

    def __init__(self, fmt: str, device: torch.device | str | None = None):
        if fmt not in ALGORITHM:
            raise CodecError(f"nvCOMP codes {sorted(ALGORITHM)}, not {fmt!r}")
        if not available():
            raise CodecError(f"the {fmt!r} format needs a CUDA GPU and nvCOMP (the kvfetcher[gpu] extra)")
        self.format, self.name = fmt, f"nvcomp-{fmt}"
        self.device = _device(device)

    def _capacity(self, codec, block: int) -> int:
        """Most bytes one coded block of ``block`` bytes can take (per codec and size, asked once)."""
        caps = getattr(_local, "caps", None)
        if caps is None:
            caps = _local.caps = {}
        key = (self.device.index, self.format, block)
        if key not in caps:
            probe = torch.zeros(block, dtype=torch.uint8, device=self.device)
            caps[key] = entropy.padded(codec.get_max_comp_buffer_size(_nvcomp().as_array(probe)))
        return caps[key]

    def encode(self, frames: torch.Tensor, params: CodecParams) -> bytes:
        """Planes (on this GPU, or moved there) -> a bitstream; only coded bytes reach the host."""
        nv = _nvcomp()
        stream, codec = _state(self.device, self.format)
        flat = frames.to(self.device).contiguous().view(-1)
        block = params.block_bytes or entropy.DEFAULT_BLOCK
        if block % entropy.ALIGN:
            raise CodecError(f"block_bytes {block} is not a multiple of {entropy.ALIGN}")
        sizes = entropy.block_sizes(flat.numel(), block)
        n, cap = len(sizes), self._capacity(codec, block)
        out = torch.zeros(n * cap, dtype=torch.uint8, device=self.device)  # zeros: the padding stored
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            src = nv.as_arrays(flat, [i * block for i in range(n)], sizes)
            dst = nv.as_arrays(out, [i * cap for i in range(n)], [cap] * n)
            coded = list(codec.encode(src, out=dst).buffer_sizes)  # waits for the coded sizes
            lens = torch.tensor([entropy.padded(c) for c in coded], device=self.device)
            packed = out.view(n, cap)[torch.arange(cap, device=self.device) < lens.unsqueeze(1)]  # back to back
            host = _pinned(packed.numel())
            host.copy_(packed, non_blocking=True)
        stream.synchronize()
        return entropy.join(block, coded, memoryview(host.numpy()))

    def decode(self, data: bytes, frame_shape: tuple[int, int, int, int], device: torch.device | str = "cuda") -> torch.Tensor:
        """A bitstream -> uint8 ``frame_shape`` on ``device`` (decoded on this GPU)."""
        nv = _nvcomp()
        total = math.prod(frame_shape)
        block, sizes, offsets, payload = entropy.split(data, total)
        stream, codec = _state(self.device, self.format)
        host = _pinned(len(payload))
        host.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
        out = torch.empty(total, dtype=torch.uint8, device=self.device)
        staged = torch.empty(len(payload), dtype=torch.uint8, device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                staged.copy_(host, non_blocking=True)
                src = nv.as_arrays(staged, offsets, sizes)
                dst = nv.as_arrays(out, [i * block for i in range(len(sizes))], entropy.block_sizes(total, block))
                codec.decode(src, out=dst)
            stream.synchronize()
        except torch.cuda.OutOfMemoryError:
            raise  # not the object's fault
        except (RuntimeError, ValueError) as e:  # nvCOMP reports what it detects of a bad block this way
            raise CodecError(f"{self.name} decode failed: {e}") from e
        return out.view(frame_shape).to(device)
