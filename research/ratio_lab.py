"""ratio_lab: quick rate/accuracy experiments on the transform family's ratio at the accuracy gate, on cached real KV (not the library).

Caches per (model, tokens) the accuracy suite's prompts' fp16 KV and reference logits (under
/tmp/ratio_lab), then scores a codec ``kv -> (restored kv, stored bytes)`` by teacher-forced top-1,
KL and NLL against them as kvfetcher.eval.accuracy does, and prints the gate. ``sim_codec`` is an
idealised transform coder (the model's basis, steps per layer from its calibration, optional step
multipliers per token, uniform rounding, rate = order-0 entropy per component); ``attention`` the
scored continuation's own attention (the oracle), ``probe_weights`` attention predicted from
calibration queries, ``joint_basis`` a KLT across KV heads. Findings: results/ratio_at_gate.md.

    import ratio_lab as L                      # PYTHONPATH=sidecar:.:research
    d = L.cases("smollm2", 256, 5)
    L.curve("smollm2", d, lambda f: L.sim_codec("smollm2", f), [1.3, 2.2, 3.5], "sim")
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.accuracy import accuracy_bench as ab
from benchmarks.accuracy import curves
from kvfetcher.eval import accuracy, metrics, model

CACHE = Path("/tmp/ratio_lab")
_LM = {}


def lm_of(key):
    if key not in _LM:
        _LM[key] = model.load(ab.FILES.get(key) or ab.MODELS[key]())
    return _LM[key]


def cases(key, tokens, prompts, cont=256):
    """[(case, kv fp16, ref logits)] cached on disk."""
    CACHE.mkdir(exist_ok=True)
    p = CACHE / f"{key}-{tokens}-{prompts}.pt"
    if p.exists():
        return torch.load(p, weights_only=False)
    lm = lm_of(key)
    cs = accuracy.suite_cases(lm, tokens, cont, 1)[:prompts] if tokens <= 256 else curves.long_cases(lm, tokens, cont, prompts)
    out = []
    for c in cs:
        kv = model.prefill(lm, c.ids)[0].to(torch.float16)
        out.append((c, kv, model.teacher_forced_logits(lm, c.ids, kv, c.cont)))
    torch.save(out, p)
    return out


def score(key, data, codec, label=""):
    lm = lm_of(key)
    rows = []
    t = time.time()
    for c, kv, ref in data:
        back, nbytes = codec(kv)
        logits = model.teacher_forced_logits(lm, c.ids, back.to(torch.float16), c.cont)
        nll_o, nll_r = metrics.nll(ref, c.cont), metrics.nll(logits, c.cont)
        rows.append((kv.numel() * 2 / nbytes, metrics.top1_agreement(ref, logits), float(metrics.kl(ref, logits).mean()),
                     100 * (nll_r - nll_o) / nll_o))
    med = [statistics.median(r[i] for r in rows) for i in range(4)]
    gate = med[1] >= 0.99 and med[3] <= 0.5
    print(f"{label:40s} ratio {med[0]:.2f}x top1 {med[1]:.4f} kl {med[2]:.5f} nll {med[3]:+.3f}% {'PASS' if gate else 'fail'}"
          f"  [{' '.join(f'{r[1]:.3f}' for r in rows)}] {time.time()-t:.0f}s", flush=True)
    return med + [gate]


# --- a simulated transform coder: per-token step multipliers, per-component entropy as the rate ---

from kvfetcher.codec import basis as kvbasis, rope  # noqa: E402
from kvfetcher.format import presets  # noqa: E402


def setup(key):
    """(enc, dec, mean, step profile [L, 2], theta) of the model's transform preset."""
    lm = lm_of(key)
    lp = presets.get("transform-zstd", lm.fingerprint).layout
    b = kvbasis.load(lp.basis)
    return b.enc, b.dec, b.mean, torch.tensor(lp.sigma_steps, dtype=torch.float32), lp.rope_theta or model.rope_theta(lm)


