"""llama8b: a minimal Llama-3-8B-shaped model in plain torch, random bf16 weights (timing only).

Why our own: the TTFT race needs (a) a prefill that writes its KV into the same
``[layers, 2, kv_heads, tokens, head_dim]`` buffer the fetcher restores into, (b) one decode
step reading that buffer, and (c) a batched decode step that can be captured in a CUDA graph,
as serving engines run decode. Same shapes and kernels as transformers' Llama with SDPA:
RMSNorm, RoPE (theta 500000), grouped-query attention (K/V repeated to the query heads for the
causal prefill, flash SDPA), SwiGLU MLP; logits only for the last position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Config:
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    hidden: int = 4096
    intermediate: int = 14336
    vocab: int = 128256
    rope_theta: float = 500000.0
    eps: float = 1e-5


class Llama:
    def __init__(self, cfg: Config = Config(), device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        g = torch.Generator(device=self.device).manual_seed(seed)

        def w(*shape):
            return (torch.randn(*shape, device=self.device, dtype=dtype, generator=g) * 0.02).contiguous()

        c = cfg
        self.embed = w(c.vocab, c.hidden)
        self.lm_head = w(c.vocab, c.hidden)
        self.norm = torch.ones(c.hidden, device=self.device, dtype=dtype)
        self.blocks = []
        for _ in range(c.layers):
            self.blocks.append(
                {
                    "ln1": torch.ones(c.hidden, device=self.device, dtype=dtype),
                    "ln2": torch.ones(c.hidden, device=self.device, dtype=dtype),
                    "qkv": w((c.heads + 2 * c.kv_heads) * c.head_dim, c.hidden),
                    "o": w(c.hidden, c.heads * c.head_dim),
                    "gate_up": w(2 * c.intermediate, c.hidden),
                    "down": w(c.hidden, c.intermediate),
                }
            )
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, device=self.device, dtype=torch.float32) / c.head_dim))
        self.inv_freq = inv

    def kv_buffer(self, capacity: int, batch: int | None = None) -> torch.Tensor:
        """``[layers, 2, kv_heads, capacity, head_dim]`` (or with a batch axis after the 2)."""
        c = self.cfg
        shape = (c.layers, 2, c.kv_heads, capacity, c.head_dim) if batch is None else (c.layers, 2, batch, c.kv_heads, capacity, c.head_dim)
        return torch.zeros(shape, device=self.device, dtype=self.dtype)

    def _rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ang = pos.float()[:, None] * self.inv_freq[None]
        emb = torch.cat([ang, ang], dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @staticmethod
    def _rot(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * sin

    def _mlp(self, x: torch.Tensor, b: dict) -> torch.Tensor:
        gu = F.linear(F.rms_norm(x, (x.shape[-1],), b["ln2"], self.cfg.eps), b["gate_up"])
        g, u = gu.chunk(2, dim=-1)
        return x + F.linear(F.silu(g) * u, b["down"])

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Recompute: run ``ids`` [T] from position 0, write their KV into ``kv[..., :T, :]``,
        return the last position's logits."""
        c, T = self.cfg, ids.shape[0]
        cos, sin = self._rope(torch.arange(T, device=self.device))
        x = self.embed[ids]
        rep = c.heads // c.kv_heads
        for li, b in enumerate(self.blocks):
            qkv = F.linear(F.rms_norm(x, (c.hidden,), b["ln1"], c.eps), b["qkv"]).view(T, -1, c.head_dim).transpose(0, 1)
            q, k, v = qkv.split([c.heads, c.kv_heads, c.kv_heads], dim=0)
            q, k = self._rot(q, cos, sin), self._rot(k, cos, sin)
            kv[li, 0, :, :T].copy_(k)
            kv[li, 1, :, :T].copy_(v)
            k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
            a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
            x = x + F.linear(a.transpose(0, 1).reshape(T, -1), b["o"])
            x = self._mlp(x, b)
        x = F.rms_norm(x[-1:], (c.hidden,), self.norm, c.eps)
        return F.linear(x, self.lm_head)[0]

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, pos: torch.Tensor, kv: torch.Tensor, ctx: int) -> torch.Tensor:
        """One decode step for a batch: ``ids`` [B] at positions ``pos`` [B]; ``kv`` is
        ``[layers, 2, B, kv_heads, capacity, head_dim]`` holding ``ctx`` cached tokens each. The new
        token's K/V goes to slot ``ctx`` and attention covers slots ``0..ctx`` (fixed shapes, so
        the step can be captured in a CUDA graph). Returns the next token ids (greedy)."""
        c, B = self.cfg, ids.shape[0]
        cos, sin = self._rope(pos)
        cos, sin = cos[:, None], sin[:, None]
        x = self.embed[ids]
        for li, b in enumerate(self.blocks):
            qkv = F.linear(F.rms_norm(x, (c.hidden,), b["ln1"], c.eps), b["qkv"]).view(B, -1, c.head_dim)
            q, k, v = qkv.split([c.heads, c.kv_heads, c.kv_heads], dim=1)
            q, k = self._rot(q, cos, sin), self._rot(k, cos, sin)
            kv[li, 0, :, :, ctx].copy_(k)
            kv[li, 1, :, :, ctx].copy_(v)
            K, V = kv[li, 0, :, :, : ctx + 1], kv[li, 1, :, :, : ctx + 1]
            a = F.scaled_dot_product_attention(q[:, :, None], K, V, enable_gqa=True)
            x = x + F.linear(a.reshape(B, -1), b["o"])
            x = self._mlp(x, b)
        x = F.rms_norm(x, (c.hidden,), self.norm, c.eps)
        return F.linear(x, self.lm_head).argmax(-1)

    @torch.inference_mode()
    def first_token(self, kv: torch.Tensor, ctx: int, token: int = 1) -> torch.Tensor:
        """After a fetch: one decode step of the next token over ``ctx`` restored tokens in a
        ``[layers, 2, kv_heads, capacity, head_dim]`` buffer (capacity > ctx): its logits exist."""
        ids = torch.tensor([token], device=self.device)
        pos = torch.tensor([ctx], device=self.device)
        return self.step(ids, pos, kv.unsqueeze(2), ctx)
