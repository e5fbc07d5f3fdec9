"""fused_pack: the front of ``layout.pack`` as one GPU kernel (Triton): KV -> values in the basis'
frame, and each component's statistics over the chunk's body.

Why: in torch the front is about a dozen passes over float32 copies of a chunk (the float copy,
RoPE undone on the keys, the basis' matrix product, its mean taken off, the statistics, the
minimum and maximum), each a kernel of its own. Here one program per (layer, k|v, KV head) reads
each value once, writes the projected values once, and reads them back once (from the cache) for
the spread about their mean.

Same arithmetic as the torch path in float32, but not the same order of operations (the matrix
products' sums, the mean's): values and statistics can differ in their last bits, so a sample can
land on the other side of a rounding boundary. Stored objects stay valid and as accurate; they are
not byte for byte those of the torch path. Without Triton the torch path runs.
"""

from __future__ import annotations

import torch

from kvfetcher.codec.gpu_kernels import on_device, serves, tl, triton  # noqa: F401 (tl: the kernel's language)

#: tokens per block of a program
BLOCK_TOKENS = 32
#: warps per program with a basis (its four [D/2, D/2] blocks, as fused_unpack), else Triton's default
BASIS_WARPS = 8


def enabled(kv: torch.Tensor) -> bool:
    """Whether to project ``kv`` with the kernel (:func:`gpu_kernels.serves`)."""
    return serves(kv)


def supports(head_dim: int, tokens: int) -> bool:
    """Shapes the kernel handles: a head size that is a power of two of at least 32, some tokens."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0 and tokens > 0


if triton is not None:

    @triton.jit
    def _basis_blocks(m, c1, c2, D: tl.constexpr):
        """enc^T's four [D/2, D/2] blocks: element (e, d) of enc^T is enc[d, e], at m + d * D + e."""
        t11 = tl.load(m + c1[None, :] * D + c1[:, None])
        t21 = tl.load(m + c1[None, :] * D + c2[:, None])
        t12 = tl.load(m + c2[None, :] * D + c1[:, None])
        t22 = tl.load(m + c2[None, :] * D + c2[:, None])
        return t11, t21, t12, t22

    @triton.jit(do_not_specialize=["b0"])
    def _project_kernel(
        kv_ptr, cos_ptr, sin_ptr, enc_ptr, mean_ptr, x_ptr, mu_ptr, var_ptr, low_ptr, high_ptr,
        b0, k_s0, k_s1, k_s2, k_s3, k_s4,
        H, T: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, ROPE: tl.constexpr, BASIS: tl.constexpr,
    ):
        pid = tl.program_id(0)  # (layer * 2 + k|v) * H + head
        h = pid % H
        n = pid // H
        kv = n % 2
        layer = n // 2
        HALF: tl.constexpr = D // 2
        c1 = tl.arange(0, HALF)
        c2 = c1 + HALF
        src = kv_ptr + layer.to(tl.int64) * k_s0 + kv.to(tl.int64) * k_s1 + h.to(tl.int64) * k_s2
        dst = x_ptr + pid.to(tl.int64) * T * D
        if BASIS:
            t11, t21, t12, t22 = _basis_blocks(enc_ptr + pid * D * D, c1, c2, D)
            m1 = tl.load(mean_ptr + pid * D + c1)
            m2 = tl.load(mean_ptr + pid * D + c2)
        sum1 = tl.zeros([HALF], dtype=tl.float32)
        sum2 = tl.zeros([HALF], dtype=tl.float32)
        low1 = tl.full([HALF], float("inf"), tl.float32)
        low2 = tl.full([HALF], float("inf"), tl.float32)
        high1 = tl.full([HALF], float("-inf"), tl.float32)
        high2 = tl.full([HALF], float("-inf"), tl.float32)
        for t0 in range(0, T, BT):
            rows = t0 + tl.arange(0, BT)
            live = (rows < T)[:, None]
            at = src + rows[:, None].to(tl.int64) * k_s3
            x1 = tl.load(at + c1[None, :] * k_s4, mask=live, other=0.0).to(tl.float32)
            x2 = tl.load(at + c2[None, :] * k_s4, mask=live, other=0.0).to(tl.float32)
            if ROPE:
                if kv == 0:  # keys before RoPE: the pairs (d, d + D/2) rotated back
                    cos1 = tl.load(cos_ptr + rows[:, None] * D + c1[None, :], mask=live, other=1.0)
                    sin1 = tl.load(sin_ptr + rows[:, None] * D + c1[None, :], mask=live, other=0.0)
                    cos2 = tl.load(cos_ptr + rows[:, None] * D + c2[None, :], mask=live, other=1.0)
                    sin2 = tl.load(sin_ptr + rows[:, None] * D + c2[None, :], mask=live, other=0.0)
                    rot = x1 * cos1 + x2 * sin1
                    x2 = x2 * cos2 - x1 * sin2
                    x1 = rot
            if BASIS:  # enc @ x per token, less the calibration's mean
                y1 = tl.dot(x1, t11, input_precision="ieee") + tl.dot(x2, t21, input_precision="ieee")
                y2 = tl.dot(x1, t12, input_precision="ieee") + tl.dot(x2, t22, input_precision="ieee")
                x1 = y1 - m1[None, :]
                x2 = y2 - m2[None, :]
            tl.store(dst + rows[:, None] * D + c1[None, :], x1, mask=live)
            tl.store(dst + rows[:, None] * D + c2[None, :], x2, mask=live)
            body = live & (rows >= b0)[:, None]
            sum1 += tl.sum(tl.where(body, x1, 0.0), 0)
            sum2 += tl.sum(tl.where(body, x2, 0.0), 0)
            low1 = tl.minimum(low1, tl.min(tl.where(body, x1, float("inf")), 0))
            low2 = tl.minimum(low2, tl.min(tl.where(body, x2, float("inf")), 0))
            high1 = tl.maximum(high1, tl.max(tl.where(body, x1, float("-inf")), 0))
            high2 = tl.maximum(high2, tl.max(tl.where(body, x2, float("-inf")), 0))
        count = T - b0
        mu1 = sum1 / count
        mu2 = sum2 / count
        sq1 = tl.zeros([HALF], dtype=tl.float32)
        sq2 = tl.zeros([HALF], dtype=tl.float32)
        tl.debug_barrier()  # the values stored above, read back by other threads of the program
        for t0 in range(0, T, BT):  # the spread about the mean, from the values just written
            rows = t0 + tl.arange(0, BT)
            body = ((rows < T) & (rows >= b0))[:, None]
            d1 = tl.load(dst + rows[:, None] * D + c1[None, :], mask=body, other=0.0) - mu1[None, :]
            d2 = tl.load(dst + rows[:, None] * D + c2[None, :], mask=body, other=0.0) - mu2[None, :]
            sq1 += tl.sum(tl.where(body, d1 * d1, 0.0), 0)
            sq2 += tl.sum(tl.where(body, d2 * d2, 0.0), 0)
        tl.store(mu_ptr + pid * D + c1, mu1)
        tl.store(mu_ptr + pid * D + c2, mu2)
        tl.store(var_ptr + pid * D + c1, sq1 / count)
        tl.store(var_ptr + pid * D + c2, sq2 / count)
        tl.store(low_ptr + pid * D + c1, low1)
        tl.store(low_ptr + pid * D + c2, low2)
        tl.store(high_ptr + pid * D + c1, high1)
        tl.store(high_ptr + pid * D + c2, high2)


