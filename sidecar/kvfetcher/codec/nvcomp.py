"""nvCOMP on the GPU: the entropy formats (``zstd``, ``ans``) coded on the streaming multiprocessors.

Every block of a bitstream (entropy.py) is one entry of one nvCOMP batch in the ``RAW`` bitstream
kind: the algorithm's own block format with no nvCOMP header, so a ``zstd`` block is a standard
Zstandard frame that the CPU backend reads (and the other way round).

Encoding reads planes already on the GPU, waits once for the coded sizes, packs the coded blocks
back to back on the GPU (one kernel: runs_kernel.py; the padding zeroed) and copies only those bytes to the host.
Decoding copies the payload to the GPU in one copy (straight from a host tensor it is given, such
as a fetch's pinned staging buffer; bytes go through a reused pinned buffer first) and decodes
every block without waiting for the GPU: the frames it hands back are ordered on the caller's
current stream (a stream reading them elsewhere waits for that one). It waits only for the copy
out of a host tensor it was given, which the caller may reuse once it returns. Both directions run
through per-thread buffers and nvCOMP batches and configurations made once per geometry
(:class:`_Coder`), so no call waits for the GPU while holding the GIL.

Each thread has its own CUDA stream and nvCOMP codecs on it; a call orders its stream after the
caller's current stream, and the caller's current stream after its work; memory it allocated for
the tensors it hands back is the caller's stream's.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading

import numpy as np
import torch

from kvfetcher.codec import entropy, runs_kernel
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
    are not to be shared between threads) and, per planes' size and block size, device buffers
    with the nvCOMP batches and configurations over them, made once.

    Why: wrapping a buffer in a batch (``as_arrays``) waits, holding the GIL, for the GPU work
    queued before it, and a decode without a configuration waits for the GPU to read every block's
    header; either wait in one thread stalls every other thread of the process."""

    def __init__(self, dev: torch.device, fmt: str):
        nv = _nvcomp()
        self.device, self.stream = dev, torch.cuda.Stream(dev)
        self.codec = nv.Codec(algorithm=ALGORITHM[fmt], device_id=dev.index, cuda_stream=self.stream.cuda_stream,
                              bitstream_kind=nv.BitstreamKind.RAW)
        self._caps: dict[int, int] = {}
        self._plans: dict[tuple[str, tuple[int, ...], int], _Plan] = {}
        self._staged = torch.empty(0, dtype=torch.uint8, device=dev)

    def capacity(self, block: int) -> int:
        """Most bytes (padded) one coded block of ``block`` bytes can take."""
        if block not in self._caps:
            probe = torch.zeros(block, dtype=torch.uint8, device=self.device)
            self._caps[block] = entropy.padded(self.codec.get_max_comp_buffer_size(_nvcomp().as_array(probe)))
        return self._caps[block]

    def plan(self, way: str, parts: tuple[int, ...], block: int) -> "_Plan":
        """The buffers and batches to ``encode`` or ``decode`` planes of ``parts`` bytes (back to back,
        each cut into blocks of ``block`` bytes of its own)."""
        key = (way, parts, block)
        if key not in self._plans:
            if len(self._plans) >= 8:  # a process sees a few geometries; never grow without bound
                self._plans.clear()
            self._plans[key] = _Plan(self, way, parts, block)
        return self._plans[key]

    def staged(self, nbytes: int) -> torch.Tensor:
        """This thread's device buffer for a coded payload, grown to at least ``nbytes`` (reused:
        only this coder's stream touches it, so a call's copy into it follows the last call's decode)."""
        if self._staged.numel() < nbytes:
            self._staged = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device=self.device)
        return self._staged


class _Plan:
    """Planes of ``parts`` bytes back to back, each part in blocks of ``block`` (its last one
    shorter): the planes' buffer and its batch (the encoder's input, the decoder's output), for
    encoding also the coded slots (``cap`` bytes a block) and their batch, and the codec's
    configuration. ``bounds[i]``: part i's first block and its start in the planes."""

    def __init__(self, c: _Coder, way: str, parts: tuple[int, ...], block: int):
        nv = _nvcomp()
        self.sizes, offsets, self.bounds = [], [], []
        for part, at in zip(parts, itertools.accumulate(parts, initial=0)):
            self.bounds.append((len(self.sizes), at))
            sizes = entropy.block_sizes(part, block)
            offsets += [at + i * block for i in range(len(sizes))]
            self.sizes += sizes
        self.bounds.append((len(self.sizes), sum(parts)))
        n = len(self.sizes)
        self.planes = torch.empty(sum(parts), dtype=torch.uint8, device=c.device)
        self.planes_batch = nv.as_arrays(self.planes, offsets, self.sizes)
        cfg = c.codec.compression_config(self.sizes)
        if way == "encode":
            self.cap = c.capacity(block)
            self.slots = torch.empty(n * self.cap, dtype=torch.uint8, device=c.device)
            self.starts = np.arange(n, dtype=np.int64) * self.cap  # each block's coded slot
            self.slots_batch = nv.as_arrays(self.slots, self.starts.tolist(), [self.cap] * n)
            self.config = cfg
        else:
            self.config = c.codec.decompression_config(cfg)


def _coder(dev: torch.device, fmt: str) -> _Coder:
    coders = getattr(_local, "coders", None)
    if coders is None:
        coders = _local.coders = {}
    key = (dev.index, fmt)
    if key not in coders:
        coders[key] = _Coder(dev, fmt)
    return coders[key]


