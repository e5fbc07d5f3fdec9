"""calibration: per-model data that tunes the lossy presets, looked up by model fingerprint.

A model's calibration is ``data/models/<tag>.json``: per-layer sensitivity tables (one
``(key, value)`` pair per layer, by what was quantised: ``channel``, ``basis``, ``trellis``) and
optionally the name of its shipped KV basis (codec/basis.py), which must carry the same tag.
It applies to every fingerprint that starts with ``<tag>`` (the longest such tag wins), the
rule ``basis.fits`` applies to the basis itself.

Exactly one calibration is marked ``"default": true``: its presets are the ones named without
a model, and its tables (not its basis) set the steps of models without a calibration of their
own, resampled by layer depth (``layout.sigma_profile``). A chunk's header records the steps
and basis name it was coded with, so changing these files never changes how stored objects
decode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

MODELS_DIR = Path(__file__).parent.parent / "data" / "models"

Table = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class Calibration:
    model: str | None  # the fingerprint prefix it applies to; None: the generic defaults
    basis: str | None  # a shipped basis name, or None (plain per-channel steps)
    tables: dict[str, Table] = field(hash=False)

    def table(self, kind: str) -> Table:
        try:
            return self.tables[kind]
        except KeyError:
            raise ValueError(f"calibration {self.model!r} has no {kind!r} table; it has {sorted(self.tables)}") from None


def models() -> list[str]:
    """Tags of the calibrated models."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def load(model: str) -> Calibration:
    """A calibrated model's data by tag; raises ValueError for an unknown tag or a bad file."""
    path = MODELS_DIR / f"{model}.json"
    if not path.exists():
        raise ValueError(f"no calibration for model {model!r} (looked in {MODELS_DIR})")
    d = json.loads(path.read_text())
    basis = d.get("basis")
    if basis is not None and basis.rsplit("-", 1)[0] != model:
        raise ValueError(f"{path}: basis {basis!r} is not named for model {model!r}")
    tables = {kind: tuple((float(k), float(v)) for k, v in t["layers"]) for kind, t in d["sensitivity"].items()}
    if not tables or any(not t for t in tables.values()):
        raise ValueError(f"{path}: needs at least one non-empty sensitivity table")
    return Calibration(model, basis, tables)


def calibration_for(fingerprint: str) -> Calibration | None:
    """The calibration of the model ``fingerprint`` names (longest matching tag), or None."""
    tags = [m for m in models() if fingerprint.startswith(m)]
    return load(max(tags, key=len)) if tags else None


def default() -> Calibration:
    """The calibration marked default (exactly one must be)."""
    marked = [m for m in models() if json.loads((MODELS_DIR / f"{m}.json").read_text()).get("default")]
    if len(marked) != 1:
        raise ValueError(f"exactly one calibration in {MODELS_DIR} must be marked default, found {marked}")
    return load(marked[0])


def generic() -> Calibration:
    """What a model without a calibration gets: the default's tables, no basis."""
    return Calibration(None, None, default().tables)
