"""Probes for issue 6's last gap (per-token precision, bit allocation), on 24 windows.

Setup (cached under --cache): the 24 screening windows of research/trellis_probes.py (kl24: the
harness's 8 prompts + 16 more), their fp16 KV, reference log-probs of the 64-token
continuation, and the restored KV of ``balanced`` as the cache first saw it (whole stored
objects, so sizes are real; the runs in research/results/outlier_probes.txt cached layout v6's).

* ``rows``: how much KL do selected (layer, k|v, head, token) rows, restored exactly after
  ``balanced``, remove? Selection rules the encoder can compute from KV alone (per head and
  chunk, top-k of a row's norm in the basis, of its distance from the chunk mean, ...) against
  random rows.
* ``sparse``: the layout's sparse corrections (``sparse_tokens``), whole stored objects, over the
  24 windows: ``--configs k:sparse_step:scale[:steps.pt],...``.
* ``alone`` / ``groups``: at an operating point (the first config), each (layer, k|v)'s share of
  the KL on the 16 windows beyond the harness: its error alone (``alone``; with ``--out`` also the
  rate slopes) or all but it (``groups``, noisy). SENSITIVITY_TRELLIS in presets.py is ``alone``
  at ``4:0.25:1.04`` (/tmp/comp7/steps_a1.0.pt in the run: steps sqrt(slope / (share / step^2)),
  normalised to the same rate).

    python -m research.outlier_probes rows|sparse|alone|groups [--configs ...]

research/results/outlier_probes.txt holds the runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from benchmarks.compression import compression_bench as cb
from research.trellis_probes import EXTRA
from kvfetcher.eval import accuracy, model
from kvfetcher.codec import basis, rope
from kvfetcher.format import presets
from kvfetcher.codec import tiling
from kvfetcher.format import calibration


def windows(lm, path: Path, kv_cache: str | None):
    if path.exists():
        return torch.load(path, weights_only=False)
    cases = cb.load_cases(lm, kv_cache)
    out = [dict(label=c.label, ids=c.ids, cont=c.cont, kv=c.kv, ref=c.ref_logp) for c in cases]
    for name, off in EXTRA:
        ids, cont = accuracy.prompt_ids(lm, name, off, 512)
        kv = model.prefill(lm, ids)[0].half()
        out.append(dict(label=f"{name}@{off}", ids=ids, cont=cont, kv=kv, ref=cb.continuation_logp(lm, ids, kv, cont)))
    torch.save(out, path)
    return out


def kl(w, kv, lm) -> float:
    lp = cb.continuation_logp(lm, w["ids"], kv, w["cont"])
    return float((w["ref"].exp() * (w["ref"] - lp)).sum(-1).mean())


def restored(lm, ws, p, path: Path, theta):
    if path.exists():
        return torch.load(path, weights_only=False)
    out = []
    for w in ws:
        rt = accuracy.round_trip(w["kv"], p, lm.fingerprint, cb.CHUNK, theta)
        out.append(dict(kv=rt.kv, stored=rt.stored_bytes))
    torch.save(out, path)
    return out


def basis_coords(kv: torch.Tensor, theta: float) -> torch.Tensor:
    """Pre-RoPE keys / values of a whole window in the shipped basis, less its mean: [L,2,H,T,D]."""
    enc, _, mean = basis.on_device(calibration.default().basis, "cpu")
    x = kv.float().clone()
    cos, sin = rope.rotation(0, x.shape[3], x.shape[-1], theta)
    x[:, 0] = rope.apply(x[:, 0], cos, sin, inverse=True)
    return torch.einsum("lkhde,lkhte->lkhtd", enc, x) - mean.unsqueeze(3)


def score(rule: str, y: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Per-row score [L,2,H,T] (higher = keep), per 256-token chunk where it matters."""
    L, K, H, T, D = y.shape
    if rule == "random":
        return torch.rand(L, K, H, T, generator=g)
    if rule == "norm":  # metric-weighted distance from the calibration mean
        return y.square().sum(-1)
    if rule == "dev":  # distance from the chunk's mean (what the quantiser's offsets centre on)
        s = torch.empty(L, K, H, T)
        for a in range(0, T, cb.CHUNK):
            c = y[:, :, :, a : a + cb.CHUNK]
            s[:, :, :, a : a + cb.CHUNK] = (c - c.mean(3, keepdim=True)).square().sum(-1)
        return s
    if rule == "knorm":  # the key's row norm ranks both its key and value rows
        s = y[:, 0].square().sum(-1)
        return torch.stack([s, s], 1)
    if rule == "knorm-k":  # keys' rows only
        s = y[:, 0].square().sum(-1)
        return torch.stack([s, torch.full_like(s, -2.0)], 1)
    if rule == "knorm-v":  # values' rows only, ranked by their key
        s = y[:, 0].square().sum(-1)
        return torch.stack([torch.full_like(s, -2.0), s], 1)
    if rule == "vnorm":  # each row by its own norm, values' rows only
        s = y[:, 1].square().sum(-1)
        return torch.stack([torch.full_like(s, -2.0), s], 1)
    raise ValueError(rule)


