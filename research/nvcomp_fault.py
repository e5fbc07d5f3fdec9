"""Does an object whose entropy frames are noise under right CRC-32s fault the GPU's decoder?

``python -m research.nvcomp_fault FORMAT DAMAGE SEED`` (zstd|ans, noise|all, an integer), one case a
process (a faulted CUDA context stays faulted): a q8 chunk coded on the GPU, its segment's frames
replaced (``noise``: the block table kept; ``all``: every byte), decoded into a CUDA buffer with the
library's default (trusted) decoder; then whether the context still works. Results and the run:
``research/results/nvcomp_fault_h200.md``.
"""
import sys

import numpy as np
import torch

from kvfetcher import chunk
from kvtest import rebuild


def noise(b: bytes, seed: int = 0) -> bytes:
    """The block table kept, the frames noise."""
    keep = 8 + 4 * int.from_bytes(b[4:8], "little")
    return b[:keep] + np.random.default_rng(seed).bytes(len(b) - keep)


def all_noise(b: bytes, seed: int = 0) -> bytes:
    """Every byte noise."""
    return np.random.default_rng(seed).bytes(len(b))


def main() -> None:
    fmt, damage, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    g = torch.Generator().manual_seed(1)
    kv = (torch.randn(30, 2, 3, 24, 64, generator=g) * 2).half()
    obj = chunk.encode_chunk(kv.cuda(), f"q8-{fmt}", "fp")

    bad = rebuild(obj, segment=lambda b: {"noise": noise, "all": all_noise}[damage](b, seed))
    out = torch.full(kv.shape, 7.0, dtype=kv.dtype, device="cuda")
    try:
        chunk.decode_chunk(bad, "fp", out=out)
        print(fmt, damage, "DECODED without error")
    except Exception as e:
        print(fmt, damage, "raised", type(e).__name__, str(e)[:200])
    try:
        torch.cuda.synchronize()
        ok = bool((out == 7.0).all().item())
        good = torch.full(kv.shape, 7.0, dtype=kv.dtype, device="cuda")
        chunk.decode_chunk(obj, "fp", out=good)
        torch.cuda.synchronize()
        print(fmt, damage, "context alive; buffer untouched:", ok, "; a good object then decodes")
    except Exception as e:
        print(fmt, damage, "CONTEXT DEAD:", type(e).__name__, str(e)[:200])


if __name__ == "__main__":
    main()
