"""The size-accuracy curve on real KV, beside plain quantisation + zstd and LMCache's CacheGen.

Every point is judged on the same caches (SmolLM2-135M, the 8 shipped prompts x 512 tokens,
fp16, chunks of 256 tokens): ratio vs fp16 with every header and side-information byte counted,
greedy agreement over 32 tokens, first divergence, NLL increase of the real continuation and
the KL divergence of next-token distributions over it (a smoother signal than greedy).

* kvfetcher points are whole stored objects (``chunk.encode_chunk`` / ``decode_chunk``).
* ``zstd qN``: the layout's own per-channel N-bit quantisation (first token exact, post-RoPE
  keys, no video), token-major bytes through zstd -19, side information added.
* ``cachegen``: LMCache 0.5.6's CacheGen quantisation as its serializer does it
  (``torch_quant_vectorized``: symmetric, per (layer, token) absmax over all channels; bins per
  layer from ``CacheGenConfig`` for a model of >= 10 layers: keys 32 in layers 0-9 else 16,
  values 32 in layers 0-1 else 16). Its arithmetic coder (CUDA, or numba in its torch_ops path)
  is not run here: the size is an **estimate**, the empirical entropy of its symbols per
  (layer, channel) — what an arithmetic coder with per-channel CDFs approaches — plus the side
  information LMCache stores (int16 CDF per (layer, channel), int32 length per (layer,
  channel), fp16 max per (layer, token)); the entropy alone is reported too.

    python -m benchmarks.compression.compression_bench [--points a,b] [--kv-cache /tmp/kv.pt]

Writes benchmarks/compression/result_cpu.json (points merged with earlier runs), the tables in
compression.md (between the ``curve`` markers), compression.png, and the measured figures of
the shipped presets into the package's presets_measured.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import zstandard

from kvfetcher.eval import accuracy, model
from kvfetcher.codec import layout
from kvfetcher.format import presets
from kvfetcher.codec.base import CodecParams
from kvfetcher.format.presets import Preset
from kvfetcher.codec import tiling
from kvfetcher.format import calibration

OUT = Path(__file__).resolve().parent  # result_cpu.json / .md / .png beside this file
CHUNK = 256


def sigma_point(name: str, scale: float, profile=None) -> Preset:
    """A curve point of the per-channel sigma steps (no basis): the capped base profile (or a flat
    one) times ``scale``; the ``balanced`` of layout v3 was x0.7."""
    steps = presets.scaled(profile or presets.sigma_steps(0.003, table=calibration.default().table("channel")), scale)
    return Preset(name, layout.LayoutParams(mode="quant", sigma_steps=steps), CodecParams(lossless=True), False,
                  f"sigma steps x{scale}", pre_rope=True)


#: layout v5's ``balanced`` steps (uniform rounding in the basis; the ``basis xS`` curve)
V5_STEPS = presets.sigma_steps(0.0024, lo=0.03, hi=2.0, table=calibration.default().table("basis"))


def basis_point(name: str, scale: float) -> Preset:
    """A curve point of layout v5's ``balanced`` (basis, uncapped profile, exact token only at
    position 0, uniform rounding, x265's default RD level) with every step times ``scale``."""
    b = presets.get("balanced")
    lp = dataclasses.replace(b.layout, sigma_steps=presets.scaled(V5_STEPS, scale), trellis=False, sparse_tokens=0)
    return dataclasses.replace(b, name=name, layout=lp, codec=dataclasses.replace(b.codec, rd=None),
                               summary=f"layout v5's balanced (uniform rounding), steps x{scale}")


#: layout v6's ``balanced`` steps (trellis, the 0.7-sigma basis table; the ``trellis xS`` curve)
V6_STEPS = presets.sigma_steps(0.001224, lo=0.015, hi=1.0, table=calibration.default().table("basis"))


