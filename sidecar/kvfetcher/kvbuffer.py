"""kvbuffer: the KV buffers the sidecar reads from and writes into.

A chunk is ``[layers, 2, kv_heads, tokens, head_dim]`` (K and V on axis 1) in one of
:data:`DTYPES`. A buffer holds a prompt's KV in one of two ways:

* flat: ``[layers, 2, kv_heads, capacity, head_dim]``; token ``i`` lives in slot ``slots[i]``.
  Contiguous slots form a plain view of the buffer, scattered ones are written through
  ``index_copy_`` (:class:`Destination`).
* paged, as a serving engine keeps it: blocks of ``block_size`` tokens in one or more tensors laid
  out as a :class:`PagedLayout` says; token ``i`` lives at position ``i % block_size`` of block
  ``block_ids[i // block_size]`` (:class:`PagedKV`, :func:`write_blocks`, :func:`read_blocks`,
  :class:`PagedDestination`).

This is the bottom layer: it knows shapes, slots and blocks, not codecs.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

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


def check_shape(t: torch.Tensor) -> tuple[int, int, int]:
    """The (layers, kv_heads, head_dim) of a flat KV buffer; ``ValueError`` unless ``t`` is shaped like one."""
    if t.dim() != 5 or t.shape[1] != 2:
        raise ValueError(f"KV buffer must be [layers, 2, kv_heads, capacity, head_dim], got {tuple(t.shape)}")
    return t.shape[0], t.shape[2], t.shape[4]


@dataclass(frozen=True)
class ChunkRef:
    name: str  # object name in the store
    size: int  # object size as listed (a truncated object is caught before any decoding)
    start: int  # first token of the chunk in the prompt
    tokens: int


def slot_list(capacity: int, tokens: int, slots: Sequence[int] | None = None, offset: int = 0, first: int = 0) -> Sequence[int]:
    """The buffer slots of ``tokens`` tokens: ``slots[:tokens]``, or ``range(offset, offset + tokens)``.

    The contiguous case stays a ``range`` (no per-token list on the path that answers
    "recompute" without touching the store). ``offset`` may be negative: only the tokens from
    ``first`` on need slots (a window of a longer prompt: ``offset = -first`` puts token ``first``
    in slot 0). Raises ``ValueError`` for slots outside the buffer, too few slots or repeated slots.
    """
    if slots is None:
        if offset + min(max(first, 0), tokens) < 0 or offset + tokens > capacity:
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
    """Where a prompt's tokens live in a flat buffer: token ``i`` in slot ``slots[i]`` of ``buffer``.
    A fetch writes there, a store reads there (:meth:`read`).

    ``buffer`` is ``[layers, 2, kv_heads, capacity, head_dim]``; the slots are ``slots[:tokens]``
    or ``range(offset, offset + tokens)`` (:func:`slot_list`; with a negative offset, tokens before
    ``first_token`` have no slot: they are neither written nor read). A chunk's contiguous slots are
    written in place through :meth:`view` (no copy), scattered ones through :meth:`scatter`; every
    write ends with :meth:`finish`. ``handle`` is the buffer's IPC handle (:mod:`ipc`), which
    decode worker processes open to write into the same memory; they address a chunk by
    :meth:`where`.

    Tokens before ``first_token`` are never written (their slots may hold KV that others share): a
    chunk straddling it (:meth:`skip`) writes only its tail, by :meth:`scatter`, never by a worker.
    """

    def __init__(self, buffer: torch.Tensor, slots: Sequence[int] | None = None, offset: int = 0, tokens: int | None = None,
                 handle: dict | None = None, first_token: int = 0):
        self.shape, self.dtype, self.device = check_shape(buffer), buffer.dtype, buffer.device
        self.buffer = buffer
        self.handle = handle
        self.first_token = first_token
        if tokens is None:
            if slots is None:
                raise ValueError("give the destination's slots or its number of tokens")
            tokens = len(slots)
        self.slots = slot_list(buffer.shape[3], tokens, slots, offset, first_token)
        self.tokens = tokens

    def check(self, h, c: ChunkRef) -> None:
        """Refuse a chunk (``h``: its header's ``shape``, ``dtype`` and ``torch_dtype``) that does not
        fit: wrong geometry or dtype is :class:`GeometryMismatchError` (a miss here, not a bad object);
        tokens beyond the destination a ValueError."""
        L, H, D = self.shape
        if tuple(h.shape) != (L, 2, H, c.tokens, D) or h.torch_dtype != self.dtype:
            raise GeometryMismatchError(f"chunk {tuple(h.shape)} {h.dtype} does not fit a buffer of (layers, kv_heads, head_dim) "
                                        f"{self.shape} {dtype_name(self.dtype)}")
        if c.start + c.tokens > self.tokens:
            raise ValueError(f"no destination slots for tokens {c.start}..{c.start + c.tokens}")

    def skip(self, c: ChunkRef) -> int:
        """How many leading tokens of the chunk lie before ``first_token``: left as they are."""
        return min(max(self.first_token - c.start, 0), c.tokens)

    def where(self, c: ChunkRef) -> list[int]:
        """The chunk's place, as a decode worker's destination takes it: its slots (a whole chunk)."""
        self._whole(c)
        return list(self.slots[c.start : c.start + c.tokens])

    def _whole(self, c: ChunkRef) -> None:
        if self.skip(c):
            raise ValueError(f"chunk tokens {c.start}..{c.start + c.tokens} start before first_token {self.first_token}: only its tail is written")

    def view(self, c: ChunkRef) -> torch.Tensor | None:
        """The buffer view the chunk's slots form when they are contiguous and all written, else None (scatter)."""
        idx = self.slots[c.start : c.start + c.tokens]
        return self.buffer[:, :, :, idx[0] : idx[0] + len(idx)] if contiguous(idx) and not self.skip(c) else None

    def block_write(self, c: ChunkRef) -> BlockWrite | None:
        """The chunk's place as a kernel writes it without a temporary, where there is no
        :meth:`view` (paged blocks); None here: a flat buffer's scattered slots take :meth:`scatter`."""
        return None

    def scatter(self, c: ChunkRef, kv: torch.Tensor) -> None:
        """Write the chunk's KV ``[layers, 2, kv_heads, tokens, head_dim]`` into its slots, wherever
        they are (those of tokens from ``first_token`` on)."""
        s = self.skip(c)
        idx = torch.tensor(self.slots[c.start + s : c.start + c.tokens], device=self.device)
        self.buffer.index_copy_(3, idx, kv[:, :, :, s:].to(self.device, non_blocking=True))

    def read(self, start: int, tokens: int) -> torch.Tensor:
        """A private host copy of the KV ``[layers, 2, kv_heads, tokens, head_dim]`` of tokens
        ``start .. start + tokens`` (none before ``first_token``: they may have no slot). Read in
        pieces of at most :data:`READ_PIECE_BYTES`: a gather on the device never allocates more
        (the model's GPU has little to spare) and each piece is copied to the host as it is made."""
        if start < self.first_token:
            raise ValueError(f"tokens {start}.. start before first_token {self.first_token}: they are not in the buffer")
        L, H, D = self.shape
        out = torch.empty((L, 2, H, tokens, D), dtype=self.dtype)
        step = self._piece_tokens()
        for a in range(0, tokens, step):
            b = min(tokens, a + step)
            self._read_piece(start + a, b - a, out[:, :, :, a:b])
        return out

    def _piece_tokens(self) -> int:
        """Tokens one piece of a :meth:`read` takes: whole :meth:`_grain` units, at least one."""
        L, H, D = self.shape
        grain = self._grain()
        return max(grain, READ_PIECE_BYTES // (L * 2 * H * D * bytes_per_value(self.dtype)) // grain * grain)

    def _grain(self) -> int:
        """The tokens a piece of a :meth:`read` is a multiple of."""
        return 1

    def _read_piece(self, start: int, tokens: int, out: torch.Tensor) -> None:
        """Copy the KV of tokens ``start .. start + tokens`` into ``out`` (host): from a view where
        their slots are contiguous, else from a gathered copy."""
        idx = self.slots[start : start + tokens]
        if contiguous(idx):
            to_host(self.buffer[:, :, :, idx[0] : idx[0] + tokens], out)
        else:
            to_host(self.buffer.index_select(3, torch.tensor(idx, device=self.device)), out)

    def finish(self) -> None:
        """Wait until the writes queued on the GPU are done: the model (another process) reads the
        buffer once the fetch answers."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def write_kv(self, c: ChunkRef, kv: torch.Tensor) -> None:
        """Copy a verified chunk ``[layers, 2, kv_heads, tokens, head_dim]`` (host memory, or already
        on the device) into its place. On a GPU the copy is non-blocking from pinned memory and
        waited for, so the chunk is in the buffer when this returns and the host memory may be reused.

        It runs on the calling thread's current stream (the fetch's write threads have their own;
        :func:`kvfetcher.chunk.thread_stream`)."""
        view = self.view(c)
        if view is not None:
            view.copy_(kv, non_blocking=True)
        else:
            self.scatter(c, kv)
        self.finish()


def to_host(src: torch.Tensor, out: torch.Tensor) -> None:
    """Copy ``src`` into the host tensor ``out`` (the same shape); from a GPU through page-locked
    memory (torch's host allocator keeps it for the next piece): the copy engine at full rate, then a
    host copy, far faster than a copy into pageable memory (``benchmarks/store_rate``)."""
    if src.device.type != "cuda":
        out.copy_(src)
        return
    stage = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    stage.copy_(src)  # (blocking)
    out.copy_(stage)


def to_device(src: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor ``src`` on ``device``; to a GPU through page-locked memory, queued on the
    current stream and not waited for (a copy from pageable memory would wait for the work queued
    before it)."""
    if device.type != "cuda":
        return src.to(device)
    return src.pin_memory().to(device, non_blocking=True)


# --- stored objects for the engine to decode -----------------------------------------------------

#: a store's copy out of a buffer (:meth:`Destination.read`) gathers at most this much on the device at once
READ_PIECE_BYTES = 64 << 20
#: an object's place in an :class:`ObjectArena` starts at a multiple of this (aligned reads of its parts)
ARENA_ALIGN = 64


class ObjectArena:
    """A registered host buffer (``buffer``, any shape: its bytes) that holds verified stored
    objects, whole, for the engine to decode itself (engine-decode mode) instead of KV. The chunks
    given are placed back to back in order (:meth:`place`: as many leading ones as fit), each at a
    multiple of :data:`ARENA_ALIGN`; :meth:`put` writes one there, once every part of it verified.
    ``shape`` and ``dtype`` are the KV geometry the objects must fit (:meth:`check`)."""

    handle = None  # decode workers never write here
    device = torch.device("cpu")

    def __init__(self, buffer: torch.Tensor, shape: tuple[int, int, int]):
        self.bytes = buffer.view(-1).view(torch.uint8)
        self.shape, self.dtype = shape, buffer.dtype
        self.offsets: dict[int, int] = {}  # a placed chunk's first token -> its offset

    def place(self, chunks: Sequence[ChunkRef]) -> int:
        """Place the leading ``chunks`` that fit (by their listed sizes); how many."""
        at = 0
        for n, c in enumerate(chunks):
            if at + c.size > self.bytes.numel():
                return n
            self.offsets[c.start] = at
            at += -(-c.size // ARENA_ALIGN) * ARENA_ALIGN
        return len(chunks)

    def check(self, h, c: ChunkRef) -> None:
        """Refuse a chunk that does not fit the KV geometry (as :meth:`Destination.check`) or was not placed."""
        L, H, D = self.shape
        if tuple(h.shape) != (L, 2, H, c.tokens, D) or h.torch_dtype != self.dtype:
            raise GeometryMismatchError(f"chunk {tuple(h.shape)} {h.dtype} does not fit a buffer of (layers, kv_heads, head_dim) "
                                        f"{self.shape} {dtype_name(self.dtype)}")
        if c.start not in self.offsets:
            raise ValueError(f"chunk at token {c.start} has no place in the buffer")

    def put(self, c: ChunkRef, header: bytes, payload: torch.Tensor) -> int:
        """Write a verified object (its header bytes, then its payload) at the chunk's place; its size."""
        a, n = self.offsets[c.start], len(header)
        self.bytes[a : a + n].numpy()[:] = memoryview(header).cast("B")
        self.bytes[a + n : a + n + payload.numel()].copy_(payload)
        return n + payload.numel()

    def where(self, c: ChunkRef) -> tuple[int, int]:
        """(offset, size) of a placed chunk's object."""
        return self.offsets[c.start], c.size


# --- paged KV ---------------------------------------------------------------------------------

_LETTERS = "LKBTHD"
_CANONICAL = "LKHBTD"  # the order PagedKV views its tensors in: [layers, 2, kv_heads, blocks, block_size, head_dim]


@dataclass(frozen=True)
class PagedLayout:
    """How one registered tensor holds KV in blocks. ``dims`` names its axes in order: L (layer),
    K (0 key, 1 value), B (block), T (token in block), H (kv head), D (head dim), each once, L
    optional; letters in parentheses are one axis holding them flattened, outer first, with at
    most one of L, B, H, D among them (``(KD)``: ``2 * head_dim`` values, the keys' then the
    values'). Without L a tensor holds one layer and a registration lists one per layer, in layer
    order; with L one tensor holds them all. Strides are the tensor's own (NHD or HND alike).

    vLLM's tensors: FlashAttention's per-layer cache (0.26 and 0.32, ``register_kv_caches``) is
    ``(blocks, kv_heads, block_size, 2 * head_dim)``: ``BHT(KD)``; its cross-layer cache (0.26,
    ``register_cross_layers_kv_cache``) ``(blocks, layers, block_size, kv_heads, 2 * head_dim)``:
    ``BLTH(KD)``, or with the HND layout ``(blocks, kv_heads, layers, block_size, 2 * head_dim)``:
    ``BHLT(KD)``. The CPU backend's ``(blocks, kv_heads, block_size, 2 * head_dim)`` holds per
    block and head all keys, then all values: register its view ``(blocks, kv_heads, 2,
    block_size, head_dim)``, ``BHKTD``.
    """

    dims: str = field(metadata={"doc": "the registered tensor's axes in order: L (layer; absent: one tensor per layer), K (key or "
                                       "value), B (block), T (token in block), H (KV head), D (head dim); `(KD)`: one axis of "
                                       "both flattened, e.g. vLLM FlashAttention's `BHT(KD)`"})
    block_size: int = field(metadata={"doc": "tokens per block; must divide the sidecar's chunk tokens"})

    def __post_init__(self):
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, not {self.block_size!r}")
        self.axes  # noqa: B018  (parses dims, raising for bad ones)

    @functools.cached_property
    def axes(self) -> tuple[str, ...]:
        """The letters of each axis, outer first: ``BHT(KD)`` -> ``("B", "H", "T", "KD")``."""
        if not isinstance(self.dims, str) or not re.fullmatch(rf"(?:[{_LETTERS}]|\([{_LETTERS}]{{2,}}\))+", self.dims):
            raise ValueError(f"paged dims {self.dims!r}: use the letters {_LETTERS}, a group of two or more in parentheses")
        axes = tuple(group or letter for group, letter in re.findall(rf"\(([{_LETTERS}]+)\)|([{_LETTERS}])", self.dims))
        letters = "".join(axes)
        if sorted(letters) not in (sorted(_LETTERS), sorted(_LETTERS[1:])):
            raise ValueError(f"paged dims {self.dims!r} must name K, B, T, H and D once each, and L at most once")
        if any(sum(c in "LBHD" for c in a) > 1 for a in axes):
            raise ValueError(f"paged dims {self.dims!r}: a group may hold at most one of L, B, H, D (the others' sizes are known)")
        return axes

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` viewed as ``[layers, 2, kv_heads, blocks, block_size, head_dim]`` (layers 1 without
        L): the same memory, no copy. ``ValueError`` if its shape does not fit the dims."""
        known = {"K": 2, "T": self.block_size}
        if t.dim() != len(self.axes):
            raise ValueError(f"a tensor of paged dims {self.dims!r} has {len(self.axes)} axes, not shape {tuple(t.shape)}")
        sizes = []
        for axis, n in zip(self.axes, t.shape):
            fixed = math.prod(known.get(c, 1) for c in axis)
            split = [known.get(c, n // fixed) for c in axis]
            if math.prod(split) != n or n == 0:
                raise ValueError(f"tensor shape {tuple(t.shape)} does not fit paged dims {self.dims!r} with block_size "
                                 f"{self.block_size} (K has 2 entries, T block_size)")
            sizes += split
        letters = "".join(self.axes)
        v = t.view(sizes).permute([letters.index(c) for c in _CANONICAL if c in letters])
        return v if "L" in letters else v.unsqueeze(0)


class PagedKV:
    """KV in paged blocks: ``tensors``, one holding every layer (L in the layout's dims) or one per
    layer in layer order, all of one shape, dtype and device, seen through ``layout``.

    ``shape`` is (layers, kv_heads, head_dim), ``blocks`` the number of blocks. :meth:`write` and
    :meth:`read` move whole blocks, given the ids :meth:`blocks_of` checked.
    """

    def __init__(self, tensors: torch.Tensor | Sequence[torch.Tensor], layout: PagedLayout):
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        if not tensors:
            raise ValueError("a paged buffer needs at least one tensor")
        if "L" in layout.dims and len(tensors) != 1:
            raise ValueError(f"paged dims {layout.dims!r} name one tensor holding every layer, not {len(tensors)}")
        views = [layout.view(t) for t in tensors]
        v0 = views[0]
        if any(v.shape != v0.shape or v.dtype != v0.dtype or v.device != v0.device for v in views):
            raise ValueError("the per-layer paged tensors differ in shape, dtype or device")
        dtype_name(v0.dtype)  # a supported KV dtype
        self.tensors, self.layout, self.views = tensors, layout, views
        _, _, H, self.blocks, _, D = v0.shape
        self.shape = (v0.shape[0] * len(views), H, D)
        self.dtype, self.device = v0.dtype, v0.device

    def blocks_of(self, block_ids: Sequence[int], first_token: int, tokens: int) -> list[int]:
        """The blocks of tokens ``first_token .. first_token + tokens`` of a prompt whose token ``i``
        is in block ``block_ids[i // block_size]``. ``ValueError``: not whole blocks, block ids out
        of range or repeated (any of those given), or too few of them."""
        bs = self.layout.block_size
        if first_token < 0 or first_token % bs or tokens % bs:
            raise ValueError(f"tokens {first_token}..{first_token + tokens} are not whole blocks of {bs} tokens")
        ids = [int(b) for b in block_ids]
        if ids and (min(ids) < 0 or max(ids) >= self.blocks):
            raise ValueError(f"block ids out of range for a paged buffer of {self.blocks} blocks")
        if len(set(ids)) != len(ids):
            raise ValueError("block ids must be distinct")
        a, b = first_token // bs, (first_token + tokens) // bs
        if len(ids) < b:
            raise ValueError(f"{len(ids)} block ids given for tokens up to {first_token + tokens} ({b} blocks of {bs} tokens)")
        return ids[a:b]

    def check(self, kv: torch.Tensor) -> None:
        """``ValueError`` unless ``kv`` is ``[layers, 2, kv_heads, tokens, head_dim]`` of this geometry and dtype."""
        L, H, D = self.shape
        if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4]) != (L, 2, H, D) or kv.dtype != self.dtype:
            raise ValueError(f"KV {tuple(kv.shape)} {kv.dtype} does not fit paged KV of (layers, kv_heads, head_dim) {self.shape} {self.dtype}")

    def write(self, blocks: Sequence[int], kv: torch.Tensor) -> None:
        """Write ``kv`` ``[layers, 2, kv_heads, len(blocks) * block_size, head_dim]`` into ``blocks``:
        one ``index_copy_`` per tensor, queued on the device's current stream."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        src = kv.to(self.device, non_blocking=True).unflatten(3, (len(blocks), self.layout.block_size))
        layer = 0
        for v in self.views:
            v.index_copy_(3, idx, src[layer : layer + v.shape[0]])
            layer += v.shape[0]

    def block_write(self, blocks: Sequence[int]) -> BlockWrite | None:
        """Where a chunk filling ``blocks`` goes, as a kernel addresses it (:class:`BlockWrite`); None
        where the tensors' views differ in strides or lie at offsets not whole values apart."""
        if self._layer_offsets is None:
            return None
        sb = self.views[0].stride(3)
        return BlockWrite(self, tuple(blocks), to_device(torch.tensor([b * sb for b in blocks], dtype=torch.int64), self.device))

    @functools.cached_property
    def _layer_offsets(self) -> torch.Tensor | None:
        """Each layer's element offset from the first view's data, on the device (made once)."""
        v0 = self.views[0]
        size = v0.element_size()
        if any(v.stride() != v0.stride() or (v.data_ptr() - v0.data_ptr()) % size for v in self.views):
            return None
        offsets = [(v.data_ptr() - v0.data_ptr()) // size + i * v.stride(0) for v in self.views for i in range(v.shape[0])]
        return torch.tensor(offsets, dtype=torch.int64, device=self.device)

    def read(self, blocks: Sequence[int]) -> torch.Tensor:
        """A new tensor ``[layers, 2, kv_heads, len(blocks) * block_size, head_dim]`` (on the
        buffer's device) of the KV in ``blocks``."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return torch.cat([v.index_select(3, idx) for v in self.views]).flatten(3, 4)

    def read_into(self, blocks: Sequence[int], out: torch.Tensor) -> None:
        """Copy the KV in ``blocks`` into ``out``, a host tensor ``[layers, 2, kv_heads, len(blocks) *
        block_size, head_dim]``. Where blocks are the tensors' outer axis (vLLM's), each run of
        consecutive blocks is one copy of whole blocks into page-locked memory, put in order on the
        host: on a GPU the copy engine moves them and no kernel runs beside the model's. Otherwise a
        gather on the device, then a copy."""
        if self.layout.axes[0] != "B":
            to_host(self.read(blocks), out)
            return
        cuda, runs = self.device.type == "cuda", block_runs(blocks)
        whole = []
        for t in self.tensors:
            host = torch.empty((len(blocks), *t.shape[1:]), dtype=t.dtype, pin_memory=cuda)
            for at, first, n in runs:
                host[at : at + n].copy_(t[first : first + n], non_blocking=cuda)
            whole.append(host)
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()
        layer, bs = 0, self.layout.block_size
        for host in whole:
            v = self.layout.view(host)
            out[layer : layer + v.shape[0]].unflatten(3, (len(blocks), bs)).copy_(v)
            layer += v.shape[0]


@dataclass(frozen=True)
class BlockWrite:
    """A chunk's place in ``block_ids`` of ``paged``, for a kernel that writes it there itself (no
    temporary): the value of (layer ``l``, key or value ``k``, head ``h``, token ``t``, channel
    ``d``) goes to element ``layers[l] + k * sk + h * sh + blocks[t // block_size] + (t % block_size)
    * st + d * sd`` of :attr:`base`'s memory, ``(sk, sh, st, sd)`` being :attr:`strides`;
    ``layers`` and ``blocks`` are int64 element offsets on the buffer's device (made by
    :meth:`PagedKV.block_write`). :meth:`write` is the same write from a tensor."""

    paged: PagedKV
    block_ids: tuple[int, ...]
    blocks: torch.Tensor

    @property
    def base(self) -> torch.Tensor:
        return self.paged.views[0]

    @property
    def layers(self) -> torch.Tensor:
        return self.paged._layer_offsets

    @property
    def strides(self) -> tuple[int, int, int, int]:
        _, sk, sh, _, st, sd = self.base.stride()
        return sk, sh, st, sd

    @property
    def block_size(self) -> int:
        return self.paged.layout.block_size

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """The chunk's ``[layers, 2, kv_heads, tokens, head_dim]``."""
        L, H, D = self.paged.shape
        return (L, 2, H, len(self.block_ids) * self.block_size, D)

    def write(self, kv: torch.Tensor) -> None:
        """Write ``kv`` of :attr:`shape` into the blocks (:meth:`PagedKV.write`)."""
        self.paged.write(self.block_ids, kv)


def block_runs(blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """``blocks`` as runs of consecutive ids: ``(position in blocks, first id, length)`` each."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(blocks):
        if runs and runs[-1][1] + runs[-1][2] == b:
            at, first, n = runs[-1]
            runs[-1] = (at, first, n + 1)
        else:
            runs.append((i, b, 1))
    return runs


def write_blocks(tensors: torch.Tensor | Sequence[torch.Tensor], layout: PagedLayout, block_ids: Sequence[int], kv: torch.Tensor,
                 first_token: int = 0) -> None:
    """Write ``kv`` ``[layers, 2, kv_heads, T, head_dim]``, the KV of tokens ``first_token ..
    first_token + T`` of a prompt, into its blocks of ``tensors`` (:class:`PagedKV`). Everything
    is checked before the first write (``ValueError``); on a GPU the copy is queued, not waited for."""
    paged = PagedKV(tensors, layout)
    paged.check(kv)
    paged.write(paged.blocks_of(block_ids, first_token, kv.shape[3]), kv)


def read_blocks(tensors: torch.Tensor | Sequence[torch.Tensor], layout: PagedLayout, block_ids: Sequence[int], first_token: int,
                tokens: int) -> torch.Tensor:
    """The KV ``[layers, 2, kv_heads, tokens, head_dim]`` of tokens ``first_token .. first_token +
    tokens`` of a prompt, read from its blocks (a new tensor on the tensors' device)."""
    paged = PagedKV(tensors, layout)
    return paged.read(paged.blocks_of(block_ids, first_token, tokens))


class PagedDestination(Destination):
    """Where a prompt's tokens live in paged KV: token ``i`` at position ``i % block_size`` of block
    ``block_ids[i // block_size]`` of ``kv``; :class:`Destination`'s interface. Chunks are whole
    blocks; a decode worker addresses a chunk by its blocks (:meth:`where`). A chunk has no
    in-place view (its blocks are scattered): the fused unpack writes it into its blocks
    (:meth:`block_write`); other paths unpack it, then write it by one device-side scatter per tensor. ``first_token`` must be whole blocks: no block before it is written."""

    def __init__(self, kv: PagedKV, block_ids: Sequence[int], tokens: int, handle: dict | None = None, first_token: int = 0):
        self.kv, self.handle, self.tokens, self.first_token = kv, handle, tokens, first_token
        self.blocks = kv.blocks_of(block_ids, 0, tokens)
        if first_token % kv.layout.block_size:
            raise ValueError(f"first_token {first_token} is not whole blocks of {kv.layout.block_size} tokens")
        self.shape, self.dtype, self.device = kv.shape, kv.dtype, kv.device

    def check(self, h, c: ChunkRef) -> None:
        super().check(h, c)
        bs = self.kv.layout.block_size
        if c.start % bs or c.tokens % bs:
            raise ValueError(f"chunk tokens {c.start}..{c.start + c.tokens} are not whole blocks of {bs} tokens")

    def where(self, c: ChunkRef) -> list[int]:
        self._whole(c)
        return self._blocks(c.start, c.tokens)

    def _blocks(self, start: int, tokens: int) -> list[int]:
        bs = self.kv.layout.block_size
        return self.blocks[start // bs : (start + tokens) // bs]

    def view(self, c: ChunkRef) -> None:
        return None

    def block_write(self, c: ChunkRef) -> BlockWrite | None:
        return None if self.skip(c) else self.kv.block_write(self._blocks(c.start, c.tokens))

    def scatter(self, c: ChunkRef, kv: torch.Tensor) -> None:
        s = self.skip(c)
        self.kv.write(self._blocks(c.start + s, c.tokens - s), kv[:, :, :, s:])

    def _grain(self) -> int:
        return self.kv.layout.block_size

    def _read_piece(self, start: int, tokens: int, out: torch.Tensor) -> None:
        self.kv.read_into(self._blocks(start, tokens), out)


def destination(buffer: torch.Tensor | PagedKV, tokens: int, slots: Sequence[int] | None = None, offset: int = 0,
                block_ids: Sequence[int] | None = None, handle: dict | None = None, first_token: int = 0) -> Destination:
    """Where ``tokens`` tokens of a request live in ``buffer``: ``block_ids`` in paged KV, ``slots``
    or ``offset`` in a flat buffer; nothing before ``first_token`` is written. ``ValueError`` for
    addressing that does not fit the buffer."""
    if isinstance(buffer, PagedKV):
        if slots is not None or offset:
            raise ValueError("a paged buffer is addressed by block_ids, not slots or offset")
        if block_ids is None:
            raise ValueError("a paged buffer needs the request's block_ids")
        return PagedDestination(buffer, block_ids, tokens, handle, first_token)
    if block_ids is not None:
        raise ValueError("block_ids address a paged buffer; this one is flat: give slots or offset")
    return Destination(buffer, slots=slots, offset=offset, tokens=tokens, handle=handle, first_token=first_token)
