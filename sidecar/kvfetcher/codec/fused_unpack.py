"""fused_unpack: the quantised layout's inverse as one GPU kernel (Triton), frames -> KV buffer.

Why: ``layout.unpack`` in torch runs about 30 elementwise passes over float32 copies of a chunk
(trellis parities and their prefix sums, reconstruction, scale and offset, sparse corrections,
basis, RoPE, cast, permuted copy into the buffer): ~4 GB of GPU memory traffic for a 33.5 MB
Llama-3-8B chunk, where reading the samples and writing the KV needs ~50 MB, all of it memory
bandwidth taken from the model decoding beside it. This kernel reads each sample once and
writes each value once, straight into the destination view (any strides) or into a serving
engine's paged blocks (a block table: no temporary chunk, no scatter after it).

One program per (layer, k|v, KV head) walks the chunk's tokens in blocks, reading samples from
their tiles or, for sorted components, from each component's row (a position table), carrying
the trellis' parity sums from block to block; each head's channels are handled as two halves, the pairs
RoPE rotates together. Sparse corrections are added before the basis, as in ``layout.unpack``;
the exact leading tokens are copied by the caller. Same arithmetic as the torch path in float32;
the results can differ in the last bit of the KV dtype where the compiler fuses a multiply-add.

It is the default for CUDA frames; ``KVFETCHER_FUSED_UNPACK=0`` turns it off. Without Triton
the torch path runs.
"""

from __future__ import annotations

import torch

from kvfetcher import config
from kvfetcher.codec.gpu_kernels import on_device, serves, tl, triton  # noqa: F401 (tl: the kernel's language)
from kvfetcher.kvbuffer import BlockWrite

#: tokens per block of a program (the trellis' prefix sums run within a block, carried across)
BLOCK_TOKENS = 32
#: warps per program with a basis: 8 leave room in registers for its four [D/2, D/2] blocks (the
#: measurements: benchmarks/transform/README.md); without one, Triton's default 4
BASIS_WARPS = 8
#: how the basis' matrix products are computed (Triton's ``input_precision``): "ieee" float32 FMAs,
#: "tf32x3" three TF32 tensor-core products (float32's accuracy, about), "tf32" one
DOT_PRECISION = "ieee"
#: load the basis' four blocks once per program rather than once per block of tokens
HOIST_BASIS = False


def enabled(frames: torch.Tensor) -> bool:
    """Whether to unpack ``frames`` with the kernel: CUDA frames (or any, under Triton's CPU
    interpreter, which the tests use), Triton present, and not switched off."""
    return config.FUSED_UNPACK.read() and serves(frames)


def supports(heads_dim: int, tokens: int) -> bool:
    """Shapes the kernel handles: a head size that is a power of two of at least 32 (halves of at
    least 16 for the basis' matrix products)."""
    return heads_dim >= 32 and heads_dim & (heads_dim - 1) == 0 and tokens > 0


