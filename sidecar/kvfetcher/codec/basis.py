"""basis: a per-model linear transform of each head's channels, so fewer bits buy the same accuracy.

Quantising every channel with a step of ``s`` of its own standard deviation (``sigma_steps``)
spends the same bits on every channel, whether or not the model cares about its error and
whether or not it is redundant with its neighbours. What the model sees of a key error ``dk``
is the logit error ``q . dk``, and of a value error ``dv`` the output ``W_o dv``: an error of
weighted size ``dk^T W dk`` with ``W = E[q q^T]`` (keys) or ``W_o^T W_o`` (values), per KV head.
Transform coding in that metric (the KLT of ``W^1/2 C W^1/2``, ``C`` the channels' covariance)
with one uniform step for every component gives the least weighted error per bit. It pays
most for pre-RoPE keys, which are strongly correlated and whose queries' energy is
concentrated; a basis calibrated on some texts keeps most of its gain on others.

A basis is ``enc`` and ``dec``, ``[layers, 2, kv_heads, head_dim, head_dim]`` with
``dec = enc^-1``, and ``mean`` ``[layers, 2, kv_heads, head_dim]``: the layout codes
``y = enc @ x - mean`` per head and restores ``x = dec @ (y + mean)``. The mean (of the
calibration KV) keeps the per-chunk offsets small: some components sit thousands of steps from
zero (pre-RoPE keys' massive channels), where an fp16 offset could not place the quantisation
grid within a step, and near-constant components would come back off by up to half a step
for every token of a chunk. A basis is calibrated once per model (``kvfetcher calibrate``) and
kept as data under a content-derived name, which the model's calibration names
(format/calibration.py): shipped in the package, or in the local calibration directory
(``KVFETCHER_CALIBRATION_DIR``); a per-chunk basis would cost ``head_dim**2`` values per head
and chunk.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfetcher.codec import rope
from kvfetcher.config import CALIBRATION_DIR

#: Where shipped bases live: ``<name>.pt``; a name ends in the first 12 hex digits of its sha256.
BASES_DIR = Path(__file__).parent.parent / "data" / "bases"


def path_of(name: str) -> Path | None:
    """The file of basis ``name``: shipped, else in the local calibration directory; None if neither."""
    for d in (BASES_DIR, Path(CALIBRATION_DIR.read())):
        p = d / f"{name}.pt"
        if p.is_file():
            return p
    return None


@dataclass(frozen=True)
class Basis:
    name: str
    enc: torch.Tensor  # [L, 2, H, D, D] float32: y = enc @ x - mean (per head)
    dec: torch.Tensor  # [L, 2, H, D, D] float32: x = dec @ (y + mean)
    mean: torch.Tensor  # [L, 2, H, D] float32

    @property
    def shape(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) of the KV it fits."""
        return (self.enc.shape[0], self.enc.shape[2], self.enc.shape[3])


def key_metric(queries: list[torch.Tensor], kv_heads: int, theta: float, deltas: list[int],
               weights: list[torch.Tensor] | None = None) -> torch.Tensor:
    """``E[(R_d q)(R_d q)^T]`` over queries and relative offsets ``d``: ``[kv_heads, D, D]``.

    ``queries``: pre-RoPE ``[tokens, q_heads, D]`` of one layer; the query heads of a group share
    a KV head (GQA). A pre-RoPE key at position n meets a query at m through ``R_(m-n)``, so its
    error's metric averages the query over the offsets it will be seen at. ``weights``
    (``[tokens, q_heads]`` per entry) weigh each query, e.g. by how far a logit error moves the
    layer's output.
    """
    d = queries[0].shape[-1]
    g = queries[0].shape[1] // kv_heads
    m = torch.zeros(kv_heads, d, d, dtype=torch.float64)  # sum over queries of q q^T, per KV head
    n = 0
    for i, q in enumerate(queries):
        q = q.double()
        if weights is not None:
            q = q * weights[i].double().sqrt().unsqueeze(-1)
        q = q.reshape(q.shape[0], kv_heads, g, d)
        m += torch.einsum("thgd,thge->hde", q, q)
        n += q.shape[0]
    w = torch.zeros_like(m)
    for delta in deltas:  # R m R^T: rotate the rows, then the columns (m is symmetric)
        cos, sin = rope.rotation(int(delta), 1, d, theta)
        w += rope.apply(rope.apply(m, cos.double(), sin.double()).transpose(-1, -2), cos.double(), sin.double())
    return w / (n * len(deltas))


def value_metric(o_proj: torch.Tensor, kv_heads: int, head_dim: int, head_weights: torch.Tensor | None = None) -> torch.Tensor:
    """``W_o^T W_o`` over the query heads that read each KV head: ``[kv_heads, D, D]``;
    ``head_weights`` ``[q_heads]`` (e.g. ``E[sum_t a_t^2]``) weigh each query head's share."""
    hidden, width = o_proj.shape
    g = width // (kv_heads * head_dim)
    w = o_proj.detach().double().view(hidden, kv_heads, g, head_dim)
    if head_weights is not None:
        w = w * head_weights.double().view(1, kv_heads, g, 1).sqrt()
    return torch.einsum("ohgd,ohge->hde", w, w)


