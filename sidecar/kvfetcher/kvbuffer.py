"""kvbuffer: the KV buffers the sidecar reads from and writes into.

A KV buffer is ``[layers, 2, kv_heads, capacity, head_dim]`` (K and V on axis 1, token slots on
axis 3) in one of :data:`DTYPES`; a chunk is the same shape with ``tokens`` in place of
``capacity``. Token ``i`` of a prompt lives in slot ``slots[i]``: contiguous slots form a plain
view of the buffer, scattered ones (a paged cache) are written through ``index_copy_``
(:class:`Destination`). This is the bottom layer: it knows shapes and slots, not codecs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfetcher.errors import GeometryMismatchError

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


class Destination:
    """Where a fetch writes: token ``i`` of the prompt goes to slot ``slots[i]`` of ``buffer``.

    ``buffer`` is ``[layers, 2, kv_heads, capacity, head_dim]``; the slots are ``slots[:tokens]``
    or ``range(offset, offset + tokens)`` (:func:`slot_list`). A chunk's contiguous slots are
    written in place through :meth:`view` (no copy), scattered ones (a paged cache) through
    :meth:`scatter`; every write ends with :meth:`finish`. ``handle`` is the buffer's IPC handle
    (:mod:`ipc`), which decode worker processes open to write into the same memory.
    """

    def __init__(self, buffer: torch.Tensor, slots: Sequence[int] | None = None, offset: int = 0, tokens: int | None = None,
                 handle: dict | None = None):
        check_shape(buffer)
        self.buffer = buffer
        self.handle = handle
        if tokens is None:
            if slots is None:
                raise ValueError("give the destination's slots or its number of tokens")
            tokens = len(slots)
        self.slots = slot_list(buffer.shape[3], tokens, slots, offset)

    def check(self, h, c: ChunkRef) -> None:
        """Refuse a chunk (``h``: its header's ``shape``, ``dtype`` and ``torch_dtype``) that does not
        fit: wrong geometry or dtype is :class:`GeometryMismatchError` (a miss here, not a bad object); slots
        beyond the destination a ValueError."""
        L, _, H, _, D = self.buffer.shape
        if tuple(h.shape) != (L, 2, H, c.tokens, D) or h.torch_dtype != self.buffer.dtype:
            raise GeometryMismatchError(
                f"chunk {tuple(h.shape)} {h.dtype} does not fit buffer {tuple(self.buffer.shape)} {self.buffer.dtype}"
            )
        if c.start + c.tokens > len(self.slots):
            raise ValueError(f"no destination slots for tokens {c.start}..{c.start + c.tokens}")

    def view(self, c: ChunkRef) -> torch.Tensor | None:
        """The buffer view the chunk's slots form when they are contiguous, else None (scatter)."""
        idx = self.slots[c.start : c.start + c.tokens]
        return self.buffer[:, :, :, idx[0] : idx[0] + len(idx)] if contiguous(idx) else None

    def scatter(self, c: ChunkRef, kv: torch.Tensor) -> None:
        """Write the chunk's KV ``[layers, 2, kv_heads, tokens, head_dim]`` into its slots, wherever they are."""
        idx = torch.tensor(self.slots[c.start : c.start + c.tokens], device=self.buffer.device)
        self.buffer.index_copy_(3, idx, kv.to(self.buffer.device, non_blocking=True))

    def finish(self) -> None:
        """Wait until the writes queued on the GPU are done: the model (another process) reads the
        buffer once the fetch answers."""
        if self.buffer.is_cuda:
            torch.cuda.current_stream(self.buffer.device).synchronize()

    def write_kv(self, c: ChunkRef, kv: torch.Tensor) -> None:
        """Copy a verified chunk ``[layers, 2, kv_heads, tokens, head_dim]`` (host memory) into its
        slots. On a GPU the copy is non-blocking from pinned memory and waited for, so the chunk is
        in the buffer when this returns and the host memory may be reused.

        It runs on the calling thread's current stream, not a dedicated one: in the sidecar's own
        process nothing else queues on the GPU, and a dedicated stream failed ("invalid resource
        handle") in threads that had run NVDEC."""
        view = self.view(c)
        if view is not None:
            view.copy_(kv, non_blocking=True)
        else:
            self.scatter(c, kv)
        self.finish()


# --- paged destinations (a serving engine's block tables) ---------------------------------------

_AXES = "LKBTHD"  # the canonical order paged tensors are viewed in


@dataclass(frozen=True)
class PagedLayout:
    """How one registered paged KV tensor is laid out: ``dims`` names its axes in order with the
    letters L (layer), K (0 key, 1 value), B (block), T (token in block), H (kv head), D (head dim),
    each once; L is optional (without it a tensor holds one layer, and a list of them holds the
    layers in order). Token ``i`` of a prompt lives at position ``i % block_size`` of block
    ``block_ids[i // block_size]``. K/V packed into the head-dim axis (``2 * head_dim``) is given
    as a view that splits it (``t.unflatten(-1, (2, D))``: dims ``...KD``)."""

    dims: str
    block_size: int

    def __post_init__(self):
        if sorted(self.dims) not in (sorted(_AXES), sorted(_AXES[1:])) or self.block_size <= 0:
            raise ValueError(f"paged layout {self.dims!r}/{self.block_size}: dims must name K, B, T, H, D (and L) once each, "
                             "block_size must be positive")


def _canonical(tensors, layout: PagedLayout) -> list[torch.Tensor]:
    """Views ``[2, blocks, block_size, kv_heads, head_dim]``, one per layer, of the paged tensors."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    for t in tensors:
        if t.dim() != len(layout.dims):
            raise ValueError(f"a {layout.dims} tensor has {len(layout.dims)} axes, not {t.dim()}")
        if t.shape[layout.dims.index("T")] != layout.block_size:
            raise ValueError(f"the T axis is {t.shape[layout.dims.index('T')]} long, not block_size {layout.block_size}")
    axes = [c for c in _AXES if c in layout.dims]
    views = [t.permute(*[layout.dims.index(c) for c in axes]) for t in tensors]
    return [layer for v in views for layer in (v.unbind(0) if "L" in layout.dims else (v,))]


def _blocks(layers: list[torch.Tensor], layout: PagedLayout, block_ids, first_token: int, tokens: int) -> torch.Tensor:
    bs = layout.block_size
    if first_token < 0 or first_token % bs or tokens % bs:
        raise ValueError(f"tokens {first_token}..{first_token + tokens} are not whole blocks of {bs}")
    ids = [int(b) for b in block_ids[first_token // bs : (first_token + tokens) // bs]]
    if len(ids) * bs != tokens:
        raise ValueError(f"{len(block_ids)} block ids do not cover tokens {first_token}..{first_token + tokens}")
    n = layers[0].shape[1]
    if ids and (min(ids) < 0 or max(ids) >= n):
        raise ValueError(f"block ids out of range for {n} blocks")
    if len(set(ids)) != len(ids):
        raise ValueError("block ids must be distinct")
    return torch.tensor(ids, dtype=torch.long, device=layers[0].device)


def write_blocks(tensors, layout: PagedLayout, block_ids, kv: torch.Tensor, first_token: int = 0) -> None:
    """Write ``kv`` ``[layers, 2, kv_heads, T, head_dim]``, the KV of tokens ``first_token ..
    first_token + T`` of a prompt, into its blocks (whole blocks only; ``ValueError`` otherwise)."""
    layers = _canonical(tensors, layout)
    L, _, H, T, D = kv.shape
    if L != len(layers) or (H, D) != tuple(layers[0].shape[3:]):
        raise ValueError(f"KV {tuple(kv.shape)} does not fit {len(layers)} layers of {tuple(layers[0].shape)}")
    idx = _blocks(layers, layout, block_ids, first_token, T)
    src = kv.unflatten(3, (T // layout.block_size, layout.block_size)).permute(0, 1, 3, 4, 2, 5)  # [L, 2, nb, bs, H, D]
    for layer, s in zip(layers, src):
        layer.index_copy_(1, idx, s.to(layer.device, layer.dtype))


def read_blocks(tensors, layout: PagedLayout, block_ids, first_token: int, tokens: int) -> torch.Tensor:
    """The KV ``[layers, 2, kv_heads, tokens, head_dim]`` of tokens ``first_token .. first_token +
    tokens`` of a prompt, read from its blocks (whole blocks only)."""
    layers = _canonical(tensors, layout)
    idx = _blocks(layers, layout, block_ids, first_token, tokens)
    out = torch.stack([layer.index_select(1, idx) for layer in layers])  # [L, 2, nb, bs, H, D]
    return out.flatten(2, 3).transpose(2, 3).contiguous()
