"""layout: one chunk of KV <-> 8-bit video planes plus side information.

A chunk is a tensor ``[layers, 2, kv_heads, tokens, head_dim]`` (keys and values of every layer
for ``tokens`` consecutive tokens). Video codecs code 2-D planes of 8-bit samples and exploit
neighbours, so the layout decides what sits next to what:

* a **tile** is one ``(layer, k|v)`` slice as ``[tokens, kv_heads * head_dim]``: rows are tokens,
  columns are channels. Adjacent rows are adjacent tokens of the same channel, which is where
  KV is smooth (RoPE'd keys rotate slowly in most channels), so the codec's vertical prediction
  pays.
* tiles are stacked vertically into planes, and ``planes`` tiles side by side in the colour
  planes of one frame (``3`` = HEVC 4:4:4, three times the values per decoded frame on NVDEC;
  ``1`` = luma only).
* ``native`` is no video at all: the chunk's bytes exactly as the KV buffer holds them,
  ``[layers, 2, kv_heads, tokens, head_dim]`` in the KV dtype, one "frame" per layer (a row of
  bytes), so a run of frames is a run of layers. Restoring is one copy into the destination
  (the fetch pipeline's direct path: no decoder, no reshuffle); for the ``raw`` preset.
* ``exact`` splits each value into its bytes (high byte first) and codes them as separate tiles;
  quantised modes map each channel's range over the chunk's tokens onto ``2**bits`` levels.
  The first ``exact_tokens`` tokens of a chunk stay exact in the side information and out of
  the ranges: at position 0 that is the attention sink, whose outlier values would otherwise
  coarsen every step and whose own error changes greedy output.
* ``sigma_steps`` (rate control) replaces the ``2**bits`` levels over each channel's range by
  a step of ``s`` standard deviations of the channel, centred on its mean (level 128), with
  ``s`` chosen per layer and per keys/values. The lossless codec then spends roughly the
  entropy of the symbols, which a fixed step in sigma units sets directly, and the error
  lands where the model tolerates it (layers differ widely in how much error they tolerate).
  Side information keeps its form (offset, step per channel), so ``unpack`` is the same for both.
* ``basis`` (with ``sigma_steps``) codes each head's channels through a per-model linear
  transform minus its calibration mean (basis.py: the KLT in the metric the model sees errors
  in) and quantises every
  component of a (layer, k|v) with one step, ``s`` times the components' pooled standard
  deviation; ``unpack`` applies the inverse before RoPE. Side information keeps its form, now
  per component.
* ``trellis`` (with ``sigma_steps``) replaces uniform rounding by dependent (trellis-coded)
  quantisation along each component's tokens (trellis.py): the step is the grid ``D`` of the
  two alternating quantisers and symbols are ``128 + k`` for indices ``k``; side information
  keeps its form (the mean still sits at level 128). ``unpack`` recovers the quantiser of every
  index with one cumulative sum.
* ``sparse_tokens`` (with ``basis``) corrects, per (layer, KV head), the ``sparse_tokens`` body
  tokens of the chunk whose pre-RoPE keys are largest in the basis (``|enc k - mean|``, the rms
  logit the metric's queries give them: the attention-sink-like tokens, delimiters and the like,
  a rule on KV alone) in side information: their key and value rows' error after the video's
  quantisation, in integer units of ``sparse_step`` times the rows' step (int8), with the token
  indices (int16). ``unpack`` adds them back with one scatter before the inverse basis:
  these rows carry several times their share of the model's error.
* ``sort_components`` (with ``sigma_steps``; for the entropy formats) writes the samples
  component-major instead of as tiles: each (layer, k|v, head, component)'s tokens as one row,
  rows in the stable order of a class byte per component (``4 log2(1 + sd)`` of its body's
  samples, in side information). An entropy coder codes blocks alone from their own symbol
  counts; sorted, a block holds samples of one spread instead of a mixture of every
  component's, which costs fewer bits. ``unpack``'s torch path puts the rows back into tiles
  first; the fused kernel reads each component's row where the order puts it.

Pure torch, no I/O: the same code runs on CPU and on the GPU, and ``unpack`` can write straight
into a destination view of the model's KV buffers (with the fused kernel, into paged blocks too).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvfetcher.codec import basis as kvbasis
from kvfetcher.codec import fused_unpack, rope, tiling, trellis
from kvfetcher.codec.params import LAYOUT_VERSION, LOSSLESS_MODES, MIN_READABLE_LAYOUT, LayoutParams  # noqa: F401 (the header's record)
from kvfetcher.codec.tiling import Geometry, geometry
from kvfetcher.kvbuffer import BlockWrite, bytes_per_value, dtype_name

_INT_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


@dataclass
class Packed:
    """The layout's output: what the codec codes plus what it does not (side information)."""

    frames: torch.Tensor  # uint8 [frames, planes, height, width]
    side: torch.Tensor | None  # quant: flat, KV dtype; see side_numel / split_side
    geometry: Geometry


