"""calibration: per-model data that tunes the lossy presets, found by model fingerprint.

A calibration is a JSON artefact: the model **tag** it applies to (every fingerprint that starts
with it), per-layer sensitivity tables (one ``(key, value)`` pair per layer, by what was quantised:
``basis``, ``trellis``, ...), optionally the name of its KV basis (codec/basis.py, a ``.pt`` file
whose name carries the same tag), the KV geometry ``(layers, kv_heads, head_dim)``, the per-layer
RoPE bases keys are un-rotated with, and the per-layer attention windows (0: full attention; for
the record). ``kvfetcher calibrate`` writes one named by its content, ``<tag>-<12 hex>.json``
(``<12 hex>``: sha256 of its canonical JSON); reading checks that name. The shipped SmolLM2 file
predates this and is named by its tag.

Where a fingerprint's calibration is found, first place first: the package's ``data/models/``
(with the shipped bases), the local calibration directory (``KVFETCHER_CALIBRATION_DIR``; artefact
and basis side by side), which :func:`fetch` fills from a pool's store (``_meta/calibration/<tag>/``,
where :func:`publish` puts them). Within a place the longest tag wins, then the newest artefact.
A calibration whose tag the fingerprint does not start with is refused (:func:`check`), and so is
a basis of another geometry (``basis.fits``).

Exactly one shipped calibration is marked ``"default": true``: its presets are the ones named
without a model. A model without a calibration gets no preset that needs one (presets.py). A
chunk's header records the steps, bases and basis name it was coded with, so changing these
files never changes how stored objects decode.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvfetcher.codec import basis as kvbasis
from kvfetcher.config import CALIBRATION_DIR

log = logging.getLogger("kvfetcher.calibration")

MODELS_DIR = Path(__file__).parent.parent / "data" / "models"
#: Where a pool's store keeps calibrations: ``<STORE_PREFIX><tag>/<artefact>.json`` and ``<basis>.pt``.
STORE_PREFIX = "_meta/calibration/"
KIND = "kvfetcher-calibration"

Table = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class Calibration:
    model: str | None  # the fingerprint prefix it applies to; None: the generic defaults
    basis: str | None  # a basis name (codec/basis.py), or None (plain per-channel steps)
    tables: dict[str, Table] = field(hash=False)
    geometry: tuple[int, int, int] | None = None  # (layers, kv_heads, head_dim) it was made for
    rope_thetas: tuple[float, ...] | None = None  # per layer; None: the sidecar's KVFETCHER_ROPE_THETA
    windows: tuple[int, ...] | None = None  # per layer: sliding window, 0 for full attention
    name: str = ""  # the artefact's name (file stem)
    #: figures measured when it was made: preset -> ratio_vs_fp16, kl, tf_top1 on held-out text
    measured: dict | None = field(default=None, hash=False, compare=False)

    def table(self, kind: str) -> Table:
        try:
            return self.tables[kind]
        except KeyError:
            raise ValueError(f"calibration {self.model!r} has no {kind!r} table; it has {sorted(self.tables)}") from None


def local_dirs() -> list[Path]:
    """The places searched, first first: the package's data, then the local calibration directory."""
    return [MODELS_DIR, Path(CALIBRATION_DIR.read())]


def digest(doc: dict) -> str:
    """12 hex digits of the sha256 of an artefact's canonical JSON: its content name's suffix."""
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]


