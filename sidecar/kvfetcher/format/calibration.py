"""calibration: per-model data that tunes the lossy presets, found by model fingerprint.

A calibration is a JSON artefact: the model **tag** it applies to (every fingerprint that starts
with it), per-layer sensitivity tables (one ``(key, value)`` pair per layer, by what was quantised:
``basis``, ``trellis``, ...), optionally the name of its KV basis (codec/basis.py, a ``.pt`` file
whose name carries the same tag), the KV geometry ``(layers, kv_heads, head_dim)``, the per-layer
RoPE bases keys are un-rotated with, and the per-layer attention windows (0: full attention; for
the record). ``kvfetcher calibrate`` writes one named by its content, ``<tag>-<12 hex>.json``
(``<12 hex>``: sha256 of its canonical JSON); reading checks that name and every value's type and
bounds (:func:`parse`). The shipped SmolLM2 file predates this and is named by its tag.

Where a fingerprint's calibration is found: the package's ``data/models/`` (with the shipped
bases) and the local calibration directory (``KVFETCHER_CALIBRATION_DIR``; artefact and basis
side by side), the sidecar's own files, which :func:`fetch` fills from a pool's store
(``_meta/calibration/<tag>/``, where :func:`publish` puts them). The longest matching tag wins,
across places (the sidecar's look, store/calibrations.py, compares the store's too); within a tag
the newest artefact. A calibration whose tag the fingerprint does not start with is refused
(:func:`check`), and so is a basis of another geometry (``basis.fits``).

A content name is no authentication (anyone can compute it). With the pool's object key
(format/mac.py), a published artefact carries a keyed tag (``mac``) over its tag, name, content
and its basis file's sha256, and a sidecar with the key installs only artefacts whose tag verifies.

Exactly one shipped calibration is marked ``"default": true``: its presets are the ones named
without a model. A model without a calibration gets no preset that needs one (presets.py). A
chunk's header records the steps, bases and basis name it was coded with, so changing these
files never changes how stored objects decode.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvfetcher.codec import basis as kvbasis
from kvfetcher.config import CALIBRATION_DIR
from kvfetcher.format import mac

log = logging.getLogger("kvfetcher.calibration")

MODELS_DIR = Path(__file__).parent.parent / "data" / "models"
#: Where a pool's store keeps calibrations: ``<STORE_PREFIX><tag>/<artefact>.json`` and ``<basis>.pt``.
STORE_PREFIX = "_meta/calibration/"
KIND = "kvfetcher-calibration"

Table = tuple[tuple[float, float], ...]

#: what parsing accepts (bounds are exclusive below, inclusive above): a sensitivity (0 would divide
#: by zero in presets.sigma_steps), a RoPE base (at most 1 does not rotate), sizes of the geometry
SENSITIVITY = (0.0, 1e6)
ROPE_BASES = (1.0, 1e12)
MAX_LAYERS, MAX_DIM, MAX_WINDOW = 4096, 1 << 20, 1 << 31


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


def canonical(doc: dict) -> bytes:
    """An artefact's canonical JSON, without its tag (``mac``): what its name and tag are made over;
    ``ValueError`` for content JSON cannot hold (NaN, infinities)."""
    try:
        return json.dumps({k: v for k, v in doc.items() if k != "mac"}, sort_keys=True, separators=(",", ":"),
                          allow_nan=False).encode()
    except RecursionError:
        raise ValueError("the artefact nests too deep") from None


def digest(doc: dict) -> str:
    """12 hex digits of the sha256 of an artefact's canonical JSON: its content name's suffix."""
    return hashlib.sha256(canonical(doc)).hexdigest()[:12]


def _number(name: str, what: str, x, lo: float, hi: float) -> float:
    """``x`` as a float in ``(lo, hi]``; ``ValueError`` otherwise (NaN, infinities, wrong types)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not lo < x <= hi or not math.isfinite(x):
        raise ValueError(f"calibration {name!r}: {what} must be a finite number in ({lo:g}, {hi:g}], not {x!r}")
    return float(x)


def _numbers(name: str, what: str, xs, lo: float, hi: float, count: int | None = None) -> tuple[float, ...]:
    if not isinstance(xs, list) or not xs or len(xs) > MAX_LAYERS or (count is not None and len(xs) != count):
        raise ValueError(f"calibration {name!r}: {what} must be a list of {count or 'up to ' + str(MAX_LAYERS)} numbers")
    return tuple(_number(name, what, x, lo, hi) for x in xs)


def _tables(name: str, given) -> dict[str, Table]:
    if not isinstance(given, dict) or not given:
        raise ValueError(f"calibration {name!r}: needs at least one non-empty sensitivity table")
    tables = {}
    for kind, t in given.items():
        layers = t.get("layers") if isinstance(t, dict) else None
        if not isinstance(layers, list) or not layers or len(layers) > MAX_LAYERS:
            raise ValueError(f"calibration {name!r}: table {kind!r} needs a non-empty list of layers")
        tables[kind] = tuple(_numbers(name, f"table {kind!r}", kv, *SENSITIVITY, count=2) for kv in layers)
    return tables