def _body_start(params: LayoutParams, tokens: int) -> int:
    """First token quantised as the body (the exact leading tokens are not, unless they are all)."""
    return params.exact_tokens if params.exact_tokens < tokens else 0


def sparse_count(shape: tuple[int, ...], params: LayoutParams) -> int:
    """Tokens corrected per (layer, KV head): ``sparse_tokens``, at most the body's tokens."""
    if params.mode in LOSSLESS_MODES or not params.sparse_tokens:
        return 0
    tokens = shape[3]
    return min(params.sparse_tokens, tokens - _body_start(params, tokens))


def _sparse_bytes(shape: tuple[int, ...], params: LayoutParams) -> int:
    layers, _, heads, _, head_dim = shape
    n = layers * heads * sparse_count(shape, params)
    return 2 * n + 2 * n * head_dim  # int16 token indices, int8 key and value rows


def _order_bytes(shape: tuple[int, ...], params: LayoutParams) -> int:
    layers, _, heads, _, head_dim = shape
    return layers * 2 * heads * head_dim if params.sort_components and params.mode not in LOSSLESS_MODES else 0


def _tail_bytes(shape: tuple[int, ...], params: LayoutParams) -> int:
    """Bytes after the values of side information: the sparse corrections, then the class bytes."""
    return _sparse_bytes(shape, params) + _order_bytes(shape, params)


