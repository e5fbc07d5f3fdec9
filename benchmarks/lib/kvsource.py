"""kvsource: Llama-3-8B-shaped KV chunks built from a real model's KV (not random numbers).

Random-weight KV compresses nothing like real KV, so compression ratios measured on it would
mean nothing. Here real KV of the shipped SmolLM2-135M (30 layers, 3 KV heads, head_dim 64)
is tiled into the 8B shape (32 layers, 8 KV heads, head_dim 128): each 8B head takes the
channels of two Smol heads side by side; a Smol head used again is mixed with itself by random
channel-pair rotations, so nothing repeats byte for byte (see :func:`chunks`). Keys are taken back to the
pre-RoPE frame with Smol's RoPE base and rotated again with Llama-3's (500000) over head_dim
128, channel pairs kept together, so the keys have the RoPE structure of the 8B shape (which
the pre-RoPE presets rely on). The statistics are real Smol channels; the 8B model's own KV
would differ, which the results say.

Step 1 (where the small model is, once): ``python -m benchmarks.lib.kvsource --out kvsrc.pt`` saves
the Smol KV (pre-RoPE keys, values; bf16). Step 2 (anywhere): :func:`chunks` tiles it, or
:func:`own_chunks` gives it back at Smol's own shape (where its shipped basis fits).
:func:`synthetic_kv` is the stand-in where values do not matter (timing only).
"""

from __future__ import annotations

import argparse

import torch

from kvfetcher.codec import rope

SHAPE = (32, 2, 8, 256, 128)  # layers, K/V, kv_heads, tokens, head_dim of one chunk
LLAMA3_THETA = 500000.0
TEXTS = ("license.txt", "code.txt")


