"""presets: named fidelity/size trade-offs. Each is a layout plus codec settings.

The lossy presets' per-layer steps come from a model's calibration (calibration.py): each
names a sensitivity table and a scale, and ``sigma_steps`` turns the table into steps; their
keys are un-rotated with the calibration's per-layer RoPE bases when it has them. Such presets
(``needs_calibration``) exist only for a model with a calibration: ``get(name, fingerprint)``
refuses them for any other model with the reason (:func:`refusal`), so they are never stored or
chosen for it, while ``q8``, ``lean``, ``exact`` and ``raw`` serve every model. ``get(name)`` and
``PRESETS`` are the presets of the default calibration. The header records the layout a chunk was
coded with, so decoding never consults presets.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from kvfetcher.codec import rope
from kvfetcher.codec.base import ENTROPY_FORMATS, CodecParams
from kvfetcher.codec.params import LayoutParams
from kvfetcher.format import calibration
from kvfetcher.format.calibration import Calibration, Table


def sigma_steps(scale: float, lo: float = 0.08, hi: float = 0.7, *, table: Table) -> Table:
    """Per-layer (key, value) steps that minimise the summed KL at a given rate.

    KL grows with the square of the step and adds up over layers, so at a fixed total of
    log2(step) the best steps are ``scale / sqrt(sensitivity)``; ``lo``/``hi`` clamp them to
    the regime the table was measured in. Steps are rounded to 3 decimals.
    """
    return tuple(tuple(round(min(hi, max(lo, scale * w**-0.5)), 3) for w in kv) for kv in table)


#: the calibrated presets' steps: (the calibration table read, scale, lo, hi) for ``sigma_steps``
LOSSY: dict[str, tuple[str, float, float, float]] = {"balanced": ("trellis", 0.001, 0.01, 2.0), "compact": ("basis", 0.00416, 0.015, 1.6)}


def table_for(name: str, steps) -> list[list[float]]:
    """The table from which preset ``name`` makes per-layer ``steps`` (``[[key, value], ...]``):
    the inverse of its ``sigma_steps`` within its bounds, 3 significant digits."""
    _, scale, _, _ = LOSSY[name]
    return [[float(f"{(scale / s) ** 2:.3g}") for s in kv] for kv in steps]


def scaled(profile: Table, factor: float) -> Table:
    """A profile with every step times ``factor`` (the size-accuracy curve moves along this)."""
    return tuple((round(k * factor, 4), round(v * factor, 4)) for k, v in profile)


@dataclass(frozen=True)
class Preset:
    name: str
    layout: LayoutParams
    codec: CodecParams
    lossless: bool  # True: the restored KV is bit-identical to what was stored
    summary: str
    segment_frames: int = 4  # frames per independently decodable segment
    # if set, frames per segment come from a byte target instead: each segment is a ranged GET and
    # a CRC, so raw (a frame is a layer of a few hundred KB to a few MB) uses a few large ones
    segment_bytes: int = 0
    pre_rope: bool = False  # keys quantised before RoPE: the encoder must know the model's theta
    # exact leading tokens only in the chunk at position 0 (the attention sink); later chunks
    # spend no side information on them
    sink_exact_only: bool = False

    @property
    def direct(self) -> bool:
        """Whether a chunk of it is the buffer's own bytes, restored by one copy (no decode worker)."""
        return self.layout.mode == "native"

    @property
    def needs_calibration(self) -> bool:
        """Whether its steps (and basis) come from a model's calibration."""
        return self.layout.sigma_steps is not None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "summary": self.summary,
            "lossless": self.lossless,
            "layout": self.layout.to_dict(),
            "codec": self.codec.to_dict(),
            "segment_frames": self.segment_frames,
            "segment_bytes": self.segment_bytes,
            "pre_rope": self.pre_rope,
            "sink_exact_only": self.sink_exact_only,
        }


def _lossy(cal: Calibration, table: str, scale: float, lo: float, hi: float, sparse_tokens: int = 0) -> LayoutParams:
    """A layout whose steps are ``sigma_steps`` over one of the calibration's tables, in its basis
    if it has one; the sparse corrections need the basis (keys are ranked by their norm in it)."""
    theta = rope.compact(cal.rope_thetas) if cal.rope_thetas else None
    return LayoutParams(mode="quant", sigma_steps=sigma_steps(scale, lo, hi, table=cal.table(table)), basis=cal.basis,
                        planes=3, trellis=True, sparse_tokens=sparse_tokens if cal.basis else 0, sparse_step=0.25,
                        rope_theta=theta)


