"""llama_shape: a Llama-3-shaped model with random bf16 weights, for timing prefill and decode.

Only the shape matters for time: RMSNorm, RoPE, GQA attention through SDPA (flash / memory-
efficient kernels on CUDA), a SwiGLU MLP and the LM head, as Llama-3 has them. ``layers``
overrides the depth so that a contiguous subset of a 70B model's layers fits one GPU; time and
KV then scale by the layer count (``costmodel.kv_bytes`` exactly; prefill time is k layers' time
x total/k, plus embedding and head once: :func:`sweep_prefill` times subsets, :func:`full_depth`
scales them).

KV lives in caller-owned buffers in kvfetcher's layout ``[layers, 2, kv_heads, capacity,
head_dim]`` — the very buffers ``pipeline.fetch`` writes into — one per request, stacked as a
pool ``[slots, layers, 2, kv_heads, capacity, head_dim]`` for batched decode steps.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F

from kvfetcher.eval.costmodel import SHAPES, ModelShape

__all__ = ["SHAPES", "ModelShape", "LlamaShape", "subset", "time_prefill", "sweep_prefill", "full_depth"]


def subset(shape: ModelShape, layers: int) -> ModelShape:
    """The same shape with ``layers`` layers (a contiguous subset: all layers are alike here)."""
    return dataclasses.replace(shape, layers=layers)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class LlamaShape(torch.nn.Module):
    def __init__(self, shape: ModelShape, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0):
        super().__init__()
        self.shape, self.dtype, self.device = shape, dtype, torch.device(device)
        g = torch.Generator(device=self.device).manual_seed(seed)
        s = shape

        def w(*dims: int) -> torch.Tensor:
            return (torch.randn(*dims, generator=g, device=self.device, dtype=torch.float32) * dims[-1] ** -0.5).to(dtype)

        self.embed = w(s.vocab, s.hidden)
        self.head = w(s.vocab, s.hidden)
        self.norm = torch.ones(s.hidden, device=self.device, dtype=dtype)
        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.layers = [
            {
                "ln1": torch.ones(s.hidden, device=self.device, dtype=dtype),
                "ln2": torch.ones(s.hidden, device=self.device, dtype=dtype),
                "qkv": w(qkv, s.hidden),
                "o": w(s.hidden, s.heads * s.head_dim),
                "gate_up": w(2 * s.intermediate, s.hidden),
                "down": w(s.hidden, s.intermediate),
            }
            for _ in range(s.layers)
        ]
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, device=self.device, dtype=torch.float32) / s.head_dim))
        self._inv_freq = inv

    # -- pieces ---------------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [..., T, D] rotated at positions ``pos`` [T] (or [B, 1, T] for a batch)."""
        ang = pos.float().unsqueeze(-1) * self._inv_freq  # [..., T, D/2]
        cos, sin = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The full output of a row-split projection (``o``, ``down``) from this model's part of it: the
        part itself here; a tensor-parallel shard sums the ranks' parts."""
        return partial

    def _mlp(self, x: torch.Tensor, L: dict) -> torch.Tensor:
        gate, up = (_rms(x, L["ln2"]) @ L["gate_up"].T).chunk(2, dim=-1)
        return x + self._reduce((F.silu(gate) * up) @ L["down"].T)

    def _qkv(self, x: torch.Tensor, L: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        qkv = _rms(x, L["ln1"]) @ L["qkv"].T
        return qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)

    # -- prefill --------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, kv: torch.Tensor, start: int = 0, chunk: int | None = None) -> torch.Tensor:
        """Prefill tokens ``ids`` [T] at positions ``start..start+T`` into ``kv`` [layers, 2, H, cap, D]
        (positions before ``start`` must already be there: a suffix after a fetched prefix).
        ``chunk`` splits a long prefill into pieces (less activation memory). Returns the next token."""
        T = ids.shape[0]
        step = chunk or T
        nxt = None
        for a in range(0, T, step):
            nxt = self._prefill_piece(ids[a : a + step], kv, start + a)
        return nxt

    def _prefill_piece(self, ids: torch.Tensor, kv: torch.Tensor, start: int) -> torch.Tensor:
        s = self.shape
        T = ids.shape[0]
        end = start + T
        pos = torch.arange(start, end, device=self.device)
        x = self.embed[ids]
        mask = None
        if start > 0:  # queries see every earlier position and the causal part of their own piece
            mask = torch.ones(T, end, dtype=torch.bool, device=self.device).tril(diagonal=start)
        for i, L in enumerate(self.layers):
            q, k, v = self._qkv(x, L)
            q = self._rope(q.view(T, s.heads, s.head_dim).transpose(0, 1), pos)
            k = self._rope(k.view(T, s.kv_heads, s.head_dim).transpose(0, 1), pos)
            kv[i, 0, :, start:end] = k
            kv[i, 1, :, start:end] = v.view(T, s.kv_heads, s.head_dim).transpose(0, 1)
            # contiguous K/V: a view of a larger cache made SDPA leave its fused kernels (2.4x slower on an H200)
            keys, vals = kv[i, 0, :, :end].contiguous().unsqueeze(0), kv[i, 1, :, :end].contiguous().unsqueeze(0)
            o = F.scaled_dot_product_attention(q.unsqueeze(0), keys, vals, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
            x = x + self._reduce(o[0].transpose(0, 1).reshape(T, -1) @ L["o"].T)
            x = self._mlp(x, L)
        return (_rms(x[-1:], self.norm) @ self.head.T).argmax(-1)[0]

    # -- decode ---------------------------------------------------------------------------------
    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """One token for each of B requests: ``tokens`` [B] go to position ``lengths`` [B] of
        their caches ``pool[slots]``; returns the next tokens [B]. Attention reads the pool in
        place (no gather): the group of query heads sharing a KV head is laid out as a short
        query sequence against that head, and a length mask hides other requests' padding."""
        s = self.shape
        B = tokens.shape[0]
        group = s.heads // s.kv_heads
        span = int(lengths.max().item()) + 1
        lo, hi = int(slots.min().item()), int(slots.max().item()) + 1
        rows = slots - lo
        seen = torch.zeros(hi - lo, span, dtype=torch.bool, device=self.device)
        seen[rows] = torch.arange(span, device=self.device)[None, :] <= lengths[:, None]
        seen[:, 0] = True  # slots of the span that hold no running request: keep softmax finite
        mask = seen[:, None, None, :]
        x = self.embed[tokens]  # [B, hidden]
        pos = lengths.view(B, 1, 1)
        for i, L in enumerate(self.layers):
            q, k, v = self._qkv(x, L)
            q = self._rope(q.view(B, s.kv_heads, group, s.head_dim), pos.expand(B, s.kv_heads, group))
            k = self._rope(k.view(B, s.kv_heads, 1, s.head_dim), pos.expand(B, s.kv_heads, 1))
            pool[slots, i, 0, :, lengths] = k[:, :, 0]
            pool[slots, i, 1, :, lengths] = v.view(B, s.kv_heads, s.head_dim)
            keys, vals = pool[lo:hi, i, 0, :, :span], pool[lo:hi, i, 1, :, :span]
            qq = torch.zeros(hi - lo, s.kv_heads, group, s.head_dim, dtype=q.dtype, device=self.device)
            qq[rows] = q
            o = F.scaled_dot_product_attention(qq, keys, vals, attn_mask=mask)[rows]  # [B, Hkv, group, D]
            x = x + self._reduce(o.reshape(B, -1) @ L["o"].T)
            x = self._mlp(x, L)
        return (_rms(x, self.norm) @ self.head.T).argmax(-1)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_prefill(model: LlamaShape, tokens: int, repeats: int) -> float:
    kv = torch.empty((model.shape.layers, 2, model.shape.kv_heads, tokens, model.shape.head_dim), dtype=model.dtype, device=model.device)
    ids = torch.randint(0, model.shape.vocab, (tokens,), device=model.device)
    best = float("inf")
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        model.prefill(ids, kv)
        _sync()
        best = min(best, time.perf_counter() - t)
    del kv
    return best


def sweep_prefill(shape, layer_counts, contexts, device) -> dict:
    """{layers: {tokens: seconds}} for each layer count; stops a count at its first OOM."""
    res: dict = {}
    for k in layer_counts:
        model = LlamaShape(subset(shape, k), device)
        time_prefill(model, min(2048, contexts[0]), 2)  # kernels, allocator
        res[k] = {}
        for T in contexts:
            try:
                res[k][T] = time_prefill(model, T, 2 if T <= 32768 else 1)
            except torch.OutOfMemoryError:
                res[k][T] = None
                break
            print(f"prefill {shape.name} layers={k} tokens={T}: {res[k][T]:.3f} s", flush=True)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return res


def full_depth(shape, sweep: dict) -> dict:
    """Prefill of all ``shape.layers`` from two subset depths: fixed + layers x per-layer."""
    (k1, a), (k2, b) = sorted(sweep.items())[:2]
    out = {}
    for T in a:
        if a.get(T) is None or b.get(T) is None:
            continue
        per_layer = (b[T] - a[T]) / (k2 - k1)
        fixed = max(0.0, a[T] - k1 * per_layer)
        out[T] = fixed + shape.layers * per_layer
    return out
