"""A stand-in calibration for the benchmarks' random-weight model shapes, so they can store the
presets that need one (format/calibration.py refuses those for an uncalibrated model).

It is the shipped model's step tables without a basis: exactly what every uncalibrated model was
coded with before presets were gated on a calibration, so sizes and restore rates stay comparable
with earlier runs. A random-weight model has no accuracy to calibrate for; a real model gets its
own with ``kvfetcher calibrate``.
"""

from __future__ import annotations

from kvfetcher import chunk
from kvfetcher.format import calibration, presets


def ensure(fingerprint: str) -> None:
    """Give ``fingerprint``'s model the stand-in calibration unless it has one (local directory)."""
    if calibration.calibration_for(fingerprint) is not None:
        return
    tables = {k: {"layers": [list(kv) for kv in t]} for k, t in calibration.default().tables.items()}
    doc = calibration.artefact(fingerprint.split("/", 1)[0], tables, None, None, None, None, made_by="benchmarks.lib.standin")
    calibration.write(doc)
    presets.for_model.cache_clear()


def encode_chunk(kv, preset, fingerprint: str, **kw) -> bytes:
    """``chunk.encode_chunk`` for a benchmark's model, calibrated by :func:`ensure` if need be."""
    ensure(fingerprint)
    return chunk.encode_chunk(kv, preset, fingerprint, **kw)