def select(s: torch.Tensor, k: int, first_exact: bool) -> torch.Tensor:
    """Top-k rows per (layer, k|v, head, chunk) -> bool mask [L,2,H,T] (token 0 excluded: exact already)."""
    m = torch.zeros_like(s, dtype=torch.bool)
    T = s.shape[3]
    s = s.clone()
    if first_exact:
        s[..., 0] = -1
    for a in range(0, T, cb.CHUNK):
        c = s[..., a : a + cb.CHUNK]
        idx = c.topk(k, dim=-1).indices
        mm = torch.zeros_like(c, dtype=torch.bool).scatter_(-1, idx, True)
        m[..., a : a + cb.CHUNK] = mm
    return m


def probe_rows(lm, ws, rs, theta, ks=(1, 4), rules=("random", "norm", "dev", "knorm")):
    import os
    if os.environ.get("RULES"):
        rules = os.environ["RULES"].split(",")
        ks = tuple(int(k) for k in os.environ.get("KS", "1").split(","))
    fp16 = sum(w["kv"].numel() * 2 for w in ws)
    stored = sum(r["stored"] for r in rs)
    base = [kl(w, r["kv"], lm) for w, r in zip(ws, rs)]
    b = torch.tensor(base)
    print(f"balanced: ratio {fp16 / stored:.3f}, KL24 {b.mean():.5f}, harness {b[:8].mean():.5f}, other {b[8:].mean():.5f}, geomean {b.log().mean().exp():.5f}", flush=True)
    g = torch.Generator().manual_seed(0)
    ys = [basis_coords(w["kv"], theta) for w in ws]
    for rule in rules:
        for k in ks:
            kls = []
            for w, r, y in zip(ws, rs, ys):
                m = select(score(rule, y, g), k, True)  # [L,2,H,T]
                m &= score(rule, y, g) > -1
                kv = torch.where(m.unsqueeze(-1), w["kv"], r["kv"])
                kls.append(kl(w, kv, lm))
            t = torch.tensor(kls)
            rows = sum(int(select(score(rule, y, g), k, True).__and__(score(rule, y, g) > -1).sum()) for y in ys[:1]) * len(ws)
            print(f"  {rule} top-{k} rows exact per (layer,k|v,head,chunk): KL24 {t.mean():.5f} ({100 * (t.mean() / b.mean() - 1):+.1f}%), "
                  f"harness {t[:8].mean():.5f}, other {t[8:].mean():.5f}, geomean {t.log().mean().exp():.5f}; "
                  f"~{rows * 130 / stored * 100:.2f}% of size as fp16 rows", flush=True)