def entropy_bits(sym: torch.Tensor, dim: int) -> float:
    """Sum over rows of (row length x order-0 entropy) of integer symbols along ``dim``."""
    s = sym.movedim(dim, -1).reshape(-1, sym.shape[dim]).long()
    s = s - s.min(dim=1, keepdim=True).values
    n = s.shape[1]
    cnt = torch.zeros(s.shape[0], int(s.max()) + 1)
    cnt.scatter_add_(1, s, torch.ones_like(s, dtype=torch.float32))
    p = cnt / n
    return float(-(cnt * torch.where(p > 0, p.log2(), torch.zeros_like(p))).sum())


def to_basis(kv, enc, mean, theta, start=0):
    x = kv.float().clone()
    x[:, 0] = rope.apply_layers(x[:, 0], start, theta, inverse=True)
    return torch.einsum("lkhde,lkhte->lkhtd", enc, x) - mean.unsqueeze(3)


def from_basis(y, dec, mean, theta, start=0):
    x = torch.einsum("lkhde,lkhte->lkhtd", dec, y + mean.unsqueeze(3))
    x[:, 0] = rope.apply_layers(x[:, 0], start, theta)
    return x


def sim_codec(key, factor, mult=None, chunk=256, groups=None, side_bits=16, reach=None):
    """A codec: each chunk in the basis, step = factor x profile x pooled sd x mult[l, k, h, t]
    (``mult(y, start)`` -> broadcastable to [L, 2, H, T, 1]), uniform rounding around the chunk's mean;
    rate = entropy per (component, token group) + side_bits per component + the exact token 0.
    ``reach``: emulate 8-bit samples: steps widened so the farthest value is ``reach`` steps away (as
    the layout does) and no token's multiplier finer than keeps its values within ``reach`` steps."""
    enc, dec, mean, prof, theta = setup(key)

    def codec(kv):
        Lr, _, H, T, D = kv.shape
        st = prof[torch.arange(Lr) * len(prof) // Lr] * factor  # [L, 2]
        outs, bits = [], 0.0
        for a in range(0, T, chunk):
            y = to_basis(kv[:, :, :, a:a + chunk], enc, mean, theta, a)
            b0 = 1 if a == 0 else 0
            body = y[:, :, :, b0:]
            mu = body.mean(3, keepdim=True)
            sd = (body - mu).square().mean(dim=(2, 3, 4), keepdim=True).sqrt()
            step = sd * st.view(Lr, 2, 1, 1, 1)
            m = (mult(y, a, kv[:, :, :, a:a + chunk]) if mult.__code__.co_argcount == 3 else mult(y, a)) if mult is not None else torch.ones(1)
            if reach:
                far = (body - mu).abs().amax(3, keepdim=True)  # [L, 2, H, 1, D]
                step = torch.maximum(step, far / reach)
                need = ((y - mu).abs() / (reach * step)).amax(dim=(1, 4), keepdim=True)  # [L, 1, H, T, 1]
                m = torch.maximum(m * torch.ones_like(need), need)
            stp = step * m
            q = torch.round((y - mu) / stp)
            rec = q * stp + mu
            if b0:
                rec[:, :, :, 0] = y[:, :, :, 0]
            qb = q[:, :, :, b0:]
            g = groups(y, a)[..., b0:] if groups is not None else None  # [T'] group ids
            if g is None:
                bits += entropy_bits(qb, 3)
            else:
                for gi in g.unique():
                    bits += entropy_bits(qb[:, :, :, g == gi], 3)
            bits += side_bits * Lr * 2 * H * D + (16 * Lr * 2 * H * D if b0 else 0)
            outs.append(from_basis(rec, dec, mean, theta, a))
        back = torch.cat(outs, 3).to(torch.float16)
        if True:
            back[:, :, :, 0] = kv[:, :, :, 0]
        return back, bits / 8
    return codec


@torch.inference_mode()
def attention(key, case, kv):
    """E over continuation queries (and the query heads of a group) of a_t^2 and a_t: [L, H_kv, T] each."""
    lm = lm_of(key)
    m = lm.model
    old = m.config._attn_implementation
    m.set_attn_implementation("eager")
    try:
        cache, rest = model._cache_of(lm, case.ids, kv)
        feed = torch.cat([rest, case.cont[:-1]]).unsqueeze(0)
        out = m(feed, past_key_values=cache, use_cache=True, output_attentions=True)
    finally:
        m.set_attn_implementation(old)
    H = kv.shape[2]
    T = kv.shape[3]
    a2, a1 = [], []
    for att in out.attentions:  # [1, q_heads, n, T_total]
        a = att[0, :, :, :T].float()
        g = a.shape[0] // H
        a = a.view(H, g, *a.shape[1:])
        a2.append(a.square().mean(dim=(1, 2)))
        a1.append(a.mean(dim=(1, 2)))
    return torch.stack(a2), torch.stack(a1)


def at_kl(points, target=3e-4):
    """Ratio interpolated (log-log) at KL ``target`` from [(ratio, kl)] points."""
    import math
    pts = sorted(points, key=lambda p: p[1])
    for (r0, k0), (r1, k1) in zip(pts, pts[1:]):
        if k0 <= target <= k1:
            w = (math.log(target) - math.log(k0)) / (math.log(k1) - math.log(k0))
            return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))
    return float("nan")


