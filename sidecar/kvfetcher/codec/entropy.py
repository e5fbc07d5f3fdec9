"""entropy: the planes entropy-coded in independent blocks, and the portable ``zstd`` backend.

The entropy formats (``zstd``, ``ans``) code the same uint8 planes the video formats do (same
layout, same quantisation: the same KV after restore), flattened and cut into blocks of
``block_bytes`` (the last one shorter), each coded on its own so that a GPU codes them all in
parallel. A bitstream is::

    u32 block_bytes | u32 n | u32 size[n] | block 0 | pad | ... | block n-1 | pad    (little-endian)

``n`` is ``ceil(planes' bytes / block_bytes)``; each block is zero-padded to a multiple of
:data:`ALIGN` bytes (nvCOMP's alignment, so the payload goes to the GPU in one copy), and the
padded sizes add up to the rest: :func:`split` checks all of it before anything is decoded.
A bitstream may be handed to a decoder as bytes, a memoryview or a host uint8 tensor (a fetch's
staging buffer, from which a GPU decoder copies without another host copy). A ``zstd`` block is one standard Zstandard frame (RFC
8878), so the zstandard package here and nvCOMP's GPU coder (codec/nvcomp.py) read each other's
blocks; an ``ans`` block is nvCOMP's ANS format, which has no CPU decoder.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch
import zstandard

from kvfetcher.codec.base import CodecError, CodecParams

_HEAD = struct.Struct("<II")
DEFAULT_BLOCK = 1 << 16  # nvCOMP's own default chunk: 64 KiB
#: the CPU encoder's zstd parameters when the preset names no level: a quantised plane is noise to
#: an LZ coder (each sample its own draw), so the short matches a standard level finds and codes
#: as sequences cost more than the literals they replace; with matches of at least 7 bytes and a
#: tiny match table almost everything is coded as Huffman literals, 2-6% above the blocks' order-0
#: entropy: 2-11% smaller than level 3 on the calibrated presets' planes (the transform's 6-11%,
#: most at coarse steps; q8's nearly incompressible planes ~1% larger), and encoding 3-4x faster
#: (benchmarks/transform/zstd_params.md). The frames are standard zstd, read by any decoder.
LITERAL_PARAMS = dict(strategy=zstandard.STRATEGY_FAST, min_match=7, window_log=17, hash_log=6, search_log=1)
ALIGN = 16  # bytes: every coded block starts at a multiple of this in the payload


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


Bitstream = bytes | memoryview | torch.Tensor


def table(block_bytes: int, sizes: list[int]) -> bytes:
    """A bitstream's block table: what precedes its coded blocks."""
    return _HEAD.pack(block_bytes, len(sizes)) + np.asarray(sizes, dtype="<u4").tobytes()


def join(block_bytes: int, sizes: list[int], payload: bytes | memoryview) -> bytes:
    """A bitstream from its coded blocks' sizes and their bytes, each already padded (:func:`padded`)."""
    return b"".join([table(block_bytes, sizes), payload])  # one copy


def join_blocks(block_bytes: int, blocks: list[bytes]) -> bytes:
    """A bitstream from a list of coded blocks."""
    return join(block_bytes, [len(b) for b in blocks], b"".join(b + bytes(padded(len(b)) - len(b)) for b in blocks))


def host_bytes(data: Bitstream) -> memoryview:
    """A bitstream's bytes, whichever form it came in (a tensor: a host one, viewed in place)."""
    return memoryview(data.numpy() if isinstance(data, torch.Tensor) else data).cast("B")


def split(data: Bitstream, total: int) -> tuple[int, list[int], list[int], memoryview]:
    """(block_bytes, coded sizes, their offsets in the payload, payload) of a bitstream coding
    ``total`` bytes of planes; a :class:`CodecError` unless its table is consistent with ``total``
    and its own length."""
    mem = host_bytes(data)
    if len(mem) < _HEAD.size:
        raise CodecError(f"entropy bitstream of {len(mem)} bytes has no block table")
    block, n = _HEAD.unpack_from(mem)
    if block <= 0 or n != math.ceil(total / block):
        raise CodecError(f"entropy bitstream has {n} blocks of {block} bytes, not the {total} bytes of planes announced")
    end = _HEAD.size + 4 * n
    if len(mem) < end:
        raise CodecError("entropy bitstream truncated in its block table")
    coded = np.frombuffer(mem[_HEAD.size : end], dtype="<u4").astype(np.int64)
    sizes, offsets = coded.tolist(), np.concatenate([[0], np.cumsum(-(-coded // ALIGN) * ALIGN)]).tolist()
    if offsets[-1] != len(mem) - end or min(sizes, default=1) <= 0:
        raise CodecError(f"entropy blocks add up to {offsets[-1]} bytes, the bitstream holds {len(mem) - end}")
    return block, sizes, offsets[:-1], mem[end:]


def block_sizes(total: int, block: int) -> list[int]:
    """Uncompressed size of each block of ``total`` bytes."""
    return [min(block, total - a) for a in range(0, total, block)]


def compressor(level: int | None) -> zstandard.ZstdCompressor:
    """The CPU encoder of the ``zstd`` format: :data:`LITERAL_PARAMS`, or zstd ``level`` if given."""
    if level is None:
        return zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters(write_content_size=True, **LITERAL_PARAMS))
    return zstandard.ZstdCompressor(level=level, write_content_size=True)


class ZstdCodec:
    """``zstd`` on the CPU (the zstandard package, its threads across blocks)."""

    name = "zstd"
    format = "zstd"
    validates_input = True

    def encode(self, frames: torch.Tensor, params: CodecParams) -> bytes:
        data = frames.to("cpu").contiguous().view(-1).numpy()
        block = params.block_bytes or DEFAULT_BLOCK
        cctx = compressor(params.level)
        pieces = [data[a : a + block] for a in range(0, data.size, block)]
        out = cctx.multi_compress_to_buffer(pieces, threads=-1)
        return join_blocks(block, [out[i].tobytes() for i in range(len(out))])

    def decode(self, data: Bitstream, frame_shape: tuple[int, int, int, int], device: torch.device | str = "cpu") -> torch.Tensor:
        total = math.prod(frame_shape)
        block, sizes, offsets, payload = split(data, total)
        out = np.empty(total, np.uint8)
        dctx = zstandard.ZstdDecompressor()
        for i, (at, size, want) in enumerate(zip(offsets, sizes, block_sizes(total, block))):
            try:
                raw = dctx.decompress(payload[at : at + size], max_output_size=want)
            except zstandard.ZstdError as e:
                raise CodecError(f"zstd block {i} does not decode: {e}") from e
            if len(raw) != want:
                raise CodecError(f"zstd block {i} decoded to {len(raw)} bytes, expected {want}")
            out[i * block : i * block + want] = np.frombuffer(raw, np.uint8)
        return torch.from_numpy(out).view(frame_shape).to(device)