def variant(k: int, sstep: float, scale: float, steps: str = "") -> cb.Preset:
    """balanced with ``k`` sparse tokens at ``sstep``, every step times ``scale`` (layout v6's
    balanced steps, or a saved [L, 2] tensor of steps when ``steps`` names one)."""
    b = presets.get("balanced")
    base = cb.V6_STEPS if not steps else tuple(tuple(map(float, kv)) for kv in torch.load(steps).tolist())
    lp = dataclasses.replace(b.layout, sigma_steps=presets.scaled(base, scale), sparse_tokens=k, sparse_step=sstep)
    return dataclasses.replace(b, name=f"sparse {k} at {sstep} step, steps {Path(steps).stem if steps else ''} x{scale}", layout=lp)


def probe_sparse(lm, ws, theta, configs):
    """Whole stored objects of balanced with sparse corrections: ratio and KL over the 24 windows."""
    fp16 = sum(w["kv"].numel() * 2 for w in ws)
    for k, sstep, scale, *steps in configs:
        p = variant(k, sstep, scale, *steps)
        kls, stored = [], 0
        t = time.perf_counter()
        for w in ws:
            rt = accuracy.round_trip(w["kv"], p, lm.fingerprint, cb.CHUNK, theta)
            kls.append(kl(w, rt.kv, lm))
            stored += rt.stored_bytes
        x = torch.tensor(kls)
        print(f"  {p.name}: ratio {fp16 / stored:.3f}, KL24 {x.mean():.5f}, harness {x[:8].mean():.5f}, other {x[8:].mean():.5f}, "
              f"geomean {x.log().mean().exp():.5f} ({time.perf_counter() - t:.0f} s)", flush=True)


def probe_groups(lm, ws, theta, k: int, sstep: float, scale: float, out: Path, alone: bool = False, rates: bool = True,
                 steps: str = ""):
    """At an operating point: each (layer, k|v)'s share of the KL (KL of all restored less KL with that
    group exact, on the 16 windows beyond the harness) and its rate slope (plug-in entropy of its
    symbols per value at steps x1 and x1.15, on 4 of them)."""
    import math

    from kvfetcher.codec import layout

    p = variant(k, sstep, scale, steps)
    ws = ws[8:]
    L = ws[0]["kv"].shape[0]
    rts = [accuracy.round_trip(w["kv"], p, lm.fingerprint, cb.CHUNK, theta).kv for w in ws]
    full = [kl(w, r, lm) for w, r in zip(ws, rts)]
    print(f"operating point {p.name}: KL on the 16 other windows {sum(full) / len(full):.5f}", flush=True)
    contrib = torch.zeros(L, 2)
    for layer in range(L):
        for kind in (0, 1):
            tot = 0.0
            for w, r, f in zip(ws, rts, full):
                if alone:  # that group's error alone (the diagonal term: no other group's error to interact with)
                    kv = w["kv"].clone()
                    kv[layer, kind] = r[layer, kind]
                    tot += kl(w, kv, lm)
                else:  # KL of all less KL with that group exact
                    kv = r.clone()
                    kv[layer, kind] = w["kv"][layer, kind]
                    tot += f - kl(w, kv, lm)
            contrib[layer, kind] = tot / len(ws)
        print(f"  layer {layer}: keys {contrib[layer, 0]:.2e} values {contrib[layer, 1]:.2e}", flush=True)

    def entropy(frames_list, geo_list, tokens=256):
        h = torch.zeros(L, 2)
        for fr, geo in zip(frames_list, geo_list):
            t = tiling.frames_to_tiles(fr, geo, tokens, geo.tile_cols).reshape(L, 2, tokens, -1).long()
            for a in range(L):
                for b in (0, 1):
                    x = t[a, b]
                    cnt = torch.zeros(256, x.shape[1]).scatter_add_(0, x, torch.ones_like(x, dtype=torch.float))
                    pr = cnt / tokens
                    h[a, b] += float(-(cnt * torch.where(pr > 0, pr.log2(), torch.zeros_like(pr))).sum()) / x.numel()
        return h / len(frames_list)

    if not rates:
        torch.save({"contrib": contrib, "steps": p.layout.sigma_steps, "point": p.name, "alone": alone}, out)
        return
    rate = []
    for sc in (1.0, 1.15):
        q = variant(0, sstep, scale * sc, steps)
        lp = dataclasses.replace(q.layout, rope_theta=theta)
        frs, geos = [], []
        for w in ws[::4]:
            for st in (0, 256):
                pk = layout.pack(w["kv"][:, :, :, st : st + 256].contiguous(), dataclasses.replace(lp, exact_tokens=1 if st == 0 else 0), st)
                frs.append(pk.frames)
                geos.append(pk.geometry)
        rate.append(entropy(frs, geos))
    slope = (rate[0] - rate[1]) / math.log(1.15)  # bits per value per unit of ln(step)
    for layer in range(L):
        print(f"  layer {layer}: entropy keys {rate[0][layer, 0]:.2f} values {rate[0][layer, 1]:.2f}, slope {slope[layer, 0]:.2f} {slope[layer, 1]:.2f}", flush=True)
    torch.save({"contrib": contrib, "rate": rate[0], "slope": slope, "steps": p.layout.sigma_steps, "point": p.name}, out)


