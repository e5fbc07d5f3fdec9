"""Probes behind the layout choices of sigma_steps (what helped, what did not), on real KV.

No model runs here except for the margins probe; each probe quantises real chunks (SmolLM2-135M,
512-token prompts, first 256-token chunk, keys before RoPE, first token exact) and codes them:

* ``lossy``: lossless HEVC on a coarse step vs lossy HEVC (the codec's QP) on a fine one, at
  equal error (RMS in channel standard deviations) — which is cheaper in bits?
* ``layout``: the same balanced-like symbols under 4:4:4 vs 4:2:0 (luma only), frame height,
  tokens vs channels as rows, x265 speed presets — bits per value against their entropy.
* ``coders``: entropy of the symbols vs x265 lossless vs zstd -19 at three rates.
* ``margins``: the reference model's top-1 vs top-2 logit margin along the greedy
  continuation of each prompt: where a margin is ~0.01, any lossy cache flips that token.

    python -m research.compression_probes [lossy layout coders margins]

Prints its findings (research/results/compression_probes.txt holds a run).
"""

from __future__ import annotations

import sys

import torch
import zstandard

from kvfetcher.eval import accuracy, model
from kvfetcher import codec
from kvfetcher.codec import layout, rope
from kvfetcher.format import presets
from kvfetcher.codec.base import CodecParams
from kvfetcher.codec import tiling


def tiles_prerope(kv: torch.Tensor, theta: float) -> torch.Tensor:
    """One chunk (from position 0) -> ``[layers, 2, tokens-1, channels]`` float, keys un-rotated."""
    x = kv.float().clone()
    cos, sin = rope.rotation(0, x.shape[3], x.shape[4], theta)
    x[:, 0] = rope.apply(x[:, 0], cos, sin, inverse=True)
    L, _, H, T, D = x.shape
    return x[:, :, :, 1:].permute(0, 1, 3, 2, 4).reshape(L, 2, T - 1, H * D)


def normalised(t: torch.Tensor) -> torch.Tensor:
    return (t - t.mean(2, keepdim=True)) / t.std(2, keepdim=True, correction=0).clamp_min(1e-8)


def entropy(sym: torch.Tensor) -> float:
    """Mean over channels of the empirical entropy along tokens: ``sym`` int in 0..255 ``[..., T, C]``."""
    s = sym.long().reshape(-1, sym.shape[-2], sym.shape[-1])
    counts = torch.zeros(s.shape[0], s.shape[2], 256)
    counts.scatter_add_(2, s.transpose(1, 2), torch.ones(s.shape[0], s.shape[2], s.shape[1]))
    p = counts / s.shape[1]
    return float(-(p * torch.where(p > 0, p.log2(), torch.zeros_like(p))).sum(-1).mean())


