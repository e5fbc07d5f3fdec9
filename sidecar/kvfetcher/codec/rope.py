"""rope: rotary position embedding, undone and redone, so keys can be quantised before it.

RoPE rotates each channel pair of a key by an angle that grows with the token's position. A
key channel with a large, steady value before RoPE therefore swings over twice that value
after it, and per-channel quantisation ranges pay for the swing. So keys are quantised in the
pre-RoPE frame (positions are known at store time, and the container header carries them).

Default RoPE as in Llama-family models: inverse frequencies ``theta ** (-2i / head_dim)`` over
the whole head dimension, the two halves of the head as the pairs ("rotate half"). A model may
use another base per layer (Gemma 3: 10 000 on sliding-window layers, 1 000 000 on global ones):
a layout's ``rope_theta`` is then one base per layer (:func:`per_layer`), and keys are rotated
layer by layer with their own base (:func:`apply_layers`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

Theta = float | tuple[float, ...]  # one base for every layer, or one per layer


def rotation(start: int | torch.Tensor, tokens: int, head_dim: int, theta: float,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, ``[tokens, head_dim]`` float32, for positions ``start .. start + tokens - 1``;
    ``start`` an int or a 0-dim tensor on ``device`` (which a CUDA graph reads at each replay)."""
    inv = _inverse_frequencies(float(theta), head_dim, str(torch.device(device)))
    angles = (torch.arange(tokens, device=device, dtype=torch.float64) + start)[:, None] * inv[None]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().float(), emb.sin().float()


@functools.lru_cache(maxsize=32)
def _inverse_frequencies(theta: float, head_dim: int, device: str) -> torch.Tensor:
    """``1 / theta ** (2i / head_dim)`` float64, made once per base, head size and device (every
    chunk restored or stored makes a rotation). Shared: do not modify it."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate (or, with ``inverse``, un-rotate) float keys ``[..., tokens, head_dim]``; into ``out``
    if given (``keys`` itself may be ``out``)."""
    a, b = keys * cos, _rotate_half(keys) * sin
    return torch.sub(a, b, out=out) if inverse else torch.add(a, b, out=out)


def per_layer(theta: Theta, layers: int) -> tuple[float, ...]:
    """One base per layer: a single base repeated, or the per-layer bases (there must be ``layers``)."""
    if isinstance(theta, (int, float)):
        return (float(theta),) * layers
    if len(theta) != layers:
        raise ValueError(f"{len(theta)} RoPE bases for {layers} layers")
    return tuple(float(t) for t in theta)


def apply_layers(keys: torch.Tensor, start: int | torch.Tensor, theta: Theta, inverse: bool = False,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate (or un-rotate) float keys ``[layers, ..., tokens, head_dim]`` of positions
    ``start ..``, each layer with its own base; layers sharing a base share one rotation table.
    Into ``out`` if given (``keys`` itself may be ``out``: no copy of the keys is made then)."""
    layers, tokens, head_dim = keys.shape[0], keys.shape[-2], keys.shape[-1]
    bases = per_layer(theta, layers)
    if len(set(bases)) == 1:
        return apply(keys, *rotation(start, tokens, head_dim, bases[0], keys.device), inverse, out=out)
    out = torch.empty_like(keys) if out is None else out
    for t in dict.fromkeys(bases):
        idx = [i for i, b in enumerate(bases) if b == t]
        out[idx] = apply(keys[idx], *rotation(start, tokens, head_dim, t, keys.device), inverse)
    return out


def compact(thetas: Sequence[float]) -> Theta:
    """The header's form of per-layer bases: one number when every layer shares it."""
    ts = tuple(float(t) for t in thetas)
    return ts[0] if len(set(ts)) == 1 else ts
