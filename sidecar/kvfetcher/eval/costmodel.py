"""costmodel: who wins — recompute, a raw fetch or a coded fetch — for a model shape, context,
GPU and link, before anything is run.

Recompute is the prefill's FLOPs over the GPU's effective bf16 rate; the fetch side is
:func:`choice.choose` itself (the same decision the sidecar makes per request), fed with stored
bytes per chunk from each preset's compression ratio and its decode rate. So this module adds
only what ``choice`` cannot know: how expensive a prefill of a given shape is, and how big its
KV is. Pure; the benchmarks check it against timed runs (docs/results.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvfetcher.fetch import choice
from kvfetcher.fetch.prefill import PrefillModel


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer with GQA, a SwiGLU MLP and an untied LM head (Llama-3)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float = 500000.0

    def params_per_layer(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o, k, v
        return attn + 3 * self.hidden * self.intermediate

    def kv_bytes_per_token(self, layers: int | None = None, bytes_per_value: int = 2) -> int:
        return (self.layers if layers is None else layers) * 2 * self.kv_heads * self.head_dim * bytes_per_value


LLAMA3_8B = ModelShape("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256)
LLAMA3_70B = ModelShape("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256)
TINY = ModelShape("tiny", 2, 128, 4, 2, 32, 256, 512, 10000.0)
SHAPES = {s.name: s for s in (LLAMA3_8B, LLAMA3_70B, TINY)}


def kv_bytes(shape: ModelShape, tokens: int, bytes_per_value: int = 2) -> int:
    return tokens * shape.kv_bytes_per_token(bytes_per_value=bytes_per_value)


def prefill_flops(shape: ModelShape, tokens: int) -> tuple[float, float]:
    """(matmul FLOPs, attention FLOPs) of a causal prefill of ``tokens`` tokens.

    Kept apart because they run at different efficiencies: the weights' matmuls grow linearly
    with the context, causal attention (QK^T and PV, half the square) quadratically — which is
    why prefill grows faster than the KV does.
    """
    linear = 2.0 * shape.params_per_layer() * tokens * shape.layers + 2.0 * shape.hidden * shape.vocab
    attention = 2.0 * shape.layers * shape.heads * shape.head_dim * tokens * tokens  # 2 matmuls x 2 FLOP x T^2/2
    return linear, attention


@dataclass(frozen=True)
class Gpu:
    """A GPU's dense bf16 peak and the fraction of it a prefill reaches (fitted to measurements)."""

    name: str
    bf16_tflops: float
    linear_efficiency: float = 0.6
    attention_efficiency: float = 0.45

    def prefill_model(self, shape: ModelShape) -> PrefillModel:
        """:func:`prefill_flops` at this GPU's rates, as the sidecar's prefill model: the LM head
        once per prefill (``c0``), the layers' matmuls per token (``c1``), attention per token and
        token attended (``c2``)."""
        head, one = prefill_flops(shape, 0)[0], prefill_flops(shape, 1)
        linear, attention = (self.bf16_tflops * 1e12 * e for e in (self.linear_efficiency, self.attention_efficiency))
        return PrefillModel(head / linear, (one[0] - head) / linear, 2 * one[1] / attention)  # attention: c2 * T * T / 2

    def prefill_seconds(self, shape: ModelShape, tokens: int) -> float:
        return self.prefill_model(shape).seconds(0, tokens)


@dataclass(frozen=True)
class Representation:
    """A stored form of the KV: bytes stored per KV byte, and KV bytes restored per second."""

    ratio: float  # KV bytes / stored bytes
    decode_Bps: float  # KV bytes restored per second by the whole decode+restore path
    fmt: str = "hevc"


@dataclass(frozen=True)
class Verdict:
    winner: str  # a representation's name, or choice.RECOMPUTE
    seconds: dict[str, float]  # predicted time to a full prefix in the KV buffers, per option
    recompute_s: float

    def speedup_over(self, option: str) -> float:
        """How many times faster the winner is than ``option`` (>= 1 when the winner is chosen)."""
        return self.seconds[option] / self.seconds[self.winner]


def compare(
    shape: ModelShape,
    tokens: int,
    link_Bps: float,
    recompute_s: float,
    reps: Mapping[str, Representation],
    latency_s: float = 0.005,
    chunk_tokens: int = 256,
    allowed: set[str] | None = None,
) -> Verdict:
    """Every option's predicted time for a prefix of ``tokens`` and the one ``choice`` picks."""
    n = max(1, tokens // chunk_tokens)
    chunk_kv = kv_bytes(shape, chunk_tokens)
    sizes = {name: int(chunk_kv / r.ratio) for name, r in reps.items()}
    rates = choice.Rates(link_Bps, latency_s, {name: r.decode_Bps for name, r in reps.items()},
                         PrefillModel.linear(n * chunk_tokens / recompute_s))
    d = choice.choose([sizes] * n, chunk_tokens, chunk_kv, {name: r.fmt for name, r in reps.items()}, rates, allowed)
    return Verdict(d.preset, dict(d.options), recompute_s)


def fit_efficiency(points: list[tuple[ModelShape, int, float]], bf16_tflops: float) -> tuple[float, float]:
    """Least-squares (linear, attention) efficiencies from timed (shape, tokens, seconds) points.

    Solves ``seconds = linear / (peak * e1) + attention / (peak * e2)`` for 1/e1 and 1/e2 in
    relative error (each point weighted by 1/seconds), so short and long prefills count alike.
    """
    peak = bf16_tflops * 1e12
    a11 = a12 = a22 = b1 = b2 = 0.0
    for shape, tokens, seconds in points:
        lin, att = prefill_flops(shape, tokens)
        x1, x2, w = lin / peak, att / peak, 1.0 / seconds**2
        a11, a12, a22 = a11 + w * x1 * x1, a12 + w * x1 * x2, a22 + w * x2 * x2
        b1, b2 = b1 + w * x1 * seconds, b2 + w * x2 * seconds
    det = a11 * a22 - a12 * a12
    if det <= 0:
        raise ValueError("need points of at least two different context lengths")
    inv1, inv2 = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
    if inv1 <= 0 or inv2 <= 0:
        raise ValueError("measurements do not fit a positive efficiency")
    return 1.0 / inv1, 1.0 / inv2
