"""Calibrations are authenticated, validated and resolved by the longest matching tag.

An artefact under ``_meta/calibration/`` is trusted only with a keyed tag (the pool's object key)
over its tag, name, content and basis; its values are checked on parse (finite, positive, bounded)
so a malformed one is refused with a clear error, never a 500 on every request; and which
calibration a model gets does not depend on which model was looked up first."""

import json
import logging
import math
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvfetcher.codec import basis
from kvfetcher.format import calibration, mac, presets
from kvfetcher.metrics import Metrics
from kvfetcher.store.calibrations import CalibrationLookup
from kvfetcher.store.local import LocalStore

GEO = (3, 1, 64)
KEY, OTHER_KEY = mac.key_from("a pool's object key, 32+ chars"), mac.key_from("another pool's key, 32+ chars")


def made(tag: str, directory: Path, seed: int = 0, created: float | None = None) -> tuple[Path, Path]:
    """A calibration of a 3-layer model, written as ``calibrate`` does."""
    L, H, D = GEO
    g = torch.Generator().manual_seed(seed)
    b = basis.build(tag, torch.linalg.qr(torch.randn(L, 2, H, D, D, generator=g))[0], torch.randn(L, 2, H, D, generator=g))
    bpath = basis.save(b, directory)
    tables = {k: {"layers": [[1e-4 * (i + 1 + seed), 2e-4] for i in range(L)]} for k in ("basis", "trellis")}
    doc = calibration.artefact(tag, tables, b.name, GEO, (1e4, 1e4, 1e6), (0, 0, 0), made_by="test")
    if created is not None:
        doc["created"] = created
    return calibration.write(doc, directory), bpath


def doc_of(**changes) -> dict:
    tables = {"basis": {"layers": [[1e-4, 2e-4]] * 3}}
    doc = {"kind": calibration.KIND, "model": "tiny-lm", "basis": None, "geometry": list(GEO), "sensitivity": tables,
           "rope_thetas": [1e4] * 3, "windows": [0] * 3} | changes
    return doc


@pytest.fixture
def pool():
    with ThreadPoolExecutor(1) as p:
        yield p


# --- authentication (finding 1) --------------------------------------------------------------


def test_a_keyed_sidecar_installs_only_an_artefact_tagged_with_its_key(local, tmp_path):
    store = LocalStore(tmp_path / "store")
    path, bpath = made("tiny-lm", tmp_path / "made")
    calibration.publish(store, path, bpath)  # untagged: anyone can compute a content name
    assert calibration.fetch(store, "tiny-lm/fp16", KEY) is None and not list(local.glob("*.json"))
    calibration.publish(store, path, bpath, OTHER_KEY)  # replaced, tagged under another key
    assert calibration.fetch(store, "tiny-lm/fp16", KEY) is None
    calibration.publish(store, path, bpath, KEY)
    cal = calibration.fetch(store, "tiny-lm/fp16", KEY)
    assert cal is not None and cal.name == path.stem and (local / path.name).exists()


def test_a_forged_longer_tag_newer_artefact_is_not_taken_over_a_tagged_one(local, tmp_path):
    """The attack of the finding: whoever can write the store publishes a longer-tag, later-dated artefact."""
    store = LocalStore(tmp_path / "store")
    calibration.publish(store, *made("tiny", tmp_path / "made"), KEY)
    forged = made("tiny-lm", tmp_path / "forged", seed=5, created=4e9)
    calibration.publish(store, *forged)  # no key
    doc = json.loads(forged[0].read_text()) | {"mac": "00" * 32}
    store.delete(f"_meta/calibration/tiny-lm/{forged[0].name}")
    store.put(f"_meta/calibration/tiny-lm/{forged[0].name}", json.dumps(doc).encode())
    cal = calibration.fetch(store, "tiny-lm/fp16", KEY)
    assert cal.model == "tiny"


def test_the_tag_binds_the_basis_the_name_and_the_content(local, tmp_path):
    path, bpath = made("tiny-lm", tmp_path / "made")
    other_basis = made("tiny-lm", tmp_path / "other", seed=3)[1].read_bytes()
    doc = calibration.sign(json.loads(path.read_text()), KEY, bpath.read_bytes())
    cal = calibration.parse(doc, path.stem)
    assert calibration.authentic(doc, cal, KEY, bpath.read_bytes())
    assert not calibration.authentic(doc, cal, KEY, other_basis)
    assert not calibration.authentic(doc, cal, OTHER_KEY, bpath.read_bytes())
    renamed = calibration.Calibration(cal.model, cal.basis, cal.tables, cal.geometry, name="tiny-lm")
    assert not calibration.authentic(doc, renamed, KEY, bpath.read_bytes())
    # the same content filed under another (longer) tag is refused
    store = LocalStore(tmp_path / "store")
    store.put(f"_meta/calibration/tiny-lm-chat/{path.name}", json.dumps(doc).encode())
    store.put(f"_meta/calibration/tiny-lm-chat/{bpath.name}", bpath.read_bytes())
    assert calibration.fetch(store, "tiny-lm-chat/fp16", KEY) is None


def test_the_calibration_job_signs_with_the_pools_object_key():
    from kvfetcher_operator import calibration as job

    pool = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"storage": {"managed": {}}, "model": {"name": "org/m", "calibration": {
                "source": {"persistentVolumeClaim": {"claimName": "weights", "path": "m"}}}}}}
    env = job.job(pool)["spec"]["template"]["spec"]["containers"][0]["env"]
    ref = next(e for e in env if e["name"] == "KVFETCHER_OBJECT_KEY")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "p-kvfetcher", "key": "objectKey"}


