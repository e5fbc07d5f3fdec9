"""trellis: dependent (trellis-coded) quantisation along tokens: fewer bits at the same error.

A uniform scalar quantiser followed by an ideal entropy coder sits 1.53 dB (0.25 bit per value)
from the rate-distortion bound of a Gaussian source; trellis-coded quantisation recovers part of
it with a decoder that stays a table lookup. Two quantisers share a step ``D``: Q0 reconstructs
index ``k`` at ``2k D`` (even multiples), Q1 at ``(2k - sgn k) D`` (zero and odd multiples). Which
one codes a value is set by a 4-state machine driven by the parity of the previous indices (the
dependent quantisation of H.266/VVC). The two together form a grid of step ``D``, yet each
index chooses only among points ``2D`` apart, so indices are about half as wide; the encoder
picks the whole sequence by a Viterbi search over the states that minimises the squared error
alone: a rate term, which pulls indices toward zero like a dead zone, would shrink the small
components toward their mean, which the model notices more than the bits saved.

The state is linear over GF(2): with ``state = 2a + b`` and ``p`` the parity of an index,
``a' = b xor p`` and ``b' = a``, so ``a`` (Q1 in use) before index ``t`` is the parity of
``p[t-1] + p[t-3] + ...``. Dequantising is therefore one cumulative sum, no sequential loop: the
same vectorised torch code on CPU and GPU. Only the encoder loops over tokens.
"""

from __future__ import annotations

import math

import torch

from kvfetcher.codec import trellis_kernel

#: largest index magnitude: indices are stored as ``k + 128`` in 8-bit samples
KMAX = 127

# state = 2a + b; states 0, 1 use Q0, states 2, 3 use Q1. The two edges into next state
# 0, 1, 2, 3 come from states _FROM[0] with index parities (0, 0, 1, 1) and from states _FROM[1]
# with parities (1, 1, 0, 0): next state 2i + j from state 2j or 2j + 1.
_FROM = ((0, 2, 0, 2), (1, 3, 1, 3))
# (quantiser, parity) of each edge, as 2 * quantiser + parity, in the same order
_EDGE = ((0, 2, 1, 3), (1, 3, 0, 2))


def reconstruct(k: torch.Tensor, q1: torch.Tensor | bool) -> torch.Tensor:
    """Reconstruction in units of D (float32) of indices ``k`` under Q1 where ``q1``, else Q0."""
    k = k.float()
    return 2 * k - torch.sign(k) * (q1.float() if isinstance(q1, torch.Tensor) else float(q1))