def parse(doc, name: str) -> Calibration:
    """A calibration from an artefact's JSON; ``ValueError`` for a malformed one (any shape, or a
    value outside its bounds: a sensitivity of 0, a RoPE base of at most 1) or one whose content does
    not match its content name. Never another exception."""
    if not isinstance(doc, dict):
        raise ValueError(f"calibration {name!r}: not a JSON object")
    model = doc.get("model", name)
    if not isinstance(model, str) or not model or "/" in model:
        raise ValueError(f"calibration {name!r}: the model tag must be a non-empty name without '/', not {model!r}")
    if name != model and name != f"{model}-{digest(doc)}":
        raise ValueError(f"calibration {name!r} does not match its content (for model {model!r}: {model}-{digest(doc)})")
    basis = doc.get("basis")
    if basis is not None and (not isinstance(basis, str) or basis.rsplit("-", 1)[0] != model):
        raise ValueError(f"calibration {name!r}: basis {basis!r} is not named for model {model!r}")
    tables = _tables(name, doc.get("sensitivity"))
    geo = tuple(int(n) for n in _numbers(name, "geometry", doc["geometry"], 0, MAX_DIM, 3)) if doc.get("geometry") else None
    if geo is not None and any(n != g for n, g in zip(doc["geometry"], geo)):
        raise ValueError(f"calibration {name!r}: geometry must be whole numbers, not {doc['geometry']!r}")
    layers = geo[0] if geo else None
    thetas = _numbers(name, "rope_thetas", doc["rope_thetas"], *ROPE_BASES) if doc.get("rope_thetas") else None
    windows = doc.get("windows") or None
    if windows is not None:
        if not isinstance(windows, list) or any(isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= MAX_WINDOW for w in windows):
            raise ValueError(f"calibration {name!r}: windows must be a list of whole numbers of tokens (0: full attention)")
        windows = tuple(windows)
    for what, per_layer in (("rope_thetas", thetas), ("windows", windows), *((f"table {k}", t) for k, t in tables.items())):
        if layers is not None and per_layer is not None and len(per_layer) != layers:
            raise ValueError(f"calibration {name!r}: {what} has {len(per_layer)} layers, the geometry {layers}")
    measured = doc.get("measured")
    return Calibration(model, basis, tables, geo, thetas, windows, name, measured if isinstance(measured, dict) else None)


def loads(data: bytes | str, name: str):
    """An artefact's JSON; ``ValueError`` for bytes that are not JSON (or nest too deep)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"calibration {name!r} is not JSON: {e}") from None


def read(path: Path) -> Calibration:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read calibration {path}: {e}") from None
    return parse(loads(text, Path(path).stem), Path(path).stem)


def check(cal: Calibration, fingerprint: str) -> None:
    """Refuse (``ValueError``) a calibration of another model than ``fingerprint`` names."""
    if cal.model is None or not kvbasis.is_for(cal.model, fingerprint):
        raise ValueError(f"calibration {cal.name!r} is for model {cal.model!r}, not {fingerprint!r}")


def _in(directory: Path) -> list[tuple[dict, Calibration]]:
    """The well-formed artefacts in ``directory``; a malformed one is logged and skipped."""
    out = []
    for p in sorted(directory.glob("*.json")) if directory.is_dir() else ():
        try:
            doc = loads(p.read_text(), p.stem)
            if isinstance(doc, dict) and doc.get("kind", KIND) == KIND:
                out.append((doc, parse(doc, p.stem)))
        except (OSError, ValueError) as e:
            log.warning("calibration %s skipped: %s", p, e)
    return out


def _created(doc: dict) -> float:
    t = doc.get("created", 0)
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) else 0.0


def _best(found: list[tuple[dict, Calibration]], fingerprint: str) -> Calibration | None:
    """The longest matching tag, then the newest (``created``), then the last name."""
    fit = [(d, c) for d, c in found if kvbasis.is_for(c.model, fingerprint)]
    if not fit:
        return None
    return max(fit, key=lambda dc: (len(dc[1].model), _created(dc[0]), dc[1].name))[1]


def models() -> list[str]:
    """Tags of the models calibrated here (package data and the local directory)."""
    return sorted({c.model for d in local_dirs() for _, c in _in(d)})


def calibration_for(fingerprint: str) -> Calibration | None:
    """The calibration of the model ``fingerprint`` names: the longest matching tag of every local
    place; between places of the same tag, the first place's."""
    best = [cal for d in local_dirs() if (cal := _best(_in(d), fingerprint)) is not None]
    return max(best, key=lambda c: len(c.model), default=None)


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


def sign(doc: dict, key: bytes, basis_bytes: bytes | None) -> dict:
    """``doc`` with its tag (``mac``, :func:`mac.calibration_tag`) under ``key``; its name is unchanged."""
    cal = parse(doc, f"{doc.get('model')}-{digest(doc)}")
    tag = mac.calibration_tag(key, cal.model, cal.name, canonical(doc), _sha256(basis_bytes))
    return {**doc, "mac": tag.hex()}


