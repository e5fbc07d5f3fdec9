"""kvbuffer: the KV buffers the sidecar reads from and writes into.

A KV buffer is ``[layers, 2, kv_heads, capacity, head_dim]`` (K and V on axis 1, token slots on
axis 3) in one of :data:`DTYPES`; a chunk is the same shape with ``tokens`` in place of
``capacity``. Token ``i`` of a prompt lives in slot ``slots[i]``: contiguous slots form a plain
view of the buffer, scattered ones (a paged cache) are written through ``index_copy_``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: dtypes a chunk may have, by name as written in container headers.
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype}; supported: {sorted(DTYPES)}")


def bytes_per_value(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def check_shape(t: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``t`` is shaped like a KV buffer."""
    if t.dim() != 5 or t.shape[1] != 2:
        raise ValueError(f"KV buffer must be [layers, 2, kv_heads, capacity, head_dim], got {tuple(t.shape)}")


@dataclass(frozen=True)
class ChunkRef:
    name: str  # object name in the store
    size: int  # object size as listed (a truncated object is caught before any decoding)
    start: int  # first token of the chunk in the prompt
    tokens: int


def slot_list(capacity: int, tokens: int, slots: Sequence[int] | None = None, offset: int = 0) -> Sequence[int]:
    """The buffer slots of ``tokens`` tokens: ``slots[:tokens]``, or ``range(offset, offset + tokens)``.

    The contiguous case stays a ``range`` (no per-token list on the path that answers
    "recompute" without touching the store). Raises ``ValueError`` for slots outside the buffer,
    too few slots or repeated slots.
    """
    if slots is None:
        if offset < 0 or offset + tokens > capacity:
            raise ValueError(f"slots out of range for a buffer of {capacity} token slots")
        return range(offset, offset + tokens)
    idx = [int(s) for s in slots[:tokens]]
    if len(idx) < tokens:
        raise ValueError(f"{len(idx)} slots given for {tokens} tokens")
    if idx and (min(idx) < 0 or max(idx) >= capacity):
        raise ValueError(f"slots out of range for a buffer of {capacity} token slots")
    if len(set(idx)) != len(idx):
        raise ValueError("slots must be distinct")
    return idx


def contiguous(idx: Sequence[int]) -> bool:
    """Whether the slots are consecutive, so a plain view of the buffer holds them."""
    if isinstance(idx, range):
        return idx.step == 1 or len(idx) <= 1
    return idx == list(range(idx[0], idx[0] + len(idx)))