def project(kv: torch.Tensor, b0: int, rope_cs: tuple[torch.Tensor, torch.Tensor] | None = None,
            basis: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """KV ``[L, 2, H, T, D]`` (any float dtype and strides) -> (values ``[L, 2, H, T, D]`` float32:
    keys with RoPE undone where ``rope_cs`` (cos, sin ``[T, D]`` float32) is given, then ``enc @ v -
    mean`` where ``basis`` (enc ``[L, 2, H, D, D]``, mean ``[L, 2, H, D]`` float32) is; and the
    statistics ``[L, 2, H, D]`` of each component over tokens ``b0 ..``: mean, variance (about the
    mean, no correction), minimum, maximum). ``b0`` must leave at least one token."""
    layers, _, heads, tokens, head_dim = kv.shape
    if not 0 <= b0 < tokens:
        raise ValueError(f"the body must have tokens: b0 {b0} of {tokens}")
    x = torch.empty(kv.shape, dtype=torch.float32, device=kv.device)
    mu, var, low, high = (torch.empty((layers, 2, heads, head_dim), dtype=torch.float32, device=kv.device) for _ in range(4))
    # a disabled step's pointers are never read (its code is compiled out): any tensor stands in
    cos, sin = (t.contiguous() for t in rope_cs) if rope_cs is not None else (mu, mu)
    enc, mean = (t.contiguous() for t in basis) if basis is not None else (mu, mu)
    with on_device(kv):
        _project_kernel[(layers * 2 * heads,)](
            kv, cos, sin, enc, mean, x, mu, var, low, high,
            b0, *kv.stride(),
            heads, T=tokens, D=head_dim, BT=BLOCK_TOKENS, ROPE=rope_cs is not None, BASIS=basis is not None,
            num_warps=BASIS_WARPS if basis is not None else 4,
        )
    return x, (mu, var, low, high)