def curve(key, data, make, factors, label):
    pts = []
    for f in factors:
        r = score(key, data, make(f), f"{label} x{f}")
        pts.append((r[0], r[2]))
    print(f"== {label}: ratio at KL 3e-4 {at_kl(pts):.2f}x", flush=True)
    return pts


def probe_queries(key, n=64, windows=4, seed=0):
    """Pre-RoPE queries of calibration text: [L, n, q_heads, D] (a random n of them per layer)."""
    p = CACHE / f"{key}-probes-{n}-{windows}.pt"
    if p.exists():
        return torch.load(p)
    from kvfetcher.eval import calibrate
    lm = lm_of(key)
    texts = sorted(calibrate.TEXTS_DIR.glob("*.txt"))
    wins = calibrate.capture(lm, calibrate.windows_of(lm, texts, 1)[:windows])
    q = torch.cat([w.queries for w in wins], 1)  # [L, windows*128, qh, D]
    idx = torch.randperm(q.shape[1], generator=torch.Generator().manual_seed(seed))[:n]
    q = q[:, idx].contiguous()
    torch.save(q, p)
    return q


def probe_weights(key, piece, start, q, ahead=64, spread=0):
    """E over probe queries (placed ``ahead`` tokens past the chunk, or spread over ``spread`` positions
    from there) of a_t^2 within the chunk: [L, H, T]."""
    lm = lm_of(key)
    thetas = rope.per_layer(model.rope_theta(lm), piece.shape[0])
    Lr, _, H, T, D = piece.shape
    out = []
    for l in range(Lr):
        qh = q[l].shape[1]
        n = q[l].shape[0]
        if spread:
            cos, sin = rope.rotation(start + T + ahead, spread, D, thetas[l])
            pick = torch.arange(n) * spread // n
            qr = rope.apply(q[l].transpose(0, 1), cos[pick], sin[pick])
        else:
            cos, sin = rope.rotation(start + T + ahead, 1, D, thetas[l])
            qr = rope.apply(q[l].transpose(0, 1), cos, sin)  # [qh, n, D]
        scale = getattr(lm.model.model.layers[l].self_attn, "scaling", D ** -0.5)
        k = piece[l, 0].float()  # [H, T, D] post-RoPE
        g = qh // H
        logits = torch.einsum("hgnd,htd->hgnt", qr.view(H, g, -1, D), k) * scale
        a = logits.softmax(-1)
        out.append(a.square().mean(dim=(1, 2)))
    return torch.stack(out)


