"""nvCOMP on the GPU: the entropy formats (``zstd``, ``ans``) coded on the streaming multiprocessors.

Every block of a bitstream (entropy.py) is one entry of one nvCOMP batch in the ``RAW`` bitstream
kind: the algorithm's own block format with no nvCOMP header, so a ``zstd`` block is a standard
Zstandard frame that the CPU backend reads (and the other way round).

Encoding reads planes already on the GPU, waits once for the coded sizes, packs the coded blocks
back to back on the GPU (one gather, the padding zeroed) and copies only those bytes to the host.
Decoding copies the payload to the GPU in one copy (straight from a host tensor it is given, such
as a fetch's pinned staging buffer; bytes go through a reused pinned buffer first) and decodes
every block straight into the frames' memory.

Each thread has its own CUDA stream and nvCOMP codecs on it; a call orders its stream after the
caller's current stream and waits for its own work before returning, so the tensors it hands back
are ready on any stream, and memory it allocated for them is the caller's stream's.
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


class _Coder:
    """One thread's nvCOMP state for one format on one GPU: its stream, its codec (nvCOMP codecs
    are not to be shared between threads), and the block capacities it has asked for."""

    def __init__(self, dev: torch.device, fmt: str):
        nv = _nvcomp()
        self.device, self.stream = dev, torch.cuda.Stream(dev)
        self.codec = nv.Codec(algorithm=ALGORITHM[fmt], device_id=dev.index, cuda_stream=self.stream.cuda_stream,
                              bitstream_kind=nv.BitstreamKind.RAW)
        self._caps: dict[int, int] = {}

    def capacity(self, block: int) -> int:
        """Most bytes (padded) one coded block of ``block`` bytes can take."""
        if block not in self._caps:
            probe = torch.zeros(block, dtype=torch.uint8, device=self.device)
            self._caps[block] = entropy.padded(self.codec.get_max_comp_buffer_size(_nvcomp().as_array(probe)))
        return self._caps[block]


def _coder(dev: torch.device, fmt: str) -> _Coder:
    coders = getattr(_local, "coders", None)
    if coders is None:
        coders = _local.coders = {}
    key = (dev.index, fmt)
    if key not in coders:
        coders[key] = _Coder(dev, fmt)
    return coders[key]


def _pinned(nbytes: int) -> torch.Tensor:
    """This thread's pinned staging buffer, grown to at least ``nbytes`` (reused: pinning is slow).
    Its previous contents are no longer needed: every call waits for its own copies."""
    buf = getattr(_local, "pinned", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.pinned = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
    return buf[:nbytes]


def _pack(out: torch.Tensor, cap: int, lengths: list[int]) -> torch.Tensor:
    """The first ``lengths[i]`` bytes of each ``cap``-byte slot of ``out``, back to back, gathered
    on the GPU without waiting for it: in rows of :data:`entropy.ALIGN` bytes (every length and
    ``cap`` are multiples of it), row ``r`` of the output being row ``r + shift[block]`` of ``out``."""
    rows = [n // entropy.ALIGN for n in lengths]
    starts = np.concatenate([[0], np.cumsum(rows[:-1])]).astype(np.int64)
    shift = np.arange(len(rows), dtype=np.int64) * (cap // entropy.ALIGN) - starts
    total = sum(rows)
    table = torch.from_numpy(np.stack([shift, np.asarray(rows, dtype=np.int64)])).to(out.device, non_blocking=True)
    src = torch.repeat_interleave(table[0], table[1], output_size=total) + torch.arange(total, device=out.device)
    return out.view(-1, entropy.ALIGN).index_select(0, src).view(-1)


class NvcompCodec:
    """One entropy format on one GPU, both directions."""

    def __init__(self, fmt: str, device: torch.device | str | None = None):
        if fmt not in ALGORITHM:
            raise CodecError(f"nvCOMP codes {sorted(ALGORITHM)}, not {fmt!r}")
        if not available():
            raise CodecError(f"the {fmt!r} format needs a CUDA GPU and nvCOMP (the kvfetcher[gpu] extra)")
        self.format, self.name = fmt, f"nvcomp-{fmt}"
        self.device = _device(device)

    def encode(self, frames: torch.Tensor, params: CodecParams) -> bytes:
        """Planes (on this GPU, or moved there) -> a bitstream; only coded bytes reach the host."""
        nv = _nvcomp()
        c = _coder(self.device, self.format)
        flat = frames.to(self.device).contiguous().view(-1)
        block = params.block_bytes or entropy.DEFAULT_BLOCK
        if block % entropy.ALIGN:
            raise CodecError(f"block_bytes {block} is not a multiple of {entropy.ALIGN}")
        sizes = entropy.block_sizes(flat.numel(), block)
        n, cap = len(sizes), c.capacity(block)
        c.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(c.stream):
            out = torch.zeros(n * cap, dtype=torch.uint8, device=self.device)  # zeros: the padding stored
            src = nv.as_arrays(flat, [i * block for i in range(n)], sizes)
            dst = nv.as_arrays(out, [i * cap for i in range(n)], [cap] * n)
            coded = list(c.codec.encode(src, out=dst).buffer_sizes)  # the one wait: the coded sizes
            packed = _pack(out, cap, [entropy.padded(s) for s in coded])
            host = _pinned(packed.numel())
            host.copy_(packed, non_blocking=True)
        c.stream.synchronize()
        return entropy.join(block, coded, host.numpy())

    def decode(self, data: entropy.Bitstream, frame_shape: tuple[int, int, int, int],
               device: torch.device | str = "cuda") -> torch.Tensor:
        """A bitstream -> uint8 ``frame_shape`` on ``device`` (decoded on this GPU). ``data`` as a
        host tensor (best pinned) is copied to the GPU in place."""
        nv = _nvcomp()
        total = math.prod(frame_shape)
        block, sizes, offsets, payload = entropy.split(data, total)
        if isinstance(data, torch.Tensor):
            src_bytes = data[data.numel() - len(payload) :]
        else:
            src_bytes = _pinned(len(payload))
            src_bytes.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)  # (numpy copies without the GIL)
        c = _coder(self.device, self.format)
        out = torch.empty(total, dtype=torch.uint8, device=self.device)
        c.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(c.stream):
                staged = src_bytes.to(self.device, non_blocking=True)
                src = nv.as_arrays(staged, offsets, sizes)
                dst = nv.as_arrays(out, [i * block for i in range(len(sizes))], entropy.block_sizes(total, block))
                c.codec.decode(src, out=dst)
            c.stream.synchronize()
        except torch.cuda.OutOfMemoryError:
            raise  # not the object's fault
        except (RuntimeError, ValueError) as e:  # nvCOMP reports what it detects of a bad block this way
            raise CodecError(f"{self.name} decode failed: {e}") from e
        return out.view(frame_shape).to(device)
