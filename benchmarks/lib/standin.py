"""A stand-in calibration for the benchmarks' random-weight model shapes, so they can store the
presets that need one (format/calibration.py refuses those for an uncalibrated model).

It is the shipped model's step tables, without a basis by default: exactly what every
uncalibrated model was coded with before presets were gated on a calibration, so sizes and
restore rates stay comparable with earlier runs. With a shape it also has a random orthogonal
basis per (layer, K|V, head), so that a pack and a restore do all of a calibrated model's work
(basis, sparse corrections). A random-weight model has no accuracy to calibrate for; a real
model gets its own with ``kvfetcher calibrate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from kvfetcher import chunk
from kvfetcher.codec import basis
from kvfetcher.config import CALIBRATION_DIR
from kvfetcher.format import calibration, presets


def ensure(fingerprint: str, shape: Sequence[int] | None = None) -> None:
    """Give ``fingerprint``'s model the stand-in calibration unless it has one (local directory);
    with ``shape`` (a chunk's ``[layers, 2, heads, tokens, head_dim]``) one with a random
    orthogonal basis, replacing a stand-in without one (or with one of another shape)."""
    cal = calibration.calibration_for(fingerprint)
    if cal is not None and (shape is None or cal.basis is not None and basis.fits(cal.basis, tuple(shape), fingerprint)):
        return
    tag = fingerprint.split("/", 1)[0]
    name = None
    if shape is not None:
        L, _, H, _, D = shape
        g = torch.Generator().manual_seed(0)
        q, _ = torch.linalg.qr(torch.randn(L * 2 * H, D, D, generator=g, dtype=torch.float64))
        b = basis.build(tag, q.reshape(L, 2, H, D, D).float(), torch.zeros(L, 2, H, D))
        basis.save(b, Path(CALIBRATION_DIR.read()))
        name = b.name
    tables = {k: {"layers": [list(kv) for kv in t]} for k, t in calibration.default().tables.items()}
    calibration.write(calibration.artefact(tag, tables, name, None, None, None, made_by="benchmarks.lib.standin"))
    presets.for_model.cache_clear()


def encode_chunk(kv, preset, fingerprint: str, **kw) -> bytes:
    """``chunk.encode_chunk`` for a benchmark's model, calibrated by :func:`ensure` if need be."""
    ensure(fingerprint)
    return chunk.encode_chunk(kv, preset, fingerprint, **kw)
