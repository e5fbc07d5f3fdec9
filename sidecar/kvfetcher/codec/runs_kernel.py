"""runs_kernel: runs of bytes of one GPU buffer copied back to back into another, in one kernel (Triton).

Why: nvCOMP codes each block of a chunk's planes into a slot of its own, and only the coded bytes
go to the host, back to back. Gathered by torch, that is an index of one entry per 16 bytes built
on the GPU and an ``index_select`` over it; here one program copies one piece of one run, reading
the runs' table (three numbers a run) and nothing else.

Every start and length is a multiple of :data:`WORD` bytes (the entropy bitstream's alignment is).
Without Triton, or on CPU tensors outside its interpreter, torch copies the runs (``torch.cat``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvfetcher.codec.gpu_kernels import on_device, serves, tl, triton  # noqa: F401 (tl: the kernel's language)

#: bytes a kernel element moves (the runs' alignment must be a multiple of it)
WORD = 4
#: words a program copies
PIECE = 1024


def enabled(t: torch.Tensor) -> bool:
    """Whether the kernel copies runs of ``t`` (:func:`gpu_kernels.serves`)."""
    return serves(t)


if triton is not None:

    @triton.jit
    def _copy_runs(src_ptr, dst_ptr, table_ptr, PIECE: tl.constexpr):
        run = tl.program_id(0)
        at = tl.program_id(1) * PIECE + tl.arange(0, PIECE)
        src = tl.load(table_ptr + 3 * run)
        dst = tl.load(table_ptr + 3 * run + 1)
        live = at < tl.load(table_ptr + 3 * run + 2)
        tl.store(dst_ptr + dst + at, tl.load(src_ptr + src + at, mask=live), mask=live)


def gather(src: torch.Tensor, starts: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray) -> torch.Tensor:
    """The bytes ``src[s : s + n]`` of each (start, length), back to back, in a new uint8 tensor
    on ``src``'s device, ordered on its current stream (not waited for). ``src``: flat uint8."""
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    if ((starts | lengths) % WORD).any():
        raise ValueError(f"runs must start and end at multiples of {WORD} bytes")
    total = int(lengths.sum())
    if not enabled(src) or not total:
        return torch.cat([src[s : s + n] for s, n in zip(starts, lengths)]) if starts.size else src[:0].clone()
    out = torch.empty(total, dtype=torch.uint8, device=src.device)
    table = torch.from_numpy(np.stack([starts, np.cumsum(lengths) - lengths, lengths], axis=1) // WORD)
    table = table.to(src.device, non_blocking=True)
    grid = (starts.size, triton.cdiv(int(lengths.max()) // WORD, PIECE))
    with on_device(src):
        _copy_runs[grid](src.view(torch.int32), out.view(torch.int32), table, PIECE=PIECE)
    return out