def quantise(v: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Indices (int16, |k| <= KMAX, ``v``'s shape) for values ``v`` in units of D, centred on
    their mean; the trellis runs along ``dim`` from state 0. CUDA values are searched by the
    kernel (trellis_kernel.py), others by the torch search, with identical results."""
    dim = dim % v.dim()
    if not trellis_kernel.enabled(v):
        return _search(v.movedim(dim, -1)).movedim(-1, dim)
    g, t_len, c = math.prod(v.shape[:dim]), v.shape[dim], math.prod(v.shape[dim + 1:])
    x = v.reshape(g, t_len, c, 1)
    if c == 1:  # along the last dim: the rows are the components, side by side
        x = x.view(1, g, t_len, 1).transpose(1, 2)
    k = trellis_kernel.search(x, torch.empty(x.shape, dtype=torch.int16, device=v.device), KMAX)
    return (k.transpose(1, 2) if c == 1 else k).reshape(v.shape)


def samples(x: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write into ``out`` (uint8) the samples ``128 + k`` of the indices ``k`` of ``(x - lo) /
    step - 128`` (the layout's: the mean at level 128) and return it; ``x``, ``out`` ``[G, T, A,
    B]`` (any strides), the trellis along T; ``lo``, ``step`` ``[G, 1, A, B]``. One kernel on CUDA."""
    if trellis_kernel.enabled(x):
        return trellis_kernel.search(x, out, KMAX, lo, step)
    return out.copy_(quantise((x - lo) / step - 128, dim=1) + 128)


def _search(v: torch.Tensor) -> torch.Tensor:
    """The torch Viterbi search along the last dimension (CPU path and the kernel's oracle)."""
    shape, t_len = v.shape, v.shape[-1]
    v = v.reshape(-1, t_len).float()
    n = v.shape[0]
    if t_len == 0 or n == 0:
        return torch.zeros(shape, dtype=torch.int16, device=v.device)
    v = v.t().contiguous()  # [T, n]: the search walks the first dimension
    base = torch.floor(v / 2)
    lim = (KMAX - 1, KMAX)  # the largest even / odd index allowed (KMAX is odd)
    cost_e, idx_e = [], []  # best edge of each (quantiser, parity), as 2 * quantiser + parity
    for q1 in (False, True):
        for p in (0, 1):
            c0 = base + torch.remainder(p - base, 2)  # base or base + 1, of parity p
            c1 = torch.where(c0 == base, c0 + 2, c0 - 2)
            best_c, best_k = None, None
            for c in (c0.clamp(-lim[p], lim[p]), c1.clamp(-lim[p], lim[p])):
                j = (v - reconstruct(c, q1)).square()
                if best_c is None:
                    best_c, best_k = j, c
                else:
                    better = j < best_c
                    best_c, best_k = torch.where(better, j, best_c), torch.where(better, c, best_k)
            cost_e.append(best_c)
            idx_e.append(best_k.to(torch.int16))
    e0, e1 = (torch.stack([cost_e[i] for i in e], 1) for e in _EDGE)  # [T, 4 next states, n]
    k0, k1 = (torch.stack([idx_e[i] for i in e], 1) for e in _EDGE)
    from0, from1 = (torch.tensor(f, device=v.device) for f in _FROM)
    cost = torch.full((4, n), math.inf, device=v.device)
    cost[0] = 0
    took1 = torch.empty((t_len, 4, n), dtype=torch.bool, device=v.device)
    for t in range(t_len):
        # next state 2i + j comes from state 2j (edge set 0) or 2j + 1 (edge set 1)
        c = cost.view(2, 2, n)
        a = (e0[t].view(2, 2, n) + c[:, 0]).view(4, n)
        b = (e1[t].view(2, 2, n) + c[:, 1]).view(4, n)
        torch.lt(b, a, out=took1[t])
        cost = torch.minimum(a, b)
    state = cost.argmin(dim=0, keepdim=True)  # [1, n]
    out = torch.empty((t_len, n), dtype=torch.int16, device=v.device)
    for t in range(t_len - 1, -1, -1):
        pick = took1[t].gather(0, state)
        out[t] = torch.where(pick, k1[t].gather(0, state), k0[t].gather(0, state))[0]
        state = torch.where(pick, from1[state], from0[state])
    return out.t().reshape(shape)


def quantiser_q1(k: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Whether Q1 codes each index of ``k`` (bool, the trellis along ``dim``): the parity of
    k[t-1] + k[t-3] + ..."""
    dim = dim % k.dim()
    t_len = k.shape[dim]
    if t_len == 0:
        return torch.zeros(k.shape, dtype=torch.bool, device=k.device)
    p = (k & 1).to(torch.uint8)  # only the sums' parities matter: they survive uint8's wrap-around
    if t_len % 2:
        p = torch.cat([p, torch.zeros_like(p.narrow(dim, 0, 1))], dim)
    g = p.unflatten(dim, (-1, 2)).cumsum(dim=dim, dtype=torch.uint8).flatten(dim, dim + 1)  # sums over t, t-2, ...
    q1 = torch.zeros(k.shape, dtype=torch.bool, device=k.device)
    q1.narrow(dim, 1, t_len - 1).copy_(g.narrow(dim, 0, t_len - 1) & 1)
    return q1


def dequantise(k: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Reconstruction in units of D (float32) of indices ``k`` (any int dtype), the trellis
    along ``dim``."""
    return reconstruct(k, quantiser_q1(k, dim))