def _build(cal: Calibration) -> dict[str, Preset]:
    """Every preset, with the lossy ones' steps (and basis) from ``cal``."""
    video = CodecParams(format="hevc", lossless=True)
    fast_video = CodecParams(format="hevc", lossless=True, speed="ultrafast", rd=3)
    presets = [
        Preset("raw", LayoutParams(mode="native", planes=1), CodecParams(format="raw"), True,
               "the KV buffer's own bytes, no video: restored by one copy, for links faster than any decoder",
               segment_bytes=8 << 20),
        Preset("exact", LayoutParams(mode="exact", planes=3), video, True,
               "bit-exact: each value's bytes as separate planes, lossless HEVC 4:4:4"),
        Preset("q8", LayoutParams(mode="quant", bits=8, planes=3), video, False,
               "8-bit per-channel quantisation (first token exact), lossless HEVC 4:4:4 over token-major tiles"),
        Preset("lean", LayoutParams(mode="quant", kv_bits=(5, 6), planes=3), video, False,
               "keys 5-bit quantised before RoPE, values 6-bit (first token exact), lossless HEVC 4:4:4",
               pre_rope=True),
        Preset("balanced", _lossy(cal, *LOSSY["balanced"], sparse_tokens=4), fast_video, False,
               "each head's channels in the model's KV basis, one step per layer and k|v set by sensitivity measured at "
               "this point (keys pre-RoPE), trellis-coded quantisation along tokens, the 4 tokens of largest key per head "
               "corrected in side information, lossless HEVC 4:4:4",
               pre_rope=True, sink_exact_only=True),
        Preset("compact", _lossy(cal, *LOSSY["compact"]), fast_video, False,
               "balanced's scheme at ~3x coarser steps: smaller, with a measured accuracy loss",
               pre_rope=True, sink_exact_only=True),
    ]
    base = {p.name: p for p in presets}
    coded = {v.name: v for name in ENTROPY_BASES for fmt in ENTROPY_FORMATS for v in [entropy_variant(base[name], fmt)]}
    return base | coded | {v.name: v for fmt in ENTROPY_FORMATS for v in [transform(base["balanced"], fmt)]}


#: presets whose planes also come entropy-coded: ``<name>-zstd`` and ``<name>-ans``
ENTROPY_BASES = ("q8", "balanced", "compact")
#: bytes of planes per entropy-coded block (nvCOMP's chunk)
ENTROPY_BLOCK = 1 << 16
_ENTROPY_SUMMARY = {
    "zstd": "blocks of standard zstd frames: nvCOMP on a GPU, the zstandard package on a CPU",
    "ans": "blocks of nvCOMP's ANS on the GPU: faster than zstd, GPU readers only",
}


def entropy_variant(p: Preset, fmt: str, block_bytes: int = ENTROPY_BLOCK) -> Preset:
    """``p``'s layout and quantisation (the same planes, so the same KV after restore) entropy-coded
    as ``fmt`` instead of HEVC: one segment per chunk (a GPU codes its blocks in one batch)."""
    return dataclasses.replace(p, name=f"{p.name}-{fmt}", codec=CodecParams(format=fmt, block_bytes=block_bytes),
                               summary=f"{p.name}'s planes entropy-coded in {block_bytes >> 10} KiB {_ENTROPY_SUMMARY[fmt]}", segment_bytes=1 << 30)


def transform(balanced: Preset, fmt: str, block_bytes: int = ENTROPY_BLOCK) -> Preset:
    """``transform-<fmt>``: ``balanced``'s transform and quantisation (so its restored KV) with the
    planes written for an entropy coder, not a video codec: each component's tokens one row,
    rows sorted by their samples' spread (layout ``sort_components``), coded as ``fmt``."""
    p = entropy_variant(balanced, fmt, block_bytes)
    return dataclasses.replace(p, name=f"transform-{fmt}", layout=dataclasses.replace(p.layout, sort_components=True),
                               summary=f"balanced's transform coding (basis, steps by sensitivity, trellis, sparse corrections) "
                                       f"with its components' rows sorted by spread for the entropy coder, {_ENTROPY_SUMMARY[fmt]}")


#: The presets of the default calibration (what a name means when no model is given).
PRESETS: dict[str, Preset] = _build(calibration.default())


def for_calibration(cal: Calibration) -> dict[str, Preset]:
    """Every preset, with the lossy ones' steps, bases and basis from ``cal``."""
    return _build(cal)


@functools.lru_cache(maxsize=64)
def for_model(fingerprint: str) -> dict[str, Preset]:
    """The presets the model ``fingerprint`` names may use: those needing a calibration only with
    one, built from it."""
    cal = calibration.calibration_for(fingerprint)
    if cal is not None:
        return _build(cal)
    return {n: p for n, p in PRESETS.items() if not p.needs_calibration}


def refusal(name: str, fingerprint: str) -> str | None:
    """Why preset ``name`` may not be stored or chosen for the model ``fingerprint``, or None."""
    if name not in PRESETS:
        return f"unknown preset {name!r}; known: {', '.join(PRESETS)}"
    if name not in for_model(fingerprint):
        return (f"preset {name!r} needs a calibration of model {fingerprint!r} and there is none: "
                f"run `kvfetcher calibrate` for it (uncalibrated models get {', '.join(for_model(fingerprint))})")
    return None


def usable(names, fingerprint: str) -> tuple[str, ...]:
    """The presets among ``names`` that model ``fingerprint`` may store and choose."""
    return tuple(n for n in names if refusal(n, fingerprint) is None)


def get(name: str, fingerprint: str | None = None) -> Preset:
    """Preset ``name``: of the default calibration, or with ``fingerprint``, of that model
    (``ValueError`` with :func:`refusal`'s reason if that model may not use it)."""
    if fingerprint is None:
        if name not in PRESETS:
            raise ValueError(refusal(name, ""))
        return PRESETS[name]
    why = refusal(name, fingerprint)
    if why is not None:
        raise ValueError(why)
    return for_model(fingerprint)[name]


#: Measured figures per preset, shipped so ``kvfetcher presets`` can show them.
MEASURED_FILE = Path(__file__).parent.parent / "data" / "presets_measured.json"


def measured(name: str) -> dict | None:
    """The last benchmarked ratio/accuracy/throughput of a preset on the default calibration's model,
    or None if never measured."""
    try:
        return json.loads(MEASURED_FILE.read_text()).get(name)
    except FileNotFoundError:
        return None