if triton is not None:

    @triton.jit
    def _dequant_half(s, rows, b0, carry_e, carry_o, lo, sc, TRELLIS: tl.constexpr):
        """Samples ``[BT, D/2]`` -> values in the basis' frame; returns them and the carries."""
        if TRELLIS:
            body = (rows >= b0)[:, None]
            k = tl.where(body, s - 128, 0)
            par = k & 1
            even = (((rows - b0) % 2) == 0)[:, None]
            pe = tl.where(even, par, 0)
            po = tl.where(even, 0, par)
            e = tl.cumsum(pe, 0) + carry_e[None, :]  # parity sums at even / odd body positions
            o = tl.cumsum(po, 0) + carry_o[None, :]
            q1 = (tl.where(even, o, e) & 1).to(tl.float32)  # Q1 codes t when k[t-1] + k[t-3] + ... is odd
            kf = k.to(tl.float32)
            sign = tl.where(k > 0, 1.0, tl.where(k < 0, -1.0, 0.0))
            v = (2.0 * kf - sign * q1 + 128.0) * sc[None, :] + lo[None, :]
            v = tl.where(body, v, lo[None, :])
            carry_e += tl.sum(pe, 0)
            carry_o += tl.sum(po, 0)
        else:
            v = s.to(tl.float32) * sc[None, :] + lo[None, :]
        return v, carry_e, carry_o

    @triton.jit
    def _basis_blocks(m, c1, c2, sd, se):
        """dec^T's four [D/2, D/2] blocks: element (e, d) of dec^T is dec[d, e], at m + d * sd + e * se
        (``se`` 1 for a row-major dec, ``sd`` 1 for a column-major one: coalesced rows)."""
        t11 = tl.load(m + c1[None, :] * sd + c1[:, None] * se)
        t21 = tl.load(m + c1[None, :] * sd + c2[:, None] * se)
        t12 = tl.load(m + c2[None, :] * sd + c1[:, None] * se)
        t22 = tl.load(m + c2[None, :] * sd + c2[:, None] * se)
        return t11, t21, t12, t22

    # b0 is 1 in a prefix's first chunk (its exact sink token) and 0 in every other: Triton would
    # specialise on the 1 and compile a second variant inside the first fetch that reaches
    # position 0
    @triton.jit(do_not_specialize=["b0"])
    def _unpack_kernel(
        frames_ptr, lo_ptr, scale_ptr, cos_ptr, sin_ptr, dec_ptr, mean_ptr, sidx_ptr, srows_ptr, out_ptr, layers_ptr, blocks_ptr, pos_ptr,
        H, b0, sparse_step,
        tiles_per_frame, tiles_per_plane, tile_rows, frame_stride, plane_stride, row_stride,
        o_s0, o_s1, o_s2, o_s3, o_s4,
        T: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, TRELLIS: tl.constexpr, ROPE: tl.constexpr, BASIS: tl.constexpr,
        KS: tl.constexpr, PRECISION: tl.constexpr, HOIST: tl.constexpr, DEC_SD: tl.constexpr, DEC_SE: tl.constexpr,
        BS: tl.constexpr, SORTED: tl.constexpr,
    ):
        pid = tl.program_id(0)  # (layer * 2 + k|v) * H + head
        h = pid % H
        n = pid // H  # the tile: layer * 2 + k|v
        kv = n % 2
        layer = n // 2
        tile = (n // tiles_per_frame) * frame_stride + ((n % tiles_per_frame) // tiles_per_plane) * plane_stride \
            + (n % tiles_per_plane) * tile_rows * row_stride + h * D
        HALF: tl.constexpr = D // 2
        c1 = tl.arange(0, HALF)
        c2 = c1 + HALF
        lo1 = tl.load(lo_ptr + pid * D + c1)
        lo2 = tl.load(lo_ptr + pid * D + c2)
        sc1 = tl.load(scale_ptr + pid * D + c1)
        sc2 = tl.load(scale_ptr + pid * D + c2)
        ce1 = tl.zeros([HALF], dtype=tl.int32)
        co1 = tl.zeros([HALF], dtype=tl.int32)
        ce2 = tl.zeros([HALF], dtype=tl.int32)
        co2 = tl.zeros([HALF], dtype=tl.int32)
        # 64-bit: a 70B model's buffer holds more than 2**31 values (layer * its stride overflows 32 bits)
        if BS:  # paged blocks: each layer at its offset, each block of BS tokens at its own
            out = out_ptr + tl.load(layers_ptr + layer) + kv.to(tl.int64) * o_s1 + h.to(tl.int64) * o_s2
        else:
            out = out_ptr + layer.to(tl.int64) * o_s0 + kv.to(tl.int64) * o_s1 + h.to(tl.int64) * o_s2
        if SORTED:  # each component's tokens are one row of T samples, at its place in the class order
            at1 = frames_ptr + tl.load(pos_ptr + pid * D + c1).to(tl.int64) * T
            at2 = frames_ptr + tl.load(pos_ptr + pid * D + c2).to(tl.int64) * T
        if BASIS and HOIST:
            t11, t21, t12, t22 = _basis_blocks(dec_ptr + pid * D * D, c1, c2, DEC_SD, DEC_SE)
        for t0 in range(0, T, BT):
            rows = t0 + tl.arange(0, BT)
            live = (rows < T)[:, None]
            if SORTED:
                s1 = tl.load(at1[None, :] + rows[:, None], mask=live, other=128).to(tl.int32)
                s2 = tl.load(at2[None, :] + rows[:, None], mask=live, other=128).to(tl.int32)
            else:
                at = frames_ptr + tile + rows[:, None] * row_stride
                s1 = tl.load(at + c1[None, :], mask=live, other=128).to(tl.int32)
                s2 = tl.load(at + c2[None, :], mask=live, other=128).to(tl.int32)
            x1, ce1, co1 = _dequant_half(s1, rows, b0, ce1, co1, lo1, sc1, TRELLIS)
            x2, ce2, co2 = _dequant_half(s2, rows, b0, ce2, co2, lo2, sc2, TRELLIS)
            for j in tl.static_range(KS):  # sparse corrections: rows of this head's outlier tokens
                tok = tl.load(sidx_ptr + (layer * H + h) * KS + j)
                hit = (rows == tok)[:, None]
                fix1 = tl.load(srows_ptr + (pid * KS + j) * D + c1).to(tl.float32) * (sc1 * sparse_step)
                fix2 = tl.load(srows_ptr + (pid * KS + j) * D + c2).to(tl.float32) * (sc2 * sparse_step)
                x1 += tl.where(hit, fix1[None, :], 0.0)
                x2 += tl.where(hit, fix2[None, :], 0.0)
            if BASIS:  # values = dec @ (x + mean), per token; dec's halves as four [D/2, D/2] blocks
                y1 = x1 + tl.load(mean_ptr + pid * D + c1)[None, :]
                y2 = x2 + tl.load(mean_ptr + pid * D + c2)[None, :]
                if not HOIST:
                    t11, t21, t12, t22 = _basis_blocks(dec_ptr + pid * D * D, c1, c2, DEC_SD, DEC_SE)
                x1 = tl.dot(y1, t11, input_precision=PRECISION) + tl.dot(y2, t21, input_precision=PRECISION)
                x2 = tl.dot(y1, t12, input_precision=PRECISION) + tl.dot(y2, t22, input_precision=PRECISION)
            if ROPE:
                if kv == 0:  # keys were quantised before RoPE: rotate the pairs (d, d + D/2)
                    cs = cos_ptr + rows[:, None] * D
                    sn = sin_ptr + rows[:, None] * D
                    cos1 = tl.load(cs + c1[None, :], mask=live, other=1.0)
                    sin1 = tl.load(sn + c1[None, :], mask=live, other=0.0)
                    cos2 = tl.load(cs + c2[None, :], mask=live, other=1.0)
                    sin2 = tl.load(sn + c2[None, :], mask=live, other=0.0)
                    rot = x1 * cos1 - x2 * sin1
                    x2 = x2 * cos2 + x1 * sin2
                    x1 = rot
            if BS:
                block = tl.load(blocks_ptr + rows // BS, mask=rows < T, other=0)
                dst = out + (block + (rows % BS).to(tl.int64) * o_s3)[:, None]
            else:
                dst = out + rows[:, None].to(tl.int64) * o_s3
            ty = out_ptr.dtype.element_ty
            tl.store(dst + c1[None, :] * o_s4, x1.to(ty), mask=live)
            tl.store(dst + c2[None, :] * o_s4, x2.to(ty), mask=live)


def unpack_into(
    out: torch.Tensor | BlockWrite,
    frames: torch.Tensor,
    lo: torch.Tensor,
    scale: torch.Tensor,
    geo,
    b0: int,
    trellis: bool,
    rope_cs: tuple[torch.Tensor, torch.Tensor] | None = None,
    basis: tuple[torch.Tensor, torch.Tensor] | None = None,
    sparse: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor | BlockWrite:
    """Write the values of quantised ``frames`` into ``out`` ``[L, 2, H, T, D]`` (any strides), or
    into the paged blocks a :class:`~kvfetcher.kvbuffer.BlockWrite` names.

    ``lo``/``scale`` ``[L, 2, H, D]`` float32; ``geo`` the layout's Geometry; ``b0`` the body's
    first token; ``rope_cs`` (cos, sin) ``[T, D]`` float32 for pre-RoPE keys; ``basis`` (dec
    ``[L, 2, H, D, D]``, mean ``[L, 2, H, D]``) float32; ``sparse`` (token indices ``[L, H, k]``,
    int8 rows ``[L, 2, H, k, D]``, sparse_step); ``positions`` ``[L * 2 * H * D]`` int32 for frames
    whose components are sorted (each one's tokens a row of ``T`` samples, at the row it names),
    instead of ``geo``'s tiles. Exact leading tokens are left to the caller."""
    layers, _, heads, tokens, head_dim = out.shape
    if isinstance(out, BlockWrite):
        dst, offsets, strides, bs = out.base, (out.layers, out.blocks), (0, *out.strides), out.block_size
    else:
        dst, offsets, strides, bs = out, (lo, lo), out.stride(), 0
    f = frames.contiguous()
    lo = lo.contiguous()
    # a disabled step's pointers are never read (its code is compiled out): any tensor stands in,
    # rather than allocating (and launching a fill for) placeholders on every chunk
    cos, sin = rope_cs if rope_cs is not None else (lo, lo)
    dec, mean = basis if basis is not None else (lo, lo)
    if not (dec.is_contiguous() or dec.mT.is_contiguous()):  # each matrix at pid * D * D, either major order
        dec = dec.contiguous()
    if sparse is not None:
        sidx, srows, step = sparse[0].to(torch.int32).contiguous(), sparse[1].contiguous(), float(sparse[2])
        ks = sidx.shape[-1]
    else:
        sidx, srows, step, ks = f, f, 0.0, 0
    # Triton launches on the current device: make it the buffer's (cuda:1 in a rank-1 worker)
    with on_device(dst):
        _unpack_kernel[(layers * 2 * heads,)](
            f, lo, scale.contiguous(), cos.contiguous(), sin.contiguous(), dec, mean.contiguous(),
            sidx, srows, dst, *offsets, lo if positions is None else positions.contiguous(),
            heads, b0, step,
            geo.tiles_per_frame, geo.tiles_per_plane, geo.tile_rows, f.stride(0), f.stride(1), f.stride(2),
            *strides,
            T=tokens, D=head_dim, BT=BLOCK_TOKENS, TRELLIS=trellis, ROPE=rope_cs is not None, BASIS=basis is not None, KS=ks,
            PRECISION=DOT_PRECISION, HOIST=HOIST_BASIS, DEC_SD=dec.stride(-2), DEC_SE=dec.stride(-1), BS=bs, SORTED=positions is not None,
            num_warps=BASIS_WARPS if basis is not None else 4,
        )
    return out
