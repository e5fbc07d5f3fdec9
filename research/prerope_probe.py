"""Keys quantised before RoPE: does undoing the rotation make keys cheaper at equal accuracy?

RoPE rotates channel pairs by a position-dependent angle, so a key channel with a large,
steady value before RoPE swings over twice that range after it, and per-channel min/max
quantisation of post-RoPE keys wastes its levels. Here keys are un-rotated with the known
positions (SmolLM2: default RoPE, theta 1e5, rotate-half pairs), quantised per channel over
256-token chunks (first token exact), re-rotated, and judged by greedy agreement over the
shipped prompts; sizes are real libx265 lossless bitstreams plus side information.

    python -m research.prerope_probe k6v8 k5v6 k4v6 k5v4
"""

from __future__ import annotations

import sys

import torch

from kvfetcher.eval import accuracy, model
from kvfetcher.codec import layout
from kvfetcher.codec.base import CodecParams
from kvfetcher.codec.pyav import X265Encoder


def rotation(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions.float()[:, None] * inv[None]
    emb = torch.cat([angles, angles], -1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    return k * cos - rotate_half(k) * sin if inverse else k * cos + rotate_half(k) * sin


def main(points: list[str]) -> int:
    lm = model.load()
    theta = lm.config.rope_parameters["rope_theta"] if hasattr(lm.config, "rope_parameters") else lm.config.rope_theta
    cases = []
    for n, o in accuracy.PROMPTS:
        ids, _ = accuracy.prompt_ids(lm, n, o, 512)
        kv = model.prefill(lm, ids)[0].half()
        cases.append((ids, kv, model.greedy(lm, ids, kv, 32)))
    layers, _, _, tokens, head_dim = cases[0][1].shape
    cos, sin = rotation(torch.arange(tokens), head_dim, theta)
    for point in points:
        kb, vb = int(point[1]), int(point[3])
        p = layout.LayoutParams(mode="quant", bits_map=((kb, vb),) * layers)
        agree, stored, fp16 = [], 0, 0
        for ids, kv, orig in cases:
            x = kv.float()
            x[:, 0] = rope(x[:, 0], cos, sin, inverse=True)
            x = x.half()
            parts = []
            for s in range(0, tokens, 256):
                piece = x[:, :, :, s : s + 256].contiguous()
                pk = layout.pack(piece, p)
                stored += len(X265Encoder().encode(pk.frames, CodecParams())) + pk.side.numel() * 2
                parts.append(layout.unpack(pk.frames, pk.side, piece.shape, piece.dtype, p))
            r = torch.cat(parts, 3).float()
            r[:, 0] = rope(r[:, 0], cos, sin)
            got = model.greedy(lm, ids, r.half(), 32)
            agree.append(sum(a == b for a, b in zip(orig, got)) / 32)
            fp16 += kv.numel() * 2
        print(f"{point} pre-RoPE keys: ratio {fp16 / stored:.2f} agreement {sum(agree) / len(agree):.3f} {agree}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["k6v8", "k5v6"]))