# --- validation (finding 2) ------------------------------------------------------------------


@pytest.mark.parametrize("change, says", [
    ({"sensitivity": {"basis": {"layers": [[0.0, 2e-4]] * 3}}}, "must be a finite number"),
    ({"sensitivity": {"basis": {"layers": [[-1e-4, 2e-4]] * 3}}}, "must be a finite number"),
    ({"sensitivity": {"basis": {"layers": [[math.nan, 2e-4]] * 3}}}, "must be a finite number"),
    ({"sensitivity": {"basis": {"layers": [[1e-4, 2e-4, 3e-4]] * 3}}}, "list of 2 numbers"),
    ({"sensitivity": {"basis": {"layers": [["1e-4", 2e-4]] * 3}}}, "must be a finite number"),
    ({"sensitivity": {"basis": {"layers": 7}}}, "non-empty list of layers"),
    ({"sensitivity": [1, 2]}, "at least one non-empty sensitivity table"),
    ({"rope_thetas": [1.0] * 3}, "rope_thetas must be a finite number in (1"),
    ({"rope_thetas": [0.5] * 3}, "rope_thetas must be a finite number in (1"),
    ({"rope_thetas": [math.inf] * 3}, "rope_thetas must be a finite number"),
    ({"rope_thetas": [1e4] * 2}, "rope_thetas has 2 layers"),
    ({"geometry": [3, 1.5, 64]}, "whole numbers"),
    ({"geometry": [3, 0, 64]}, "geometry must be a finite number"),
    ({"windows": [-1, 0, 0]}, "windows must be"),
    ({"basis": 7}, "is not named for model"),
])
def test_a_malformed_artefact_is_refused_with_a_clear_error(change, says):
    with pytest.raises(ValueError, match=rf"calibration .*{re.escape(says)}"):
        calibration.parse(doc_of(**change), "tiny-lm")  # named by its tag: content names are checked above


def test_json_that_is_not_an_artefact_is_a_value_error():
    for text in ("[1, 2]", '"x"', "null", "[" * 100_000 + "]" * 100_000, "{", '{"model": "tiny-lm", "sensitivity": NaN}'):
        with pytest.raises(ValueError):
            calibration.parse(calibration.loads(text, "tiny-lm"), "tiny-lm")


async def test_a_malformed_artefact_in_the_store_is_logged_and_looked_at_again_only_later(local, tmp_path, caplog, pool):
    """It used to break every lookup, store and fetch of the model (a 500), or escape the
    background look unlogged and be retried at every plan."""
    store = LocalStore(tmp_path / "store")
    store.put("_meta/calibration/tiny-lm/tiny-lm-000000000000.json", b"[1, 2]")
    bad = doc_of(sensitivity={"basis": {"layers": [[0.0, 2e-4]] * 3}})
    store.put(f"_meta/calibration/tiny-lm/tiny-lm-{calibration.digest(bad)}.json", json.dumps(bad).encode())
    lookup = CalibrationLookup(store, pool, Metrics(), recheck_s=3600)
    with caplog.at_level(logging.WARNING, "kvfetcher.calibration"):
        lookup.look("tiny-lm/fp16")
        await lookup.finding
    assert "is not named" not in caplog.text and "not a JSON object" in caplog.text and "must be a finite number" in caplog.text
    looked = lookup.finding
    lookup.look("tiny-lm/fp16")
    assert lookup.finding is looked  # not retried at every plan
    assert presets.for_model("tiny-lm/fp16") and calibration.calibration_for("tiny-lm/fp16") is None


def test_a_malformed_file_in_the_local_directory_is_skipped(local, tmp_path):
    made("tiny-lm", local)
    (local / "tiny-lm-ffffffffffff.json").write_text('{"kind": "kvfetcher-calibration", "model": "tiny-lm"}')
    (local / "junk.json").write_text("[")
    assert calibration.calibration_for("tiny-lm/fp16").model == "tiny-lm"
    assert presets.refusal("balanced", "tiny-lm/fp16") is None


# --- resolution (finding 3) and the bound on models (finding 7) ------------------------------


def test_the_longest_tag_wins_across_local_and_store_whatever_was_looked_up_first(local, tmp_path, pool):
    store = LocalStore(tmp_path / "store")
    calibration.publish(store, *made("tiny", tmp_path / "short"), KEY)
    calibration.publish(store, *made("tiny-lm", tmp_path / "long", seed=1), KEY)
    lookup = CalibrationLookup(store, pool, Metrics(), key=KEY)
    lookup.find("tiny-x/fp16")  # installs "tiny" locally
    assert calibration.calibration_for("tiny-x/fp16").model == "tiny"
    lookup.find("tiny-lm/fp16")
    assert calibration.calibration_for("tiny-lm/fp16").model == "tiny-lm"
    assert calibration.calibration_for("tiny-x/fp16").model == "tiny"


def test_a_lookup_remembers_a_bounded_number_of_models(tmp_path, pool):
    lookup = CalibrationLookup(LocalStore(tmp_path / "store"), pool, Metrics(), max_models=4)
    for i in range(50):
        lookup.look(f"model-{i}/fp16")
    assert len(lookup._looked) == 4