def authentic(doc: dict, cal: Calibration, key: bytes, basis_bytes: bytes | None) -> bool:
    """Whether ``doc`` (parsed as ``cal``) carries a valid tag under ``key`` for its basis' bytes."""
    given = doc.get("mac")
    want = mac.calibration_tag(key, cal.model, cal.name, canonical(doc), _sha256(basis_bytes))
    return isinstance(given, str) and hmac.compare_digest(given, want.hex())


def _sha256(data: bytes | None) -> bytes:
    return hashlib.sha256(data).digest() if data is not None else b""


def publish(store, path: Path, basis_path: Path | None, key: bytes | None = None) -> list[str]:
    """Put an artefact (and its basis) under the store's ``_meta/calibration/<tag>/``, tagged under
    ``key`` (:func:`format.mac.key_from`; None: untagged). A basis of the same name is kept (a content
    name: the same bytes); an artefact of the same name and other bytes (untagged, another key's)
    is replaced. Returns the object names."""
    cal = read(path)
    basis_bytes = Path(basis_path).read_bytes() if basis_path else None
    doc = json.loads(Path(path).read_text())
    doc = sign(doc, key, basis_bytes) if key else {k: v for k, v in doc.items() if k != "mac"}
    prefix = f"{STORE_PREFIX}{cal.model}/"
    name, data = f"{prefix}{Path(path).name}", (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
    if basis_path:  # first: a reader never finds an artefact without its basis
        store.put(f"{prefix}{Path(basis_path).name}", basis_bytes)
    if not store.put(name, data) and store.get(name) != data:
        store.delete(name)
        store.put(name, data)
    return [name] + ([f"{prefix}{Path(basis_path).name}"] if basis_path else [])


def store_tags(store, fingerprint: str) -> list[str]:
    """The tags under the store's ``_meta/calibration/`` that ``fingerprint`` matches, longest first."""
    tags = {n[len(STORE_PREFIX):].split("/", 1)[0] for n in store.list(STORE_PREFIX)}
    return sorted((t for t in tags if kvbasis.is_for(t, fingerprint)), key=lambda t: (-len(t), t))


def fetch(store, fingerprint: str, key: bytes | None = None, longer_than: int = 0,
          accepted: tuple[bytes, ...] = ()) -> Calibration | None:
    """The store's calibration of ``fingerprint``'s model (the longest matching tag, longer than
    ``longer_than`` characters; then the newest), installed into the local directory with its basis,
    or None if the store has none. With ``key``, only an artefact whose tag verifies
    (:func:`authentic`) under it or an ``accepted`` key (a rotation's previous keys) is taken. An artefact refused (malformed, unauthenticated, a basis not
    matching its name) is logged and skipped. Store errors propagate."""
    for tag in store_tags(store, fingerprint):
        if len(tag) <= longer_than:
            return None
        cal = _fetch_tag(store, f"{STORE_PREFIX}{tag}/", fingerprint, (key, *accepted) if key else ())
        if cal is not None:
            return cal
    return None


def _fetch_tag(store, prefix: str, fingerprint: str, keys: tuple[bytes, ...]) -> Calibration | None:
    found = []
    for n in sorted(x for x in store.list(prefix) if x.endswith(".json")):
        stem = n[len(prefix):-len(".json")]
        try:
            doc = loads(store.get(n), stem)
            cal = parse(doc, stem)
            check(cal, fingerprint)
            if prefix != f"{STORE_PREFIX}{cal.model}/":
                raise ValueError(f"it is for model {cal.model!r}, filed under {prefix}")
        except ValueError as e:
            log.warning("calibration %s refused: %s", n, e)
            continue
        found.append((doc, cal))
    for doc, cal in sorted(found, key=lambda dc: (_created(dc[0]), dc[1].name), reverse=True):
        try:
            return _install(store, prefix, doc, cal, keys)
        except ValueError as e:
            log.warning("calibration %s%s refused: %s", prefix, cal.name, e)
    return None


def _install(store, prefix: str, doc: dict, cal: Calibration, keys: tuple[bytes, ...]) -> Calibration:
    """Write ``cal`` (and its basis) into the local directory once both check (with ``keys``: its tag
    verifies under one); ``ValueError`` if not."""
    basis_bytes = store.get(f"{prefix}{cal.basis}.pt") if cal.basis is not None else None
    if keys and not any(authentic(doc, cal, k, basis_bytes) for k in keys):
        raise ValueError("its tag does not verify under this pool's key (unauthenticated)")
    local = Path(CALIBRATION_DIR.read())
    local.mkdir(parents=True, exist_ok=True)
    if cal.basis is not None:
        tmp = local / f".{cal.basis}.pt.part"
        tmp.write_bytes(basis_bytes)
        try:
            kvbasis.verify_file(tmp, cal.basis)
        except ValueError:
            tmp.unlink(missing_ok=True)
            raise
        tmp.replace(local / f"{cal.basis}.pt")
    (local / f"{cal.name}.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    log.info("calibration %s fetched from the store", cal.name)
    return cal