def hevc(tiles: torch.Tensor, lossless: bool = True, qp: int | None = None, planes: int = 3, max_rows: int = 1024,
         speed: str = "fast") -> tuple[int, torch.Tensor]:
    """uint8 tiles ``[n, rows, cols]`` -> (bytes, decoded tiles), frames stacked as the layout does."""
    n, rows, cols = tiles.shape
    geo = layout.geometry((n // 2, 2, 1, rows, cols), torch.float16, layout.LayoutParams(mode="quant", planes=planes, max_rows=max_rows))
    frames = tiling.tiles_to_frames(tiles, geo)
    enc, dec = codec.encoder("hevc"), codec.decoder("hevc", "cpu")
    size, out = 0, []
    step = max(1, 12 // planes)
    for a in range(0, frames.shape[0], step):
        data = enc.encode(frames[a : a + step], CodecParams(lossless=lossless, qp=qp, speed=speed))
        size += len(data)
        out.append(dec.decode(data, tuple(frames[a : a + step].shape)))
    return size, tiling.frames_to_tiles(torch.cat(out), geo, rows, cols)


def probe_lossy(kvs, theta) -> None:
    z = normalised(tiles_prerope(kvs[0], theta)).reshape(-1, 255, 192)
    n = z.numel()
    print("lossless on a coarse step vs lossy QP on a fine one (bits/value, RMS error in sigmas)")
    for d in (0.5, 0.35, 0.25):
        q = torch.round(z / d).clamp(-128, 127)
        size, _ = hevc((q + 128).to(torch.uint8))
        print(f"  lossless step {d}: {size * 8 / n:.2f} bits, rms {float(((q * d - z) ** 2).mean().sqrt()):.3f}")
    sym = (torch.round(z * 16) + 128).clamp(0, 255).to(torch.uint8)  # step 1/16 sigma, +-8 sigma
    for qp in (16, 20, 24):
        size, back = hevc(sym, lossless=False, qp=qp)
        rec = (back.float() - 128) / 16
        print(f"  lossy QP{qp} on 1/16-sigma samples: {size * 8 / n:.2f} bits, rms {float(((rec - z) ** 2).mean().sqrt()):.3f}")


def balanced_symbols(kvs, theta, scale: float = 1.0) -> list[torch.Tensor]:
    steps = torch.tensor(presets.get("balanced").layout.sigma_steps) * scale  # [L, 2]
    out = []
    for kv in kvs:
        z = normalised(tiles_prerope(kv, theta))
        q = torch.round(z / steps[:, :, None, None]).clamp(-128, 127)
        out.append((q + 128).to(torch.uint8).reshape(-1, z.shape[2], z.shape[3]))
    return out


def probe_layout(kvs, theta) -> None:
    syms = balanced_symbols(kvs, theta)
    n = sum(s.numel() for s in syms)
    print(f"layout variants on balanced's symbols (entropy {sum(entropy(s) * s.numel() for s in syms) / n:.3f} bits/value)")
    variants = [("4:4:4, 1024-row planes, fast", {}), ("4:2:0 (luma only)", dict(planes=1)),
                ("256-row planes", dict(max_rows=256)), ("2048-row planes", dict(max_rows=2048)),
                ("channels as rows", dict(transpose=True)), ("x265 medium", dict(speed="medium")),
                ("x265 ultrafast", dict(speed="ultrafast"))]
    for label, kw in variants:
        tr = kw.pop("transpose", False)
        size = sum(hevc(s.transpose(1, 2).contiguous() if tr else s, **kw)[0] for s in syms)
        print(f"  {label}: {size * 8 / n:.3f} bits/value")


def probe_coders(kvs, theta) -> None:
    zc = zstandard.ZstdCompressor(level=19)
    print("entropy vs x265 lossless vs zstd -19 (bits/value)")
    for scale in (1.0, 2.0, 4.0):
        syms = balanced_symbols(kvs, theta, scale)
        n = sum(s.numel() for s in syms)
        e = sum(entropy(s) * s.numel() for s in syms) / n
        x = sum(hevc(s)[0] for s in syms) * 8 / n
        zs = sum(len(zc.compress(s.numpy().tobytes())) for s in syms) * 8 / n
        print(f"  balanced steps x{scale}: entropy {e:.2f}, x265 {x:.2f}, zstd {zs:.2f}")


@torch.inference_mode()
def probe_margins(lm) -> None:
    print("smallest top-1/top-2 logit margins along the reference greedy continuation (position: margin)")
    for name, off in accuracy.PROMPTS:
        ids, _ = accuracy.prompt_ids(lm, name, off, 512)
        kv = model.prefill(lm, ids)[0].half()
        g = model.greedy(lm, ids, kv, 32)
        cache = model.to_cache(kv[:, :, :, : len(ids) - 1].float())
        feed = torch.cat([ids[-1:], torch.tensor(g[:-1])]).unsqueeze(0)
        top = lm.model(feed, past_key_values=cache, use_cache=True).logits[0].float().topk(2, -1).values
        m = (top[:, 0] - top[:, 1]).tolist()
        low = sorted(range(len(m)), key=lambda i: m[i])[:3]
        print(f"  {name}@{off}: " + ", ".join(f"{i}: {m[i]:.3f}" for i in sorted(low)))


def main() -> int:
    torch.set_num_threads(1)
    which = sys.argv[1:] or ["lossy", "layout", "coders", "margins"]
    lm = model.load()
    theta = model.rope_theta(lm)
    kvs = []
    for name, off in (accuracy.PROMPTS[0], accuracy.PROMPTS[3], accuracy.PROMPTS[6]):
        ids, _ = accuracy.prompt_ids(lm, name, off, 512)
        kvs.append(model.prefill(lm, ids)[0].half()[:, :, :, :256].contiguous())
    for w in which:
        {"lossy": lambda: probe_lossy(kvs, theta), "layout": lambda: probe_layout(kvs, theta),
         "coders": lambda: probe_coders(kvs, theta), "margins": lambda: probe_margins(lm)}[w]()
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