def side_numel(shape: tuple[int, ...], params: LayoutParams, dtype: torch.dtype = torch.float16) -> int:
    """Values of side information (in the KV dtype): per-channel (offset, step), the exact
    leading tokens, then the sparse corrections' and the components' class bytes (padded to whole values)."""
    if params.mode in LOSSLESS_MODES:
        return 0
    layers, _, heads, tokens, head_dim = shape
    bpv = bytes_per_value(dtype)
    return layers * 2 * heads * head_dim * (2 + min(params.exact_tokens, tokens)) + -(-_tail_bytes(shape, params) // bpv)


def split_side(side: torch.Tensor, shape: tuple[int, ...], params: LayoutParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat side information -> (``[L, 2, H, D, 2]`` offset/step, ``[L, 2, H, e, D]`` exact tokens)."""
    layers, _, heads, tokens, head_dim = shape
    e = min(params.exact_tokens, tokens)
    n = layers * 2 * heads * head_dim * 2
    if side.numel() != side_numel(shape, params, side.dtype):
        raise ValueError(f"side information has {side.numel()} values, expected {side_numel(shape, params, side.dtype)}")
    m = n + layers * 2 * heads * e * head_dim
    return side[:n].view(layers, 2, heads, head_dim, 2), side[n:m].view(layers, 2, heads, e, head_dim)


def split_sparse(side: torch.Tensor, shape: tuple[int, ...], params: LayoutParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse corrections of flat side information: (``[L, H, k]`` int16 token indices,
    ``[L, 2, H, k, D]`` int8 rows in units of ``sparse_step`` steps)."""
    layers, _, heads, tokens, head_dim = shape
    k = sparse_count(shape, params)
    raw, a = _tail(side, shape, params)
    idx = raw[a : a + 2 * layers * heads * k].view(torch.int16).view(layers, heads, k)
    rows = raw[a + 2 * layers * heads * k : a + _sparse_bytes(shape, params)].view(torch.int8)
    return idx, rows.view(layers, 2, heads, k, head_dim)


def split_order(side: torch.Tensor, shape: tuple[int, ...], params: LayoutParams) -> torch.Tensor:
    """The components' class bytes of flat side information (``sort_components``): uint8 ``[L * 2 * H * D]``."""
    raw, a = _tail(side, shape, params)
    a += _sparse_bytes(shape, params)
    return raw[a : a + _order_bytes(shape, params)]


def _tail(side: torch.Tensor, shape: tuple[int, ...], params: LayoutParams) -> tuple[torch.Tensor, int]:
    """(side information's bytes, where its tail bytes start)."""
    size = side.element_size()
    return side.contiguous().view(torch.uint8), (side.numel() - -(-_tail_bytes(shape, params) // size)) * size


def component_order(classes: torch.Tensor) -> torch.Tensor:
    """Rows' order from the class bytes: a stable sort, so the same on every device."""
    return torch.sort(classes.to(torch.int32), stable=True).indices


def _sorted_frames(rows: torch.Tensor, geo: Geometry, b0: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``[L * 2 * H * D, T]`` (each component's tokens as a row) -> (frames holding the
    rows in class order; the class bytes)."""
    n, tokens = rows.shape
    sd = rows[:, b0:].float().std(dim=1, correction=0) if tokens - b0 > 1 else rows.new_zeros(n, dtype=torch.float32)
    classes = torch.round(4 * torch.log2(1 + sd)).clamp_(0, 255).to(torch.uint8)
    frames = torch.empty(geo.frame_shape, dtype=torch.uint8, device=rows.device)
    flat = frames.view(-1)
    flat[n * tokens :].zero_()
    torch.index_select(rows, 0, component_order(classes), out=flat[: n * tokens].view(n, tokens))
    return frames, classes


def _component_positions(classes: torch.Tensor) -> torch.Tensor:
    """Each component's row in the sorted frames (:func:`_sorted_frames`): int32 ``[L * 2 * H * D]``."""
    order = component_order(classes)
    return torch.empty(order.shape, dtype=torch.int32, device=order.device).scatter_(
        0, order, torch.arange(order.numel(), dtype=torch.int32, device=order.device))


def _tiles_of_sorted(frames: torch.Tensor, classes: torch.Tensor, shape: tuple[int, ...], geo: Geometry) -> torch.Tensor:
    """Inverse of :func:`_sorted_frames`: the same frames in the tiles' order."""
    layers, _, heads, tokens, head_dim = shape
    n = layers * 2 * heads * head_dim
    rows = torch.empty((n, tokens), dtype=torch.uint8, device=frames.device)
    rows[component_order(classes.to(frames.device))] = frames.reshape(-1)[: n * tokens].view(n, tokens)
    tiles = rows.view(layers, 2, heads, head_dim, tokens).permute(0, 1, 4, 2, 3).reshape(layers * 2, tokens, heads * head_dim)
    return tiling.tiles_to_frames(tiles, geo)


def levels(params: LayoutParams, layers: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Highest quantisation level per (layer, k|v): ``[layers, 2]`` float32. Made once per bits
    and device (a copy to the GPU waits for it): do not modify it."""
    if params.bits_map is None:
        bits = ((params.kv_bits or (params.bits, params.bits)),) * layers
    elif len(params.bits_map) != layers:
        raise ValueError(f"bits_map has {len(params.bits_map)} layers, the chunk {layers}")
    else:
        bits = params.bits_map
    return _levels(tuple(tuple(b) for b in bits), str(torch.device(device)))


@functools.lru_cache(maxsize=64)
def _levels(bits: tuple[tuple[int, int], ...], device: str) -> torch.Tensor:
    return ((1 << torch.tensor(bits)) - 1).to(device=device, dtype=torch.float32)


def sigma_profile(params: LayoutParams, layers: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Step in channel standard deviations per (layer, k|v): ``[layers, 2]`` float32.

    Entry ``i * N // layers`` of an N-entry profile serves layer ``i``: a profile calibrated on one
    model keeps its shape (sensitive first layers, tolerant middle) on a deeper or shallower one.
    Made once per profile, depth and device (a copy to the GPU waits for it): do not modify it.
    """
    if params.sigma_steps is None:
        raise ValueError("layout has no sigma_steps")
    return _profile(params.sigma_steps, layers, str(torch.device(device)))


@functools.lru_cache(maxsize=64)
def _profile(steps: tuple[tuple[float, float], ...], layers: int, device: str) -> torch.Tensor:
    prof = torch.tensor(steps, dtype=torch.float32, device=device)
    return prof[torch.arange(layers, device=device) * len(steps) // layers]


def _sigma_ranges(body: torch.Tensor, params: LayoutParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(offset, step) per channel: mean at level 128, step ``s * std`` widened so no value clips.
    With ``trellis`` the step is the grid of the two quantisers, whose points reach 254 steps.

    With a basis, std is pooled over a (layer, k|v)'s components: the transform has already
    weighted them by how much the model cares, so one step for all is the best allocation."""
    layers = body.shape[0]
    sd, mu = torch.std_mean(body, dim=3, correction=0)
    if params.basis is not None:
        sd = sd.square().mean(dim=(2, 3), keepdim=True).sqrt().expand_as(sd)
    steps = sigma_profile(params, layers, body.device).view(layers, 2, 1, 1)
    low, high = torch.aminmax(body, dim=3)
    reach = torch.maximum(high - mu, mu - low)
    # the farthest value must stay on the grid: 128 steps, 254 with trellis (indices reach 127,
    # reconstructions twice that), less headroom for the stored step's rounding
    step = torch.maximum(sd * steps, reach / (250 if params.trellis else 126))
    return torch.sub(mu, step, alpha=128), step


def _basis(params: LayoutParams, layers: int, heads: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    enc, dec, mean = kvbasis.on_device(params.basis, str(device))
    if tuple(enc.shape) != (layers, 2, heads, head_dim, head_dim):
        raise ValueError(f"basis {params.basis!r} is {tuple(enc.shape)}, the chunk has {layers} layers x {heads} heads x {head_dim}")
    return enc, dec, mean


def pack(kv: torch.Tensor, params: LayoutParams, start: int | torch.Tensor = 0) -> Packed:
    """Turn one chunk into uint8 frames (and side info for quantised modes).

    ``start`` is the position of the chunk's first token (an int, or a 0-dim tensor on ``kv``'s
    device: see :mod:`graphs`); it matters only for pre-RoPE keys. No host synchronisation: a
    CUDA graph can capture it.
    """
    if kv.dim() != 5:
        raise ValueError(f"KV chunk must have 5 dims [layers, 2, kv_heads, tokens, head_dim], got {tuple(kv.shape)}")
    dtype_name(kv.dtype)  # validates
    layers, _, heads, tokens, head_dim = kv.shape
    geo = geometry(tuple(kv.shape), kv.dtype, params)
    if params.mode == "native":
        return Packed(kv.contiguous().view(torch.uint8).reshape(geo.frame_shape), None, geo)
    if params.mode == "exact":
        # [layers, 2, tokens, heads*head_dim]: a tile per (layer, k|v, byte)
        tok_major = kv.permute(0, 1, 3, 2, 4).reshape(layers, 2, tokens, heads * head_dim)
        nbytes = bytes_per_value(kv.dtype)
        ints = tok_major.contiguous().view(_INT_VIEW[kv.dtype])
        planes = [((ints >> (8 * b)) & 0xFF).to(torch.uint8) for b in reversed(range(nbytes))]
        tiles = torch.stack(planes, dim=2)  # [layers, 2, bytes, tokens, C]
        return Packed(tiling.tiles_to_frames(tiles.reshape(-1, tokens, heads * head_dim), geo), None, geo)

    e = min(params.exact_tokens, tokens)
    x = kv.to(torch.float32, copy=True)  # never a view of the caller's tensor (fp32 KV)
    if params.rope_theta is not None:
        rope.apply_layers(x[:, 0], start, params.rope_theta, inverse=True, out=x[:, 0])
    if params.basis is not None:
        enc, _, mean = _basis(params, layers, heads, head_dim, kv.device)
        x = torch.einsum("lkhde,lkhte->lkhtd", enc, x).sub_(mean.unsqueeze(3))
    body = x[:, :, :, e:] if e < tokens else x
    if params.sigma_steps is not None:
        lo, scale = _sigma_ranges(body, params)
    else:
        lo = body.amin(dim=3)  # [layers, 2, heads, head_dim]
        hi = body.amax(dim=3)
        top = levels(params, layers, kv.device).view(layers, 2, 1, 1)
        scale = (hi - lo) / top
    ranges = torch.stack([lo, scale], dim=-1).to(kv.dtype)  # what the reader will use
    rf = ranges.float()
    lo_r, scale_r = rf[..., 0], rf[..., 1]
    safe = torch.where(scale_r > 0, scale_r, 1.0)
    b0 = _body_start(params, tokens)  # first row of the body
    # the samples [L, 2, H, T, D], written where the frames take them from: each component's tokens
    # as one row when the components are sorted, else in the tiles' order
    if params.sort_components:
        samples = torch.empty((layers, 2, heads, head_dim, tokens), dtype=torch.uint8, device=kv.device)
        q = samples.transpose(3, 4)
    else:
        samples = torch.empty((layers, 2, tokens, heads, head_dim), dtype=torch.uint8, device=kv.device)
        q = samples.permute(0, 1, 3, 2, 4)
    if params.trellis:  # indices along the body's tokens, from the trellis' start state
        g, body_t = layers * 2, tokens - b0
        trellis.samples(x[:, :, :, b0:].transpose(2, 3).reshape(g, body_t, heads, head_dim), lo_r.reshape(g, 1, heads, head_dim),
                        safe.view(g, 1, heads, head_dim), q[:, :, :, b0:].transpose(2, 3).reshape(g, body_t, heads, head_dim))
    else:
        u = torch.round((x - lo_r.unsqueeze(3)) / safe.unsqueeze(3)).clamp_(min=0)
        q.copy_(u.clamp_(max=255) if params.sigma_steps is not None else torch.minimum(u, top.unsqueeze(-1)))
    if b0:  # exact rows: repeat the first quantised row, cheapest for the codec
        q[:, :, :, :b0] = q[:, :, :, b0 : b0 + 1]
    tail = []
    ks = sparse_count(tuple(kv.shape), params)
    if ks:
        tail.append(_sparse_pack(x, q, lo_r, scale_r, params, b0, ks))
    if params.sort_components:
        frames, classes = _sorted_frames(samples.view(-1, tokens), geo, b0)
        tail.append(classes)
    else:
        frames = tiling.tiles_to_frames(samples.view(layers * 2, tokens, heads * head_dim), geo)
    parts = [ranges.reshape(-1), kv[:, :, :, :e].reshape(-1)]
    if tail:
        raw = torch.cat(tail)
        parts.append(torch.cat([raw, raw.new_zeros(-raw.numel() % bytes_per_value(kv.dtype))]).view(kv.dtype))
    return Packed(frames, torch.cat(parts), geo)


def _dequantise(t: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, params: LayoutParams, b0: int) -> torch.Tensor:
    """Samples ``[L, 2, T, C]`` (uint8) -> values ``[L, 2, T, C]`` float32 (rows before ``b0``: ``lo``)."""
    if not params.trellis:
        return t.float() * scale + lo
    vals = torch.empty(t.shape, device=t.device)
    k = t[:, :, b0:].to(torch.int16) - 128
    vals[:, :, b0:] = (trellis.dequantise(k, dim=2) + 128) * scale + lo
    vals[:, :, :b0] = lo  # exact tokens, replaced later
    return vals


def _sparse_pack(x: torch.Tensor, q: torch.Tensor, lo: torch.Tensor, scale: torch.Tensor, params: LayoutParams,
                 b0: int, ks: int) -> torch.Tensor:
    """The sparse corrections' bytes: per (layer, head) the ``ks`` body tokens of largest key norm
    in the basis (int16 indices, ascending) and their key and value rows' error, int8 in units of
    ``sparse_step`` times the component's step. ``x`` ``[L, 2, H, T, D]`` (basis, less its mean),
    ``q`` its samples, ``lo``/``scale`` ``[L, 2, H, D]`` as the reader will use them. Only the chosen
    rows are reconstructed, as :func:`unpack` reconstructs them."""
    layers, _, heads, tokens, head_dim = x.shape
    score = x[:, 0, :, b0:].square().sum(-1)  # [L, H, body]
    idx = score.topk(ks, dim=-1).indices.sort(dim=-1).values + b0  # [L, H, k]
    g = idx.view(layers, 1, heads, ks, 1).expand(layers, 2, heads, ks, head_dim)
    s = q.gather(3, g)
    lo, scale = lo.unsqueeze(3), scale.unsqueeze(3)
    if params.trellis:  # each index's quantiser follows from the parities of the body's indices before it
        q1 = trellis.quantiser_q1(q[:, :, :, b0:], dim=3).gather(3, g - b0)
        rec = (trellis.reconstruct(s.to(torch.int16) - 128, q1) + 128) * scale + lo
    else:
        rec = s.float() * scale + lo
    err = x.gather(3, g) - rec
    unit = scale * params.sparse_step
    r = torch.round(err / torch.where(unit > 0, unit, torch.ones_like(unit))).clamp_(-127, 127).to(torch.int8)
    return torch.cat([idx.to(torch.int16).reshape(-1).view(torch.uint8), r.reshape(-1).view(torch.uint8)])


def unpack(
    frames: torch.Tensor,
    side: torch.Tensor | None,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    params: LayoutParams,
    out: torch.Tensor | BlockWrite | None = None,
    start: int = 0,
) -> torch.Tensor | BlockWrite:
    """Exact inverse of :func:`pack`: frames (on any device) -> KV ``shape`` in ``dtype``.

    ``out``, if given, is written in place (a strided view into the model's KV buffers, or the
    paged blocks a :class:`BlockWrite` names) and returned; otherwise a new tensor on
    ``frames.device`` is returned.
    """
    layers, _, heads, tokens, head_dim = shape
    geo = geometry(tuple(shape), dtype, params)
    if tuple(frames.shape) != geo.frame_shape or frames.dtype != torch.uint8:
        raise ValueError(f"frames {tuple(frames.shape)} {frames.dtype} do not match layout {geo.frame_shape} uint8")
    if params.mode == "native":
        return _restore(frames.contiguous().view(dtype).view(tuple(shape)), shape, dtype, out)
    # the kernel takes one rotation table: layers with their own RoPE bases take the torch path
    if params.mode == "quant" and side is not None and fused_unpack.enabled(frames) and fused_unpack.supports(head_dim, tokens) \
            and not isinstance(params.rope_theta, tuple):
        # (the side information reaches the frames' device once: ranges, exact rows, corrections and order all read it)
        return _unpack_fused(frames, side.to(frames.device), tuple(shape), dtype, params, geo, out, start)
    if params.sort_components and side is not None:
        frames = _tiles_of_sorted(frames, split_order(side, shape, params), shape, geo)
    tiles = tiling.frames_to_tiles(frames, geo, tokens, heads * head_dim)
    if params.mode == "exact":
        nbytes = bytes_per_value(dtype)
        idt = _INT_VIEW[dtype]
        t = tiles.reshape(layers, 2, nbytes, tokens, heads * head_dim).to(idt)
        ints = torch.zeros((layers, 2, tokens, heads * head_dim), dtype=idt, device=frames.device)
        for i, b in enumerate(reversed(range(nbytes))):
            ints |= t[:, :, i] << (8 * b)
        vals = ints.view(dtype)
    else:
        if side is None:
            raise ValueError("quantised layout needs side information")
        side = side.to(frames.device)  # once: the ranges, exact rows and sparse corrections all read it
        ranges, exact = split_side(side, shape, params)
        lo = ranges[..., 0].float().reshape(layers, 2, 1, heads * head_dim)
        scale = ranges[..., 1].float().reshape(layers, 2, 1, heads * head_dim)
        t = tiles.reshape(layers, 2, tokens, heads * head_dim)
        vals = _dequantise(t, lo, scale, params, _body_start(params, tokens))
        ks = sparse_count(tuple(shape), params)
        if ks:  # add the corrections of the sparse rows: one scatter
            idx, rows = split_sparse(side, shape, params)
            g = idx.long().permute(0, 2, 1).view(layers, 1, ks, heads, 1).expand(layers, 2, ks, heads, head_dim)
            unit = scale.view(layers, 2, 1, heads, head_dim) * params.sparse_step
            src = rows.permute(0, 1, 3, 2, 4).float() * unit  # [L, 2, k, H, D]
            vals.view(layers, 2, tokens, heads, head_dim).scatter_add_(2, g, src)
        if params.basis is not None:
            _, dec, mean = _basis(params, layers, heads, head_dim, frames.device)
            y = vals.view(layers, 2, tokens, heads, head_dim) + mean.unsqueeze(2)
            vals = torch.einsum("lkhde,lkthe->lkthd", dec, y).reshape(layers, 2, tokens, heads * head_dim)
        if params.rope_theta is not None:
            k = vals[:, 0].view(layers, tokens, heads, head_dim).transpose(1, 2)
            vals[:, 0] = rope.apply_layers(k, start, params.rope_theta).transpose(1, 2).reshape(layers, tokens, heads * head_dim)
        vals = vals.to(dtype)
        e = exact.shape[3]
        if e:
            vals[:, :, :e] = exact.permute(0, 1, 3, 2, 4).reshape(layers, 2, e, heads * head_dim).to(dtype)
    return _restore(vals.view(layers, 2, tokens, heads, head_dim).permute(0, 1, 3, 2, 4), shape, dtype, out)


def _unpack_fused(frames: torch.Tensor, side: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, params: LayoutParams,
                  geo: Geometry, out: torch.Tensor | BlockWrite | None, start: int) -> torch.Tensor | BlockWrite:
    """The quant branch of :func:`unpack` as one kernel (fused_unpack.py), written into ``out``."""
    layers, _, heads, tokens, head_dim = shape
    _check_destination(out, shape, dtype)
    ranges, exact = split_side(side, shape, params)
    if isinstance(out, BlockWrite) and exact.shape[3]:  # a prefix's first chunk: its exact rows via a temporary
        out.write(_unpack_fused(frames, side, shape, dtype, params, geo, None, start))
        return out
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=frames.device)
    cs = rope.rotation(start, tokens, head_dim, params.rope_theta, frames.device) if params.rope_theta is not None else None
    basis = _basis(params, layers, heads, head_dim, frames.device)[1:] if params.basis is not None else None
    sparse = (*split_sparse(side, shape, params), params.sparse_step) if sparse_count(shape, params) else None
    positions = _component_positions(split_order(side, shape, params)) if params.sort_components else None
    fused_unpack.unpack_into(out, frames, ranges[..., 0].float(), ranges[..., 1].float(), geo, _body_start(params, tokens),
                             params.trellis, cs, basis, sparse, positions)
    if exact.shape[3]:
        out[:, :, :, : exact.shape[3]] = exact.to(dtype)
    return out


def _restore(result: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, out: torch.Tensor | BlockWrite | None) -> torch.Tensor | BlockWrite:
    """``result`` as a new contiguous tensor, or copied into ``out`` (checked against the chunk)."""
    if out is None:
        return result.contiguous()
    _check_destination(out, shape, dtype)
    if isinstance(out, BlockWrite):
        out.write(result)
    else:
        out.copy_(result)
    return out


def _check_destination(out: torch.Tensor | BlockWrite | None, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if out is None:
        return
    if isinstance(out, BlockWrite):
        if out.shape != tuple(shape) or out.base.dtype != dtype:
            raise ValueError(f"destination blocks {out.shape} {out.base.dtype} do not match chunk {tuple(shape)} {dtype}")
    elif tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"destination {tuple(out.shape)} {out.dtype} does not match chunk {tuple(shape)} {dtype}")