def covariance(xs: list[torch.Tensor]) -> torch.Tensor:
    """Channel covariance ``[H, D, D]`` of ``[H, T, D]`` samples, each centred on its own mean
    (the layout stores a mean per chunk, so only variation within a chunk is coded)."""
    c, n = 0.0, 0
    for x in xs:
        x = x.double() - x.double().mean(1, keepdim=True)
        c = c + x.transpose(1, 2) @ x
        n += x.shape[1]
    return c / n


def transform(metric: torch.Tensor, cov: torch.Tensor, ridge: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """(enc, dec) per head: ``enc = U^T W^1/2`` with U the eigenvectors of ``W^1/2 C W^1/2``,
    components in decreasing variance. ``ridge`` (times the mean eigenvalue of W) keeps every
    direction representable, so dec stays bounded where calibration queries had no energy."""
    w = metric + ridge * metric.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * torch.eye(metric.shape[-1], dtype=metric.dtype)
    e, v = torch.linalg.eigh(w)
    ws = (v * e.sqrt().unsqueeze(-2)) @ v.transpose(-1, -2)
    wsi = (v * e.rsqrt().unsqueeze(-2)) @ v.transpose(-1, -2)
    _, u = torch.linalg.eigh(ws @ cov @ ws)
    u = u.flip(-1)
    return u.transpose(-1, -2) @ ws, wsi @ u


def normalise_heads(metric: torch.Tensor) -> torch.Tensor:
    """Scale a (layer, kind)'s metrics so their mean trace is the head dimension: steps stay in
    the units of channel standard deviations, relative weights of heads are kept."""
    return metric * metric.shape[-1] / metric.diagonal(dim1=-2, dim2=-1).sum(-1).mean()


def build(model_tag: str, enc: torch.Tensor, mean: torch.Tensor) -> Basis:
    """A named basis from ``enc`` ``[L, 2, H, D, D]`` (stored as fp16; dec is the float64
    inverse of the stored enc) and ``mean`` ``[L, 2, H, D]`` (float32); the name's digest
    covers both."""
    e16 = enc.detach().to(torch.float16).contiguous()
    m32 = mean.detach().to(torch.float32).contiguous()
    # one matrix at a time: torch 2.13's batched CPU inverse failed on Gemma 3's 36 bases with 2
    # threads ("pivots given to lu_solve ..."), each of them invertible and inverted alone
    flat = e16.double().reshape(-1, *e16.shape[-2:])
    dec = torch.stack([torch.linalg.inv(m) for m in flat]).reshape(e16.shape).float()
    digest = hashlib.sha256(e16.numpy().tobytes() + m32.numpy().tobytes()).hexdigest()[:12]
    return Basis(f"{model_tag}-{digest}", e16.float(), dec, m32)


def save(b: Basis, directory: Path = BASES_DIR) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{b.name}.pt"
    torch.save({"name": b.name, "enc": b.enc.to(torch.float16), "mean": b.mean}, path)
    return path


def verify_file(path: Path, name: str) -> Basis:
    """The basis in ``path``; ``ValueError`` unless its content matches ``name``'s digest."""
    try:
        d = torch.load(path, weights_only=True)
        b = build(name.rsplit("-", 1)[0], d["enc"], d["mean"])
    except Exception as e:  # a file that is not a basis at all
        raise ValueError(f"basis file {path} is not a basis: {e}") from None
    if b.name != name:
        raise ValueError(f"basis file {path} does not match its name (content {b.name})")
    return b


@functools.lru_cache(maxsize=8)
def load(name: str) -> Basis:
    """A basis by name (shipped or local); its content must match the name's digest."""
    path = path_of(name)
    if path is None:
        raise ValueError(f"unknown basis {name!r} (looked in {BASES_DIR} and {CALIBRATION_DIR.read()})")
    return verify_file(path, name)


@functools.lru_cache(maxsize=16)
def on_device(name: str, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(enc, dec, mean) of a shipped basis on ``device``, loaded and moved once."""
    b = load(name)
    return b.enc.to(device), b.dec.to(device), b.mean.to(device)


def tag_of(model: str) -> str:
    """A model's name (or fingerprint) as a calibration tag, one path component: ``/`` becomes ``--``."""
    return model.replace("/", "--")


def is_for(tag: str, fingerprint: str) -> bool:
    """Whether what is tagged ``tag`` was made for the model ``fingerprint`` names: its tag starts with it."""
    return bool(tag) and tag_of(fingerprint).startswith(tag)


def fits(name: str, shape: tuple[int, ...], fingerprint: str) -> bool:
    """Whether basis ``name`` was made for this model (:func:`is_for` its tag) and
    this KV shape ``[layers, 2, kv_heads, tokens, head_dim]``; unknown names do not fit."""
    if not is_for(name.rsplit("-", 1)[0], fingerprint):
        return False
    try:
        b = load(name)  # cached: no file is looked at once it is loaded (asked for every chunk stored)
    except ValueError:
        if path_of(name) is None:
            return False
        raise
    return b.shape == (shape[0], shape[2], shape[4])


def available() -> list[str]:
    return sorted(p.stem for p in BASES_DIR.glob("*.pt"))