def joint_basis(key, per_text=2):
    """A KLT over all KV heads' channels of each (layer, K|V) in the model's metric (block-diagonal
    over heads, each normalised as the per-head basis is): (enc [L, 2, HD, HD], dec, mean [L, 2, HD])."""
    p = CACHE / f"{key}-joint.pt"
    if p.exists():
        return torch.load(p)
    from kvfetcher.eval import calibrate
    lm = lm_of(key)
    texts = sorted(calibrate.TEXTS_DIR.glob("*.txt"))
    wins = calibrate.capture(lm, calibrate.windows_of(lm, texts, per_text))
    thetas = model.rope_thetas(lm)
    cfg = lm.config
    Lr, H, D = cfg.num_hidden_layers, cfg.num_key_value_heads, model.head_dim(lm)
    xs = [calibrate.pre_rope(w.kv, thetas) for w in wins]
    enc = torch.zeros(Lr, 2, H * D, H * D, dtype=torch.float64)
    for layer in range(Lr):
        wo = lm.model.model.layers[layer].self_attn.o_proj.weight.cpu()
        metric = (kvbasis.key_metric([w.queries[layer] for w in wins], H, thetas[layer], calibrate.DELTAS),
                  kvbasis.value_metric(wo, H, D))
        for kind in (0, 1):
            m = kvbasis.normalise_heads(metric[kind])  # [H, D, D]
            w = torch.block_diag(*m)
            chunks = [x[layer, kind, :, s + 1: s + calibrate.CHUNK].permute(1, 0, 2).reshape(1, -1, H * D)
                      for x in xs for s in range(0, calibrate.WINDOW, calibrate.CHUNK)]
            cov = kvbasis.covariance(chunks)
            enc[layer, kind] = kvbasis.transform(w.unsqueeze(0), cov)[0][0]
    e = enc.float().half().float()
    dec = torch.stack([torch.linalg.inv(m) for m in e.double().reshape(-1, H * D, H * D)]).reshape(e.shape).float()
    mean = torch.cat([torch.einsum("lkde,ltke->lktd", e, x.permute(0, 3, 1, 2, 4).reshape(Lr, -1, 2, H * D)) for x in xs], 2).mean(2)
    out = (e, dec, mean)
    torch.save(out, p)
    return out


def sim_joint(key, factor, k=12, chunk=256):
    """sim_codec with the joint basis (one group of H*D components per layer), sparse: top-k tokens by
    key energy at 1/16 of the step."""
    enc, dec, mean = joint_basis(key)
    theta = setup(key)[4]
    prof = setup(key)[3]

    def codec(kv):
        Lr, _, H, T, D = kv.shape
        st = prof[torch.arange(Lr) * len(prof) // Lr] * factor
        outs, bits = [], 0.0
        for a in range(0, T, chunk):
            x = kv[:, :, :, a:a + chunk].float().clone()
            x[:, 0] = rope.apply_layers(x[:, 0], a, theta, inverse=True)
            x = x.permute(0, 1, 3, 2, 4).reshape(Lr, 2, -1, H * D)
            y = torch.einsum("lkde,lkte->lktd", enc, x) - mean.unsqueeze(2)  # [L, 2, T, C]
            y = y.unsqueeze(2)  # [L, 2, 1, T, C]
            b0 = 1 if a == 0 else 0
            body = y[:, :, :, b0:]
            mu = body.mean(3, keepdim=True)
            sd = (body - mu).square().mean(dim=(2, 3, 4), keepdim=True).sqrt()
            step = sd * st.view(Lr, 2, 1, 1, 1)
            m = torch.ones(Lr, 1, 1, y.shape[3], 1)
            if k:
                sc = y[:, 0].square().sum(-1)  # [L, 1, T]
                idx = sc[..., b0:].topk(k, -1).indices + b0
                m.view(Lr, 1, -1).scatter_(-1, idx, 1 / 16)
            stp = step * m
            q = torch.round((y - mu) / stp)
            rec = q * stp + mu
            bits += entropy_bits(q[:, :, :, b0:], 3) + 16 * Lr * 2 * H * D + (16 * Lr * 2 * H * D if b0 else 0)
            xr = torch.einsum("lkde,lkte->lktd", dec, rec[:, :, 0] + mean.unsqueeze(2))
            xr = xr.view(Lr, 2, -1, H, D).permute(0, 1, 3, 2, 4).contiguous()
            xr[:, 0] = rope.apply_layers(xr[:, 0], a, theta)
            outs.append(xr)
        back = torch.cat(outs, 3).to(torch.float16)
        back[:, :, :, 0] = kv[:, :, :, 0]
        return back, bits / 8
    return codec