def trellis_point(name: str, scale: float) -> Preset:
    """A curve point of layout v6's ``balanced`` (trellis-coded quantisation, x265 --rd 3, no
    sparse tokens) with every step times ``scale``."""
    b = presets.get("balanced")
    lp = dataclasses.replace(b.layout, sigma_steps=presets.scaled(V6_STEPS, scale), sparse_tokens=0)
    return dataclasses.replace(b, name=name, layout=lp, summary=f"layout v6's balanced, steps x{scale}")


def flat(step: float) -> Preset:
    return sigma_point(f"flat{step}", 1.0, ((step, step),))


#: Named curve points beyond the shipped presets.
POINTS = {
    "flat0.2": lambda: flat(0.2),
    "flat0.3": lambda: flat(0.3),
    "flat0.45": lambda: flat(0.45),
    **{f"profile x{s}": (lambda s=s: sigma_point(f"profile x{s}", s)) for s in (0.7, 1, 1.4, 2, 3)},
    **{f"basis x{s}": (lambda s=s: basis_point(f"basis x{s}", s)) for s in (0.7, 0.85, 1, 1.4, 2)},
    **{f"trellis x{s}": (lambda s=s: trellis_point(f"trellis x{s}", s)) for s in (0.8, 1.25, 1.6, 2.2)},
}


@dataclasses.dataclass
class Case:
    label: str
    ids: torch.Tensor
    cont: torch.Tensor
    kv: torch.Tensor  # fp16 [L, 2, H, T, D]
    greedy: list[int]
    ref_logp: torch.Tensor


@torch.inference_mode()
def continuation_logp(lm, ids, kv, cont) -> torch.Tensor:
    cache = model.to_cache(kv[:, :, :, : len(ids) - 1].float())
    feed = torch.cat([ids[-1:], cont[:-1]]).unsqueeze(0)
    return torch.log_softmax(lm.model(feed, past_key_values=cache, use_cache=True).logits[0].float(), -1)


def load_cases(lm, path: str | None) -> list[Case]:
    if path and Path(path).exists():
        return [Case(**c) for c in torch.load(path, weights_only=False)]
    cases = []
    for name, off in accuracy.PROMPTS:
        ids, cont = accuracy.prompt_ids(lm, name, off, 512)
        kv = model.prefill(lm, ids)[0].half()
        cases.append(Case(f"{name}@{off}", ids, cont, kv, model.greedy(lm, ids, kv, 32), continuation_logp(lm, ids, kv, cont)))
    if path:
        torch.save([dataclasses.asdict(c) for c in cases], path)
    return cases


def judge(lm, cases: list[Case], restored: list[torch.Tensor], stored: list[int]) -> dict:
    """Accuracy of restored caches against the fp16 originals, and the size ratio."""
    per = []
    for c, kv in zip(cases, restored):
        g = model.greedy(lm, c.ids, kv, 32)
        same = [a == b for a, b in zip(c.greedy, g)]
        lp = continuation_logp(lm, c.ids, kv, c.cont)
        nll_o = float(-c.ref_logp.gather(1, c.cont[:, None]).mean())
        nll_r = float(-lp.gather(1, c.cont[:, None]).mean())
        per.append({
            "prompt": c.label,
            "greedy_agreement": sum(same) / len(same),
            "first_divergence": same.index(False) if False in same else len(same),
            "nll_increase": (nll_r - nll_o) / nll_o,
            "kl": float((c.ref_logp.exp() * (c.ref_logp - lp)).sum(-1).mean()),
        })
    fp16 = sum(c.kv.numel() * 2 for c in cases)
    n = len(per)
    return {
        "ratio_vs_fp16": fp16 / sum(stored),
        "greedy_agreement": sum(p["greedy_agreement"] for p in per) / n,
        "min_first_divergence": min(p["first_divergence"] for p in per),
        "nll_increase": sum(p["nll_increase"] for p in per) / n,
        "kl": sum(p["kl"] for p in per) / n,
        "per_prompt": per,
    }


