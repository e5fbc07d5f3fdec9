"""rope: rotary position embedding, undone and redone, so keys can be quantised before it.

RoPE rotates each channel pair of a key by an angle that grows with the token's position. A
key channel with a large, steady value before RoPE therefore swings over twice that value
after it, and per-channel quantisation ranges pay for the swing. So keys are quantised in the
pre-RoPE frame (positions are known at store time, and the container header carries them).

Default RoPE as in Llama-family models: inverse frequencies ``theta ** (-2i / head_dim)`` over
the whole head dimension, the two halves of the head as the pairs ("rotate half").
"""

from __future__ import annotations

import torch


def rotation(start: int, tokens: int, head_dim: int, theta: float, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, ``[tokens, head_dim]`` float32, for positions ``start .. start + tokens - 1``."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    angles = torch.arange(start, start + tokens, device=device, dtype=torch.float64)[:, None] * inv[None]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().float(), emb.sin().float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate (or, with ``inverse``, un-rotate) float keys ``[..., tokens, head_dim]``."""
    if inverse:
        return keys * cos - _rotate_half(keys) * sin
    return keys * cos + _rotate_half(keys) * sin
