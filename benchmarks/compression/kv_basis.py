"""Calibrate the shipped model's KV basis (kvfetcher/basis.py) and measure its coding gain.

Calibration windows are 512-token stretches of the shipped texts that do **not** overlap the
accuracy harness's prompts (accuracy.PROMPTS: prefix + continuation); dialogue and prose are
left out entirely, so the harness also measures the basis on kinds of text it never saw.

Per (layer, keys|values, KV head): the metric W (keys: the pre-RoPE queries of the group,
averaged over relative rotations; values: the output projection's columns), the channels'
covariance C (keys pre-RoPE, centred per 256-token chunk as the layout does), and the KLT of
W^1/2 C W^1/2. The high-rate gain over per-channel sigma steps is
``0.5 * log2(AM(w_c s_c^2) / GM(eigenvalues))`` bits per value; it is reported on the harness's
own prompts (held out) beside the diagonal-only gain (weights without rotation).

    python -m benchmarks.compression.kv_basis [--save]

Prints the gains (benchmarks/compression/kv_basis.txt holds a run); ``--save`` writes the basis to
sidecar/kvfetcher/data/bases/.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from kvfetcher.eval import accuracy, model
from kvfetcher.codec import basis, rope

#: (text, token offset) of the calibration windows, disjoint from accuracy.PROMPTS' windows.
CALIBRATION = [("license.txt", 600), ("code.txt", 600), ("code.txt", 3200), ("numbers.txt", 1000), ("numbers.txt", 10000)]
#: Relative offsets over which a key's metric averages its queries (a 512-token prefix).
DELTAS = list(range(0, 512, 8))
MODEL_TAG = "smollm2-135m"


@torch.inference_mode()
def capture(lm: model.LoadedModel, windows: list[tuple[str, int]], theta: float):
    """Per window: pre-RoPE keys and values ``[L, 2, H, T, D]`` (fp16-rounded, as stored) and the
    pre-RoPE queries of the last 128 positions ``[L, 128, q_heads, D]``."""
    cfg = lm.config
    d = cfg.hidden_size // cfg.num_attention_heads
    qs: dict[int, torch.Tensor] = {}
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda m, i, o, idx=idx: qs.__setitem__(idx, o[0]))
             for idx, layer in enumerate(lm.model.model.layers)]
    out = []
    try:
        for name, off in windows:
            ids, _ = accuracy.prompt_ids(lm, name, off, 512)
            kv = model.prefill(lm, ids)[0].half().float()
            cos, sin = rope.rotation(0, kv.shape[3], d, theta)
            kv[:, 0] = rope.apply(kv[:, 0], cos, sin, inverse=True)
            q = torch.stack([qs[i][-128:].reshape(128, -1, d) for i in range(len(qs))])
            out.append((kv, q))
    finally:
        for h in hooks:
            h.remove()
    return out


def attention_factors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o_proj: torch.Tensor, theta: float,
                      q_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """How far small errors move one layer's attention output, to first order.

    ``q`` pre-RoPE ``[Tq, q_heads, D]`` at positions ``q_start..``; ``k`` pre-RoPE and ``v``
    ``[kv_heads, T, D]`` from position 0. Returns per query ``sum_t a_t^2 |W_o (v_t - o)|^2``
    (``[Tq, q_heads]``: a logit error's effect) and per query head ``E[sum_t a_t^2]`` (a value
    error's). Heads that attend sharply or whose values barely differ matter less.
    """
    tq, nq, d = q.shape
    nkv, t, _ = k.shape
    g = nq // nkv
    cq, sq = rope.rotation(q_start, tq, d, theta)
    ck, sk = rope.rotation(0, t, d, theta)
    qr = rope.apply(q.double().transpose(0, 1), cq.double(), sq.double())  # [nq, Tq, D]
    kr = rope.apply(k.double(), ck.double(), sk.double()).repeat_interleave(g, 0)  # [nq, T, D]
    scores = qr @ kr.transpose(1, 2) / d**0.5
    pos = torch.arange(q_start, q_start + tq).view(tq, 1)
    scores = scores.masked_fill(torch.arange(t).view(1, t) > pos, float("-inf"))
    a = torch.softmax(scores, -1)  # [nq, Tq, T]
    wo = o_proj.detach().double().view(o_proj.shape[0], nq, d)  # [hidden, nq, D]
    pv = torch.einsum("htd,ohd->hto", v.double().repeat_interleave(g, 0), wo)  # [nq, T, hidden]
    po = a @ pv  # [nq, Tq, hidden]
    a2 = a.square()
    c = a2 @ pv.square().sum(-1, keepdim=True) - 2 * ((a2 @ pv) * po).sum(-1, keepdim=True) + a2.sum(-1, keepdim=True) * po.square().sum(-1, keepdim=True)
    return c.squeeze(-1).transpose(0, 1).clamp_min(0), a2.sum(-1).mean(-1)


def chunks(x: torch.Tensor) -> list[torch.Tensor]:
    """``[H, T, D]`` -> 256-token chunks without their first (exact) token."""
    return [x[:, s + 1 : s + 256] for s in range(0, x.shape[1], 256)]


def metrics(lm: model.LoadedModel, data, theta: float, attention: bool = False) -> torch.Tensor:
    """``[L, 2, H, D, D]`` metric per (layer, k|v, head), normalised per (layer, k|v); with
    ``attention``, queries and query heads weighed by attention_factors (tried: no better, see
    compression.md)."""
    cfg = lm.config
    L, H = cfg.num_hidden_layers, cfg.num_key_value_heads
    d = cfg.hidden_size // cfg.num_attention_heads
    out = torch.zeros(L, 2, H, d, d, dtype=torch.float64)
    for layer in range(L):
        wo = lm.model.model.layers[layer].self_attn.o_proj.weight
        kw, vw = None, None
        if attention:
            f = [attention_factors(q[layer], kv[layer, 0], kv[layer, 1], wo, theta, kv.shape[3] - q.shape[1]) for kv, q in data]
            kw, vw = [c for c, _ in f], sum(h for _, h in f) / len(f)
        out[layer, 0] = basis.normalise_heads(basis.key_metric([q[layer] for _, q in data], H, theta, DELTAS, kw))
        out[layer, 1] = basis.normalise_heads(basis.value_metric(wo, H, d, vw))
    return out


def gains(w: torch.Tensor, cov: torch.Tensor, enc: torch.Tensor) -> tuple[float, float, float]:
    """High-rate gains (bits/value) over sigma steps, one (layer, k|v): diagonal weights only,
    the basis ``enc``, and the oracle KLT of ``cov`` itself."""
    wd = w.diagonal(dim1=-2, dim2=-1)
    s2 = cov.diagonal(dim1=-2, dim2=-1)
    ws = (wd * s2).flatten()
    am = float(ws.mean())
    def gm(v: torch.Tensor) -> float:
        return float(v.clamp_min(1e-30).log().mean().exp())
    lam = (enc.double() @ cov @ enc.double().transpose(-1, -2)).diagonal(dim1=-2, dim2=-1).flatten()
    enc_or, _ = basis.transform(w, cov)
    lam_or = (enc_or @ cov @ enc_or.transpose(-1, -2)).diagonal(dim1=-2, dim2=-1).flatten()
    return 0.5 * math.log2(am / gm(ws)), 0.5 * math.log2(am / gm(lam)), 0.5 * math.log2(am / gm(lam_or))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--save", action="store_true")
    ap.add_argument("--ridge", type=float, default=1e-3)
    ap.add_argument("--attention", action="store_true", help="weigh queries/heads by attention_factors")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = model.load()
    theta = model.rope_theta(lm)
    cal = capture(lm, CALIBRATION, theta)
    w = metrics(lm, cal, theta, args.attention)
    L, _, H, d, _ = w.shape
    enc = torch.zeros(L, 2, H, d, d, dtype=torch.float64)
    for layer in range(L):
        for kind in (0, 1):
            cov = basis.covariance([c for kv, _ in cal for c in chunks(kv[layer, kind])])
            enc[layer, kind] = basis.transform(w[layer, kind], cov, args.ridge)[0]
    e32 = enc.float().half().float()  # as stored
    mean = torch.cat([torch.einsum("lkhde,lkhte->lkhtd", e32, kv) for kv, _ in cal], 3).mean(3)
    b = basis.build(MODEL_TAG, enc.float(), mean)
    held = capture(lm, accuracy.PROMPTS, theta)
    tot = torch.zeros(2, 3)
    print(f"basis {b.name}: calibrated on {CALIBRATION}; gains on the harness's prompts (held out), bits/value")
    for layer in range(L):
        row = []
        for kind in (0, 1):
            cov = basis.covariance([c for kv, _ in held for c in chunks(kv[layer, kind])])
            g = gains(w[layer, kind], cov, b.enc[layer, kind])
            tot[kind] += torch.tensor(g) / L
            row.append(f"{'KV'[kind]}: diag {g[0]:.2f} basis {g[1]:.2f} oracle {g[2]:.2f}")
        print(f"  layer {layer:2d}  " + "   ".join(row))
    for kind in (0, 1):
        print(f"  mean {'keys' if kind == 0 else 'values'}: diagonal weights {tot[kind, 0]:.2f}, basis {tot[kind, 1]:.2f}, oracle KLT {tot[kind, 2]:.2f}")
    if args.save:
        print("saved", basis.save(b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