def run_preset(lm, cases: list[Case], p: Preset, theta: float) -> dict:
    rts = [accuracy.round_trip(c.kv, p, lm.fingerprint, CHUNK, theta) for c in cases]
    r = judge(lm, cases, [rt.kv for rt in rts], [rt.stored_bytes for rt in rts])
    mb = sum(c.kv.numel() * 2 for c in cases) / 1e6
    r["encode_mb_s"] = mb / sum(rt.encode_s for rt in rts)
    r["decode_mb_s"] = mb / sum(rt.decode_s for rt in rts)
    r["kind"] = "kvfetcher"
    r["summary"] = p.summary
    r["layout"] = p.layout.to_dict()
    return r


def zstd_chunk(piece: torch.Tensor, bits: int, level: int = 19) -> tuple[torch.Tensor, int]:
    """One chunk through the layout's per-channel ``bits``-bit quantisation (first token exact,
    post-RoPE keys, no video), its token-major bytes through zstd: (restored, bytes with side info)."""
    p = layout.LayoutParams(mode="quant", bits=bits)
    pk = layout.pack(piece, p)
    q = tiling.frames_to_tiles(pk.frames, pk.geometry, piece.shape[3], piece.shape[2] * piece.shape[4])
    size = len(zstandard.ZstdCompressor(level=level).compress(q.contiguous().numpy().tobytes()))
    return layout.unpack(pk.frames, pk.side, tuple(piece.shape), piece.dtype, p), size + pk.side.numel() * pk.side.element_size()


def run_zstd(lm, cases: list[Case], bits: int) -> dict:
    """Per-channel ``bits``-bit quantisation (the layout's quant mode), zstd -19 instead of video."""
    restored, stored = [], []
    for c in cases:
        parts = [zstd_chunk(c.kv[:, :, :, s : s + CHUNK].contiguous(), bits) for s in range(0, c.kv.shape[3], CHUNK)]
        restored.append(torch.cat([kv for kv, _ in parts], 3))
        stored.append(sum(n for _, n in parts))
    r = judge(lm, cases, restored, stored)
    r["kind"], r["summary"] = "peer", f"per-channel {bits}-bit quantisation (first token exact) + zstd -19"
    return r


def _entropy_bits(sym: torch.Tensor, nbins: int) -> float:
    """Sum over (layer, channel) of tokens x empirical entropy: ``sym`` int [layers, tokens, channels]."""
    L, T, C = sym.shape
    counts = torch.zeros(L, C, nbins)
    counts.scatter_add_(2, sym.long().permute(0, 2, 1), torch.ones(L, C, T))
    p = counts / T
    return float(-(counts * torch.where(p > 0, p.log2(), torch.zeros_like(p))).sum())


