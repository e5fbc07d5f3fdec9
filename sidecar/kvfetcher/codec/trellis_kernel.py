"""trellis_kernel: the trellis quantiser's Viterbi search (trellis.py) as one GPU kernel (Triton).

Why: the torch search steps all components together one token at a time, a few dozen small
kernels per token, so a chunk of 256 tokens costs thousands of launches; here each component's
search runs start to end inside one program. One program per block of ``BLOCK`` components (a
thread each) walks the tokens forward keeping the four states' costs in registers and writing one
byte of survivor bits per token (the edge that won into each state) to a scratch buffer, then
walks back from the cheapest final state, recomputing the winning edge's index from the value.

The result is bit-identical to trellis.py's torch search, which stays the CPU path and the
oracle: every float operation is the same correctly rounded one in the same order (floor, the
candidates' reconstructions, one subtraction and one square per candidate, one add per edge),
the comparisons are the same strict ones (first candidate and first state win ties), and no
multiply feeds an add the compiler could fuse. Finite inputs only: NaN or infinite values give
arbitrary indices on both paths.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch search serves
    triton = None

#: components per program (one a thread)
BLOCK = 128


def enabled(v: torch.Tensor) -> bool:
    """Whether to search ``v`` with the kernel: CUDA values (or any, under Triton's CPU
    interpreter, which the tests use), with Triton present."""
    return triton is not None and (v.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _edge(x, base, par, q, p, KMAX: tl.constexpr):
        """Best index of parity ``p`` (0/1) under quantiser ``q`` (0: Q0, 1: Q1) for values
        ``x`` and its squared error: the nearer of the two indices of that parity around
        ``x / 2``, clamped to the largest such index (the first on a tie)."""
        lim = (KMAX - 1 + p) * 1.0  # KMAX is odd: the largest even / odd index
        c0 = base + tl.where(par == p, 0.0, 1.0)  # base or base + 1, of parity p
        c1 = tl.where(par == p, c0 + 2.0, c0 - 2.0)
        c0 = tl.minimum(tl.maximum(c0, -lim), lim)
        c1 = tl.minimum(tl.maximum(c1, -lim), lim)
        qf = q * 1.0
        s0 = tl.where(c0 > 0, 1.0, tl.where(c0 < 0, -1.0, 0.0))
        s1 = tl.where(c1 > 0, 1.0, tl.where(c1 < 0, -1.0, 0.0))
        d0 = x - (2.0 * c0 - s0 * qf)
        d1 = x - (2.0 * c1 - s1 * qf)
        j0 = d0 * d0
        j1 = d1 * d1
        better = j1 < j0
        return tl.where(better, j1, j0), tl.where(better, c1, c0)

    @triton.jit
    def _split(x):
        """``floor(x / 2)`` and its parity (0.0/1.0); ``x`` clamped first where that changes
        neither any candidate after clamping nor float exactness."""
        xc = tl.minimum(tl.maximum(x, -1024.0), 1024.0)
        base = tl.floor(xc * 0.5)
        par = base - 2.0 * tl.floor(base * 0.5)
        return base, par

    @triton.jit
    def _quantise_kernel(v_ptr, k_ptr, surv_ptr, T, C, nb, sv_g, sv_t, sv_c, sk_g, sk_t, sk_c,
                         BLOCK: tl.constexpr, KMAX: tl.constexpr):
        pid = tl.program_id(0)
        g = (pid // nb).to(tl.int64)
        c = (pid % nb) * BLOCK + tl.arange(0, BLOCK)
        live = c < C
        vp = v_ptr + g * sv_g + c.to(tl.int64) * sv_c
        sp = surv_ptr + g * T * C + c  # scratch [G, T, C] uint8: bit i set when state i's best edge is from set 1
        inf = float("inf")
        cost0 = tl.zeros([BLOCK], dtype=tl.float32)
        cost1 = tl.full([BLOCK], inf, tl.float32)
        cost2 = tl.full([BLOCK], inf, tl.float32)
        cost3 = tl.full([BLOCK], inf, tl.float32)
        x = tl.load(vp, mask=live, other=0.0).to(tl.float32)
        for t in range(T):
            # the next token's values, loaded ahead (after the last, the first again: unused)
            nxt = tl.load(vp + ((t + 1) % T) * sv_t, mask=live, other=0.0).to(tl.float32)
            base, par = _split(x)
            e00, _k = _edge(x, base, par, 0, 0, KMAX)  # edge costs of (quantiser, parity)
            e01, _k = _edge(x, base, par, 0, 1, KMAX)
            e10, _k = _edge(x, base, par, 1, 0, KMAX)
            e11, _k = _edge(x, base, par, 1, 1, KMAX)
            # next state 2i + j comes from state 2j (edge set 0) or 2j + 1 (edge set 1)
            a0 = e00 + cost0
            b0 = e01 + cost1
            a1 = e10 + cost2
            b1 = e11 + cost3
            a2 = e01 + cost0
            b2 = e00 + cost1
            a3 = e11 + cost2
            b3 = e10 + cost3
            t0 = b0 < a0
            t1 = b1 < a1
            t2 = b2 < a2
            t3 = b3 < a3
            bits = t0.to(tl.int32) | (t1.to(tl.int32) << 1) | (t2.to(tl.int32) << 2) | (t3.to(tl.int32) << 3)
            tl.store(sp + t * C, bits.to(tl.uint8), mask=live)
            cost0 = tl.where(t0, b0, a0)
            cost1 = tl.where(t1, b1, a1)
            cost2 = tl.where(t2, b2, a2)
            cost3 = tl.where(t3, b3, a3)
            x = nxt
        # the cheapest final state, the first on a tie
        s = tl.zeros([BLOCK], dtype=tl.int32)
        best = cost0
        s = tl.where(cost1 < best, 1, s)
        best = tl.minimum(best, cost1)
        s = tl.where(cost2 < best, 2, s)
        best = tl.minimum(best, cost2)
        s = tl.where(cost3 < best, 3, s)
        kp = k_ptr + g * sk_g + c.to(tl.int64) * sk_c
        for i in range(T):
            t = T - 1 - i
            x = tl.load(vp + t * sv_t, mask=live, other=0.0).to(tl.float32)
            pick = (tl.load(sp + t * C, mask=live, other=0).to(tl.int32) >> s) & 1
            base, par = _split(x)
            # into state s = 2i + j: from 2j + pick under quantiser j, index parity i xor pick
            _e, k = _edge(x, base, par, s & 1, (s >> 1) ^ pick, KMAX)
            tl.store(kp + t * sk_t, k.to(tl.int16), mask=live)
            s = 2 * (s & 1) + pick


def quantise(v: torch.Tensor, kmax: int) -> torch.Tensor:
    """Indices ``[G, T, C]`` (int16) of values ``v`` ``[G, T, C]`` (any float dtype and strides),
    the trellis along ``T`` from state 0, as trellis.quantise."""
    g, t_len, c = v.shape
    out = torch.empty((g, t_len, c), dtype=torch.int16, device=v.device)
    if v.numel() == 0:
        return out
    surv = torch.empty((g, t_len, c), dtype=torch.uint8, device=v.device)
    nb = triton.cdiv(c, BLOCK)
    _quantise_kernel[(g * nb,)](v, out, surv, t_len, c, nb, *v.stride(), *out.stride(), BLOCK=BLOCK, KMAX=kmax,
                            enable_fp_fusion=False)
    return out