def _pinned(nbytes: int) -> torch.Tensor:
    """This thread's pinned staging buffer, grown to at least ``nbytes`` (reused: pinning is slow),
    once the copy out of it that the last decode queued (``_local.pinned_read``) is done."""
    read = getattr(_local, "pinned_read", None)
    if read is not None:
        read.synchronize()
        _local.pinned_read = None
    buf = getattr(_local, "pinned", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.pinned = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=True)
    return buf[:nbytes]


class NvcompCodec:
    """One entropy format on one GPU, both directions. Its decoder does not validate its input."""

    validates_input = False

    def __init__(self, fmt: str, device: torch.device | str | None = None):
        if fmt not in ALGORITHM:
            raise CodecError(f"nvCOMP codes {sorted(ALGORITHM)}, not {fmt!r}")
        if not available():
            raise CodecError(f"the {fmt!r} format needs a CUDA GPU and nvCOMP (the kvfetcher[gpu] extra)")
        self.format, self.name = fmt, f"nvcomp-{fmt}"
        self.device = _device(device)

    def encode(self, frames: torch.Tensor, params: CodecParams) -> memoryview:
        """Planes (on this GPU, or moved there) -> a bitstream (:meth:`encode_parts` of one part)."""
        return self.encode_parts([frames], params)[0]

    def encode_parts(self, parts: list[torch.Tensor], params: CodecParams) -> list[memoryview]:
        """Each part's planes (on this GPU, or moved there) -> its own bitstream, all coded in one
        nvCOMP batch (one launch and one wait for any number of chunks); only coded bytes reach the
        host, copied once, into page-locked memory of each bitstream's own (torch's host allocator
        takes it back when the view is dropped)."""
        c = _coder(self.device, self.format)
        flats = [f.to(self.device).contiguous().view(-1) for f in parts]
        block = params.block_bytes or entropy.DEFAULT_BLOCK
        if block % entropy.ALIGN:
            raise CodecError(f"block_bytes {block} is not a multiple of {entropy.ALIGN}")
        p = c.plan("encode", tuple(f.numel() for f in flats), block)
        c.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(c.stream):
            for f, (_, at) in zip(flats, p.bounds):
                p.planes[at : at + f.numel()].copy_(f)
            p.slots.zero_()  # the padding stored
            arrays = c.codec.encode(p.planes_batch, out=p.slots_batch, compression_config=p.config)
            c.stream.synchronize()  # the one wait, here without the GIL (reading the sizes waits holding it)
            coded = np.asarray(arrays.buffer_sizes, dtype=np.int64)
            padded = entropy.padded(coded)
            packed = runs_kernel.gather(p.slots, p.starts, padded)
            ends = np.concatenate([[0], np.cumsum(padded)])
            outs = []
            for (a, _), (b, _) in itertools.pairwise(p.bounds):
                head = entropy.table(block, coded[a:b])
                out = torch.empty(len(head) + int(ends[b] - ends[a]), dtype=torch.uint8, pin_memory=True)
                out[len(head) :].copy_(packed[ends[a] : ends[b]], non_blocking=True)
                out.numpy()[: len(head)] = np.frombuffer(head, np.uint8)
                outs.append(out)
        c.stream.synchronize()
        return [memoryview(out.numpy()) for out in outs]

    def decode(self, data: entropy.Bitstream, frame_shape: tuple[int, int, int, int],
               device: torch.device | str = "cuda") -> torch.Tensor:
        """A bitstream -> uint8 ``frame_shape`` on ``device`` (decoded on this GPU), ordered on the
        caller's current stream and not waited for. ``data`` as a host tensor (best pinned) is
        copied to the GPU in place, and free to reuse when this returns.

        nvCOMP does not report a damaged block (it decodes to wrong planes): the checksums of the
        container are what keeps a damaged bitstream from reaching a buffer."""
        nv = _nvcomp()
        total = math.prod(frame_shape)
        block, sizes, offsets, payload = entropy.split(data, total)
        given = isinstance(data, torch.Tensor)
        if given:
            src = data[data.numel() - len(payload) :]
        else:
            src = _pinned(len(payload))
            src.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)  # (numpy copies without the GIL)
        c = _coder(self.device, self.format)
        if max(sizes) > c.capacity(min(block, total)):
            raise CodecError(f"{self.name} block of {max(sizes)} bytes, more than a {block}-byte block can code to")
        p = c.plan("decode", (total,), block)
        staged = c.staged(len(payload))
        coded = nv.as_arrays(staged, offsets, sizes)  # (before any work is queued on it: see _Coder)
        out = torch.empty(total, dtype=torch.uint8, device=self.device)
        c.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(c.stream):
                staged[: len(payload)].copy_(src, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(c.stream)
                c.codec.decode(coded, out=p.planes_batch, decompression_config=p.config)
                out.copy_(p.planes)
        except torch.cuda.OutOfMemoryError:
            raise  # not the object's fault
        except (RuntimeError, ValueError) as e:  # a bitstream nvCOMP refuses outright
            raise CodecError(f"{self.name} decode failed: {e}") from e
        finally:
            torch.cuda.current_stream(self.device).wait_stream(c.stream)
        if given:
            copied.synchronize()  # the caller may reuse its buffer once this returns
        else:
            _local.pinned_read = copied
        return out.view(frame_shape).to(device)