def synthetic_kv(layers=4, heads=2, tokens=100, head_dim=64, dtype=torch.float16, seed=0) -> torch.Tensor:
    """Per-channel offsets and scales, smooth along tokens plus noise: like RoPE'd keys."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(layers, 2, heads, 1, head_dim, generator=g) * 3
    scale = torch.rand(layers, 2, heads, 1, head_dim, generator=g) + 0.2
    t = torch.arange(tokens).view(1, 1, 1, tokens, 1).float()
    freq = torch.rand(1, 1, 1, 1, head_dim, generator=g) * 0.3
    kv = base + scale * (torch.sin(t * freq) + 0.3 * torch.randn(layers, 2, heads, tokens, head_dim, generator=g))
    return kv.to(dtype)


def save_source(out: str, tokens: int = 256) -> None:
    """Real Smol KV of ``tokens`` tokens of each shipped text -> ``out`` (keys un-rotated)."""
    from kvfetcher.eval import model

    lm = model.load()
    theta = model.rope_theta(lm)
    parts = []
    for name in TEXTS:
        ids = model.tokenize(lm, model.sample_text(name), tokens)
        kv = model.prefill(lm, ids)[0].clone()  # [30, 2, 3, T, 64] float32, keys after RoPE
        cos, sin = rope.rotation(0, tokens, kv.shape[-1], theta)
        kv[:, 0] = rope.apply(kv[:, 0], cos, sin, inverse=True)
        parts.append(kv.to(torch.bfloat16))
    torch.save({"kv": torch.stack(parts), "texts": TEXTS, "source_theta": theta, "model": lm.fingerprint}, out)


def chunks(src: dict, n: int, dtype: torch.dtype = torch.bfloat16, start: int = 0) -> list[torch.Tensor]:
    """``n`` distinct 8B-shaped chunks ``SHAPE`` (post-RoPE keys at positions ``start..``).

    An 8B chunk has 512 half-heads of 64 channels per K and V; one Smol text gives 90 real
    ones (30 layers x 3 heads). The first use of each is the real channels; later uses mix
    every channel with a random partner channel of the same Smol head by a random rotation
    (a different linear view of the same real head, as another projection would give),
    so no two tiles repeat bytes — a compressor must not find the tiling's copies.
    """
    kv_all = src["kv"].float()  # [texts, 30, 2, 3, T, 64], keys before RoPE
    texts, sl, _, sh, T, sd = kv_all.shape
    L, _, H, CT, D = SHAPE
    assert T >= CT and 2 * sd == D
    cos, sin = rope.rotation(start, CT, D, LLAMA3_THETA)
    out = []
    for v in range(n):
        pool = kv_all[v % texts, :, :, :, :CT].permute(0, 2, 1, 3, 4).reshape(sl * sh, 2, CT, sd)  # [90, K|V, T, 64]
        g = torch.Generator().manual_seed(1000 + v)
        k = torch.arange(L * H * 2)
        halves = pool[(k + 37 * v) % pool.shape[0]].clone()  # [512, 2, T, 64]
        re = halves[pool.shape[0] :]  # reuses: rotate each channel with a partner channel
        perm = torch.rand(re.shape[0], sd, generator=g).argsort(-1).view(-1, 1, 1, sd).expand_as(re)
        ang = (0.3 + 0.9 * torch.rand(re.shape[0], 1, 1, sd, generator=g))
        halves[pool.shape[0] :] = ang.cos() * re + ang.sin() * re.gather(-1, perm)
        a, b = halves.view(L, H, 2, 2, CT, sd).unbind(2)  # the two halves of each 8B head
        half = sd // 2
        keys = torch.cat([a[:, :, 0, :, :half], b[:, :, 0, :, :half], a[:, :, 0, :, half:], b[:, :, 0, :, half:]], -1)
        vals = torch.cat([a[:, :, 1], b[:, :, 1]], -1)
        c = torch.stack([rope.apply(keys, cos, sin), vals], 1)  # [L, 2, H, T, D]
        out.append(c.to(dtype).contiguous())
    return out


def own_chunks(src: dict, n: int, tokens: int = SHAPE[3], dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """``n`` distinct chunks at the source model's own shape ``[30, 2, 3, tokens, 64]``, keys
    rotated with its own RoPE base (``source_theta``) at positions ``tokens * i..``, as a
    server of that model would store them, so its shipped basis and pre-RoPE presets apply.

    Chunk ``i`` is piece ``i // texts`` of text ``i % texts``: a source of 256 tokens per text
    has as many distinct chunks as texts, and asking for more is an error, not a repeat.
    """
    kv_all = src["kv"].float()  # [texts, L, 2, H, T, D], keys before RoPE
    texts, T = kv_all.shape[0], kv_all.shape[4]
    if n > texts * (T // tokens):
        raise ValueError(f"the source has {texts * (T // tokens)} distinct {tokens}-token chunks, not {n}")
    out = []
    for i in range(n):
        piece = i // texts
        c = kv_all[i % texts, :, :, :, piece * tokens : (piece + 1) * tokens].clone()
        cos, sin = rope.rotation(i * tokens, tokens, c.shape[-1], src["source_theta"])
        c[:, 0] = rope.apply(c[:, 0], cos, sin)
        out.append(c.to(dtype).contiguous())
    return out


def real_chunks(src: dict, n: int, layers: int = SHAPE[0], dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """``n`` distinct consecutive chunks (chunk ``i`` at positions ``256 i..``) of ``layers`` layers.

    More layers than the 8B shape's 32 (the 70B shape has 80) are stacked from further
    distinct 8B chunks of the same positions, so no layer repeats another's bytes.
    """
    per = -(-layers // SHAPE[0])
    return [torch.cat(chunks(src, per * (i + 1), dtype, start=i * SHAPE[3])[per * i :], 0)[:layers].contiguous() for i in range(n)]


def gpu_chunks(path: str, distinct: int) -> tuple[list, str]:
    """``distinct`` fp16 chunks of 8B shape on the GPU: real KV from ``path`` (tiled to the shape),
    else synthetic KV; and a description of which (synthetic KV's ratios mean nothing)."""
    try:
        src = torch.load(path)
    except FileNotFoundError:
        L, _, H, T, D = SHAPE
        return [synthetic_kv(L, H, T, D, torch.float16, seed=i).cuda() for i in range(distinct)], "synthetic (no --kvsrc): ratios mean nothing"
    return [c.to(torch.float16).cuda() for c in chunks(src, distinct, torch.float16)], f"real ({path}), tiled to Llama-3-8B's shape"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    save_source(a.out, a.tokens)