def cachegen_bins(layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """LMCache 0.5.6 ``CacheGenConfig.from_model_name`` for a model of >= 10 layers."""
    kb, vb = torch.full((layers,), 16), torch.full((layers,), 16)
    kb[:10], vb[:2] = 32, 32
    return kb, vb


def cachegen_chunk(piece: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """One chunk through CacheGen's quantisation: (restored, estimated bytes, entropy bytes)."""
    L, _, H, T, D = piece.shape
    kb, vb = cachegen_bins(L)
    out = torch.empty_like(piece)
    ent = 0.0
    for kind, bins in ((0, kb), (1, vb)):
        x = piece[:, kind].permute(0, 2, 1, 3).reshape(L, T, H * D)  # [layers, tokens, channels]
        mx = (bins // 2 - 1)[:, None, None].float()
        amax = x.abs().amax(-1, keepdim=True)  # KV dtype, as LMCache keeps it
        sym = torch.round(x.float() * (mx / amax.float()) + mx)
        ent += _entropy_bits(sym, int(bins.max()))
        deq = ((sym - mx) / mx * amax.float()).to(piece.dtype)
        out[:, kind] = deq.view(L, T, H, D).permute(0, 2, 1, 3)
    side = 2 * L * H * D * (int(max(kb.max(), vb.max())) + 1) * 2 + 2 * L * H * D * 4 + 2 * L * T * 2
    return out, ent / 8 + side, ent / 8


def run_cachegen(lm, cases: list[Case]) -> dict:
    restored, est, ent = [], [], []
    for c in cases:
        parts, e1, e2 = [], 0.0, 0.0
        for s in range(0, c.kv.shape[3], CHUNK):
            o, a, b = cachegen_chunk(c.kv[:, :, :, s : s + CHUNK].contiguous())
            parts.append(o)
            e1, e2 = e1 + a, e2 + b
        restored.append(torch.cat(parts, 3))
        est.append(e1)
        ent.append(e2)
    r = judge(lm, cases, restored, est)
    fp16 = sum(c.kv.numel() * 2 for c in cases)
    r["ratio_symbols_entropy_only"] = fp16 / sum(ent)
    r["kind"] = "peer"
    r["summary"] = ("LMCache 0.5.6 CacheGen quantisation (per-token absmax, bins 32/16 by layer); size ESTIMATED: "
                    "symbol entropy + its CDF/length/max side information; post-RoPE keys")
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="balanced,compact,lean,q8,trellis x0.8,trellis x1.25,trellis x1.6,trellis x2.2,basis x0.7,basis x0.85,basis x1,basis x1.4,basis x2,profile x0.7,profile x1,profile x1.4,profile x2,flat0.3,zstd q8,zstd q6,zstd q5,cachegen")
    ap.add_argument("--kv-cache", help="cache the prefilled prompts here (reused when present)")
    ap.add_argument("--measured", default="balanced,compact",
                    help="presets whose figures go to presets_measured.json (q8/lean/exact/raw: benchmarks/codec/codec_bench.py)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = model.load()
    theta = model.rope_theta(lm)
    cases = load_cases(lm, args.kv_cache)
    path = OUT / "result_cpu.json"
    res = json.loads(path.read_text()) if path.exists() else {"points": {}}
    res.update({
        "date": datetime.date.today().isoformat(),
        "device": "CPU, 2 shared cores",
        "model": lm.fingerprint,
        "prompts": [c.label for c in cases],
        "tokens_per_prompt": 512,
        "chunk_tokens": CHUNK,
    })
    for name in [n.strip() for n in args.points.split(",") if n.strip()]:
        t = time.perf_counter()
        if name in presets.PRESETS:
            r = run_preset(lm, cases, presets.get(name), theta)
            r["preset"] = True
        elif name in POINTS:
            r = run_preset(lm, cases, POINTS[name](), theta)
        elif name.startswith("zstd q"):
            r = run_zstd(lm, cases, int(name[len("zstd q"):]))
        elif name == "cachegen":
            r = run_cachegen(lm, cases)
        else:
            raise SystemExit(f"unknown point {name!r}")
        r["wall_s"] = time.perf_counter() - t
        r["date"] = res["date"]
        res["points"][name] = r
        print(f"{name}: ratio {r['ratio_vs_fp16']:.2f} agreement {r['greedy_agreement']:.3f} "
              f"nll {100 * r['nll_increase']:+.3f}% kl {r['kl']:.4f} ({r['wall_s']:.0f} s)", flush=True)
        path.write_text(json.dumps(res, indent=2))
    render(res)
    write_measured(res, [n for n in args.measured.split(",") if n])
    return 0


def write_measured(res: dict, names: list[str]) -> None:
    """Shipped presets' figures for ``kvfetcher presets`` (merged with the codec bench's)."""
    try:
        measured = json.loads(presets.MEASURED_FILE.read_text())
    except FileNotFoundError:
        measured = {}
    for name, r in res["points"].items():
        if name in presets.PRESETS and name in names:
            measured[name] = {f: r[f] for f in ("ratio_vs_fp16", "greedy_agreement", "nll_increase", "encode_mb_s", "decode_mb_s")} | {
                "min_first_divergence": r["min_first_divergence"], "kl": r["kl"], "date": r["date"],
                "source": "benchmarks/compression/compression_bench.py"}
    presets.MEASURED_FILE.write_text(json.dumps(measured, indent=2))


def render(res: dict) -> None:
    pts = sorted(res["points"].items(), key=lambda kv: kv[1]["ratio_vs_fp16"])
    rows = [
        f"Model {res['model']}, {len(res['prompts'])} prompts x {res['tokens_per_prompt']} tokens, chunks of "
        f"{res['chunk_tokens']} tokens, KV stored as fp16; {res['device']}, {res['date']}.",
        "",
        "| point | kind | ratio vs fp16 | greedy agreement (32 tok) | first divergence (min) | NLL increase | KL (nats) | per-prompt agreement |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in pts:
        label = f"**{name}** (preset)" if r.get("preset") else name
        per = " ".join(f"{p['greedy_agreement']:.2f}" for p in r["per_prompt"])
        rows.append(f"| {label} | {r['kind']} | {r['ratio_vs_fp16']:.2f}x | {r['greedy_agreement']:.3f} | {r['min_first_divergence']} | "
                    f"{100 * r['nll_increase']:+.3f}% | {r['kl']:.2g} | {per} |")
    if "cachegen" in res["points"]:
        cg = res["points"]["cachegen"]
        rows += ["", f"CacheGen's size is an estimate (see above); its symbols alone, at their entropy, would be "
                     f"{cg['ratio_symbols_entropy_only']:.2f}x."]
    md = OUT / "result_cpu.md"
    text = md.read_text() if md.exists() else "# Compression: size vs accuracy\n\n<!-- curve -->\n<!-- /curve -->\n"
    head, rest = text.split("<!-- curve -->", 1)
    tail = rest.split("<!-- /curve -->", 1)[1]
    md.write_text(head + "<!-- curve -->\n" + "\n".join(rows) + "\n<!-- /curve -->" + tail)
    plot(res)


def plot(res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    groups = {
        "kvfetcher presets": lambda n, r: r.get("preset"),
        "kvfetcher trellis (layout v6): balanced's steps x0.8 .. x2.2 (curve)": lambda n, r: n.startswith("trellis x"),
        "kvfetcher basis (layout v5, uniform rounding): its balanced's steps x0.7 .. x2 (curve)": lambda n, r: n.startswith("basis x"),
        "kvfetcher per-channel profile x0.7 .. x2 (v3 curve)": lambda n, r: n.startswith("profile x") and "," not in n,
        "kvfetcher, other (flat = one step for all layers)": lambda n, r: not r.get("preset") and r["kind"] == "kvfetcher"
        and not (n.startswith("profile x") and "," not in n) and not n.startswith(("basis x", "trellis x")),
        "quantisation + zstd": lambda n, r: n.startswith("zstd"),
        "CacheGen (LMCache 0.5.6, size estimated)": lambda n, r: n == "cachegen",
    }
    for (label, pick), marker in zip(groups.items(), "oP*^vsD"):
        sel = sorted(((n, r) for n, r in res["points"].items() if pick(n, r)), key=lambda x: x[1]["ratio_vs_fp16"])
        if not sel:
            continue
        xs = [r["ratio_vs_fp16"] for _, r in sel]
        for ax, key in zip(axes, ("greedy_agreement", "kl")):
            ax.plot(xs, [r[key] for _, r in sel], marker=marker, linestyle="-" if "curve" in label else "none", label=label)
            for (n, r), x in zip(sel, xs):
                if not ((n.startswith("profile x") and "," not in n) or n.startswith(("basis x", "trellis x"))):
                    ax.annotate(n, (x, r[key]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    axes[0].axhline(0.9, color="grey", linewidth=0.5, linestyle="--")
    axes[0].set_ylabel("greedy agreement, 32 tokens (8 prompts)")
    axes[1].set_ylabel("KL of next-token distributions (nats)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.axvline(4, color="grey", linewidth=0.5, linestyle="--")
        ax.set_xlabel("size ratio vs fp16 (headers and side information counted)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="lower right")  # the KL panel has room there
    fig.suptitle(f"{res['model']}: size vs accuracy ({res['device']}, {res['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(OUT / "result_cpu.png", dpi=120)


if __name__ == "__main__":
    sys.exit(main())
