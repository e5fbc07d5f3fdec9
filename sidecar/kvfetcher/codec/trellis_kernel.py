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

import torch

from kvfetcher.codec.gpu_kernels import on_device, serves, tl, triton  # noqa: F401 (tl: the kernels' language)

#: components per program, and its warps (BLOCK / (32 WARPS) components a thread)
BLOCK = 128
WARPS = 4


def enabled(v: torch.Tensor) -> bool:
    """Whether to search ``v`` with the kernel (:func:`gpu_kernels.serves`); without, the torch search (CPU-only installs)."""
    return serves(v)


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
    def _value(raw, lo, step, NORM: tl.constexpr):
        """Loaded values as searched: ``x``, or with NORM ``(x - lo) / step - 128``."""
        x = raw.to(tl.float32)
        if NORM:
            x = tl.math.div_rn(x - lo, step) - 128.0
        return x

    @triton.jit
    def _forward(xp, sx_t, sp, T, C, live, lo, step, BLOCK: tl.constexpr, KMAX: tl.constexpr, NORM: tl.constexpr):
        """The search forward from state 0: token t's survivor bits at ``sp + t C`` (bit i set when
        state i's best edge is from set 1); returns the cheapest final state (the first on a tie)."""
        inf = float("inf")
        cost0 = tl.zeros([BLOCK], dtype=tl.float32)
        cost1 = tl.full([BLOCK], inf, tl.float32)
        cost2 = tl.full([BLOCK], inf, tl.float32)
        cost3 = tl.full([BLOCK], inf, tl.float32)
        # rows are loaded four tokens ahead of their use (past the last, the first again: unused),
        # so that each step's loads are in flight while the steps before them compute
        r0 = tl.load(xp, mask=live, other=0.0)
        r1 = tl.load(xp + (1 % T) * sx_t, mask=live, other=0.0)
        r2 = tl.load(xp + (2 % T) * sx_t, mask=live, other=0.0)
        r3 = tl.load(xp + (3 % T) * sx_t, mask=live, other=0.0)
        for t in range(T):
            r4 = tl.load(xp + ((t + 4) % T) * sx_t, mask=live, other=0.0)
            x = _value(r0, lo, step, NORM)
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
            r0 = r1
            r1 = r2
            r2 = r3
            r3 = r4
        s = tl.zeros([BLOCK], dtype=tl.int32)
        best = cost0
        s = tl.where(cost1 < best, 1, s)
        best = tl.minimum(best, cost1)
        s = tl.where(cost2 < best, 2, s)
        best = tl.minimum(best, cost2)
        return tl.where(cost3 < best, 3, s)

    @triton.jit
    def _backward(xp, sx_t, sp, op, so_t, T, C, live, lo, step, s, KMAX: tl.constexpr, NORM: tl.constexpr,
                  SAMPLES: tl.constexpr):
        """Back from final state ``s``: token t's index (or sample) stored at ``op + t so_t``."""
        # rows and survivor bits loaded four tokens ahead as forward (row (4T - 1 - i) % T is token
        # T - 1 - i, and before the first token the last ones again: unused)
        r0 = tl.load(xp + (T - 1) * sx_t, mask=live, other=0.0)
        r1 = tl.load(xp + ((4 * T - 2) % T) * sx_t, mask=live, other=0.0)
        r2 = tl.load(xp + ((4 * T - 3) % T) * sx_t, mask=live, other=0.0)
        r3 = tl.load(xp + ((4 * T - 4) % T) * sx_t, mask=live, other=0.0)
        u0 = tl.load(sp + (T - 1) * C, mask=live, other=0)
        u1 = tl.load(sp + ((4 * T - 2) % T) * C, mask=live, other=0)
        u2 = tl.load(sp + ((4 * T - 3) % T) * C, mask=live, other=0)
        u3 = tl.load(sp + ((4 * T - 4) % T) * C, mask=live, other=0)
        for i in range(T):
            t = T - 1 - i
            ahead = (4 * T - 5 - i) % T
            r4 = tl.load(xp + ahead * sx_t, mask=live, other=0.0)
            u4 = tl.load(sp + ahead * C, mask=live, other=0)
            x = _value(r0, lo, step, NORM)
            pick = (u0.to(tl.int32) >> s) & 1
            base, par = _split(x)
            # into state s = 2i + j: from 2j + pick under quantiser j, index parity i xor pick
            _e, k = _edge(x, base, par, s & 1, (s >> 1) ^ pick, KMAX)
            if SAMPLES:
                tl.store(op + t * so_t, (k.to(tl.int32) + 128).to(tl.uint8), mask=live)
            else:
                tl.store(op + t * so_t, k.to(tl.int16), mask=live)
            s = 2 * (s & 1) + pick
            r0 = r1
            r1 = r2
            r2 = r3
            r3 = r4
            u0 = u1
            u1 = u2
            u2 = u3
            u3 = u4

    @triton.jit
    def _search_kernel(x_ptr, lo_ptr, step_ptr, out_ptr, surv_ptr, T, C, B, nb,
                       sx_g, sx_t, sx_a, sx_b, so_g, so_t, so_a, so_b,
                       BLOCK: tl.constexpr, KMAX: tl.constexpr, NORM: tl.constexpr, SAMPLES: tl.constexpr):
        pid = tl.program_id(0)
        g = (pid // nb).to(tl.int64)
        c = (pid % nb) * BLOCK + tl.arange(0, BLOCK)  # component c = a * B + b
        live = c < C
        a = (c // B).to(tl.int64)
        b = (c % B).to(tl.int64)
        xp = x_ptr + g * sx_g + a * sx_a + b * sx_b
        lo = tl.load(lo_ptr + g * C + c, mask=live, other=0.0) if NORM else 0.0
        step = tl.load(step_ptr + g * C + c, mask=live, other=1.0) if NORM else 1.0
        sp = surv_ptr + g * T * C + c  # scratch [G, T, C] uint8
        s = _forward(xp, sx_t, sp, T, C, live, lo, step, BLOCK, KMAX, NORM)
        _backward(xp, sx_t, sp, out_ptr + g * so_g + a * so_a + b * so_b, so_t, T, C, live, lo, step, s, KMAX, NORM, SAMPLES)

def search(x: torch.Tensor, out: torch.Tensor, kmax: int, lo: torch.Tensor | None = None, step: torch.Tensor | None = None) -> torch.Tensor:
    """Write into ``out`` the trellis' indices of ``x`` (int16 ``out``), or with ``lo``/``step``
    the samples ``128 + k`` of the indices of ``(x - lo) / step - 128`` (uint8 ``out``), and
    return it. ``x``, ``out`` ``[G, T, A, B]`` (any float dtype and strides for ``x``, any
    strides for ``out``): the trellis along T from state 0, for every (g, a, b); ``lo``, ``step``
    ``[G, 1, A, B]`` float32."""
    g, t_len, a, b = x.shape
    if tuple(out.shape) != (g, t_len, a, b) or out.dtype != (torch.int16 if lo is None else torch.uint8):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not fit values {tuple(x.shape)}")
    if x.numel() == 0:
        return out
    surv = torch.empty((g, t_len, a * b), dtype=torch.uint8, device=x.device)
    norm = lo is not None
    lo, step = (lo.float().expand(g, 1, a, b).contiguous(), step.float().expand(g, 1, a, b).contiguous()) if norm else (x, x)
    nb = triton.cdiv(a * b, BLOCK)
    with on_device(x):
        _search_kernel[(g * nb,)](x, lo, step, out, surv, t_len, a * b, b, nb, *x.stride(), *out.stride(),
                                  BLOCK=BLOCK, KMAX=kmax, NORM=norm, SAMPLES=norm,
                                  num_warps=WARPS, enable_fp_fusion=False)
    return out