def parse(doc: dict, name: str) -> Calibration:
    """A calibration from an artefact's JSON; ``ValueError`` for a malformed one or one whose
    content does not match its content name."""
    model = doc.get("model", name)
    if not isinstance(model, str) or not model or "/" in model:
        raise ValueError(f"calibration {name!r}: the model tag must be a non-empty name without '/', not {model!r}")
    if name != model and name != f"{model}-{digest(doc)}":
        raise ValueError(f"calibration {name!r} does not match its content (for model {model!r}: {model}-{digest(doc)})")
    basis = doc.get("basis")
    if basis is not None and basis.rsplit("-", 1)[0] != model:
        raise ValueError(f"calibration {name!r}: basis {basis!r} is not named for model {model!r}")
    try:
        tables = {kind: tuple((float(k), float(v)) for k, v in t["layers"]) for kind, t in doc["sensitivity"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"calibration {name!r}: malformed sensitivity tables ({e!r})") from None
    if not tables or any(not t for t in tables.values()):
        raise ValueError(f"calibration {name!r}: needs at least one non-empty sensitivity table")
    geo = tuple(int(n) for n in doc["geometry"]) if doc.get("geometry") else None
    layers = geo[0] if geo else None
    thetas = tuple(float(t) for t in doc["rope_thetas"]) if doc.get("rope_thetas") else None
    windows = tuple(int(w) for w in doc["windows"]) if doc.get("windows") else None
    for what, per_layer in (("rope_thetas", thetas), ("windows", windows), *((f"table {k}", t) for k, t in tables.items())):
        if layers is not None and per_layer is not None and len(per_layer) != layers:
            raise ValueError(f"calibration {name!r}: {what} has {len(per_layer)} layers, the geometry {layers}")
    return Calibration(model, basis, tables, geo, thetas, windows, name, doc.get("measured"))


def read(path: Path) -> Calibration:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read calibration {path}: {e}") from None
    return parse(doc, Path(path).stem)


def check(cal: Calibration, fingerprint: str) -> None:
    """Refuse (``ValueError``) a calibration of another model than ``fingerprint`` names."""
    if cal.model is None or not kvbasis.is_for(cal.model, fingerprint):
        raise ValueError(f"calibration {cal.name!r} is for model {cal.model!r}, not {fingerprint!r}")


def _in(directory: Path) -> list[tuple[dict, Calibration]]:
    out = []
    for p in sorted(directory.glob("*.json")) if directory.is_dir() else ():
        doc = json.loads(p.read_text())
        if doc.get("kind", KIND) == KIND:
            out.append((doc, parse(doc, p.stem)))
    return out


def _best(found: list[tuple[dict, Calibration]], fingerprint: str) -> Calibration | None:
    """The longest matching tag, then the newest (``created``), then the last name."""
    fit = [(d, c) for d, c in found if kvbasis.is_for(c.model, fingerprint)]
    if not fit:
        return None
    return max(fit, key=lambda dc: (len(dc[1].model), float(dc[0].get("created", 0)), dc[1].name))[1]


def models() -> list[str]:
    """Tags of the models calibrated here (package data and the local directory)."""
    return sorted({c.model for d in local_dirs() for _, c in _in(d)})


def calibration_for(fingerprint: str) -> Calibration | None:
    """The calibration of the model ``fingerprint`` names, from the first place that has one."""
    for d in local_dirs():
        cal = _best(_in(d), fingerprint)
        if cal is not None:
            return cal
    return None


def default() -> Calibration:
    """The shipped calibration marked default (exactly one must be)."""
    marked = [c for d, c in _in(MODELS_DIR) if d.get("default")]
    if len(marked) != 1:
        raise ValueError(f"exactly one calibration in {MODELS_DIR} must be marked default, found {[c.name for c in marked]}")
    return marked[0]


def artefact(model: str, tables: dict[str, dict], basis: str | None, geometry, rope_thetas, windows, **about) -> dict:
    """An artefact's JSON: ``tables`` kind -> ``{"layers": [[k, v], ...], "about": ...}``; ``about``
    records how it was made (texts, tool, date)."""
    doc = {"kind": KIND, "model": model, "basis": basis, "geometry": list(geometry) if geometry else None, "sensitivity": tables,
           "rope_thetas": list(rope_thetas) if rope_thetas else None, "windows": list(windows) if windows else None,
           "created": time.time(), **about}
    parse(doc, model)  # well formed
    return doc


def write(doc: dict, directory: Path | None = None) -> Path:
    """Write an artefact under its content name into ``directory`` (default: the local one)."""
    directory = Path(directory or CALIBRATION_DIR.read())
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{doc['model']}-{digest(doc)}.json"
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


def publish(store, path: Path, basis_path: Path | None) -> list[str]:
    """Put an artefact (and its basis) under the store's ``_meta/calibration/<tag>/``; existing
    names are kept (content names: the same bytes). Returns the object names."""
    cal = read(path)
    names = []
    for p in (path, basis_path) if basis_path else (path,):
        name = f"{STORE_PREFIX}{cal.model}/{Path(p).name}"
        store.put(name, Path(p).read_bytes())
        names.append(name)
    return names


def fetch(store, fingerprint: str) -> Calibration | None:
    """The store's calibration of ``fingerprint``'s model, installed into the local directory (its
    basis too, checked against its name), or None if the store has none. Store errors propagate."""
    listed = store.list(STORE_PREFIX)
    tags = {n[len(STORE_PREFIX):].split("/", 1)[0] for n in listed}
    tags = [t for t in tags if kvbasis.is_for(t, fingerprint)]
    if not tags:
        return None
    prefix = f"{STORE_PREFIX}{max(tags, key=len)}/"
    found = []
    for n in sorted(x for x in listed if x.startswith(prefix) and x.endswith(".json")):
        doc = json.loads(store.get(n))
        found.append((doc, parse(doc, n[len(prefix):-len(".json")])))
    cal = _best(found, fingerprint)
    if cal is None:
        return None
    check(cal, fingerprint)
    local = Path(CALIBRATION_DIR.read())
    local.mkdir(parents=True, exist_ok=True)
    if cal.basis is not None:
        tmp = local / f".{cal.basis}.pt.part"
        tmp.write_bytes(store.get(f"{prefix}{cal.basis}.pt"))
        try:
            kvbasis.verify_file(tmp, cal.basis)
        except ValueError:
            tmp.unlink(missing_ok=True)
            raise
        tmp.replace(local / f"{cal.basis}.pt")
    doc = next(d for d, c in found if c.name == cal.name)
    (local / f"{cal.name}.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    log.info("calibration %s of %s fetched from the store", cal.name, fingerprint)
    return cal