def table(alone: Path, rates: Path, scale: float = 0.001) -> None:
    """SENSITIVITY_TRELLIS from an ``alone`` run (shares) and a ``groups`` run (rate slopes): at a
    fixed rate sum(slope * ln step), the least summed KL (share ~ step^2) has steps
    ~ sqrt(slope / (share / step^2)); the table is what sigma_steps(scale) turns into them."""
    a, g = torch.load(alone), torch.load(rates)
    c, r, s = a["contrib"].double().clamp(min=1e-7), g["slope"].double(), torch.tensor(a["steps"]).double()
    new = (r / (c / s**2)).sqrt().log()
    new = (new + ((r * (s.log() - new)).sum() / r.sum())).exp()  # the same rate
    print(f"predicted KL {float((c / s**2 * new**2).sum()):.6f} against {float(c.sum()):.6f}")
    print(tuple((float(f"{k:.2g}"), float(f"{v:.2g}")) for k, v in ((scale / new) ** 2).tolist()))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("probes", nargs="*", default=["rows"])
    ap.add_argument("--kv-cache", default="/tmp/kv.pt")
    ap.add_argument("--cache", default="/tmp/comp7")
    ap.add_argument("--out", help="alone: where to save the shares (and measure rate slopes too)")
    ap.add_argument("--configs", default="2:0.25:1,4:0.25:1,8:0.25:1,4:0.5:1", help="sparse: k:sparse_step:scale,...")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = model.load()
    theta = model.rope_theta(lm)
    d = Path(args.cache)
    d.mkdir(exist_ok=True)
    t = time.perf_counter()
    ws = windows(lm, d / "w24.pt", args.kv_cache)
    print(f"windows {time.perf_counter() - t:.0f} s", flush=True)
    t = time.perf_counter()
    rs = restored(lm, ws, presets.get("balanced"), d / "balanced.pt", theta)
    print(f"balanced round trips {time.perf_counter() - t:.0f} s", flush=True)
    cfg = args.configs.split(",")[0].split(":")
    for p in args.probes:
        {"table": lambda: table(d / "alone.pt", d / "groups.pt"),
         "rows": lambda: probe_rows(lm, ws, rs, theta),
         "groups": lambda: probe_groups(lm, ws, theta, *[f(x) for f, x in zip((int, float, float), cfg)], d / "groups.pt",
                                        steps=cfg[3] if len(cfg) > 3 else ""),
         "alone": lambda: probe_groups(lm, ws, theta, *[f(x) for f, x in zip((int, float, float), cfg)], Path(args.out or d / "alone.pt"),
                                       alone=True, rates=bool(args.out), steps=cfg[3] if len(cfg) > 3 else ""),
         "sparse": lambda: probe_sparse(lm, ws, theta, [(int(a), float(b), float(c), *e) for a, b, c, *e in
                                                        (x.split(":") for x in args.configs.split(","))])}[p]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
