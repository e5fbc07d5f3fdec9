"""A bounded fuzz test (hypothesis) of the calibration parser and of the names a pool spec gives.

Invariants: an artefact (any JSON, or a valid one with a field replaced) either parses into a
calibration whose every value is finite and within its bounds or raises ``ValueError`` (never
another exception); a name the operator accepts is one API path segment that no name can escape,
and one it refuses never reaches a path. Bounded: a fixed number of examples, no database, seconds.
"""
from __future__ import annotations

import json
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfetcher.format import calibration
from kvfetcher_operator import kube
from kvfetcher_operator import spec as specs

BOUNDED = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow])

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20)
VALID = {"kind": calibration.KIND, "model": "tiny-lm", "basis": None, "geometry": [2, 1, 64],
         "sensitivity": {"basis": {"layers": [[1e-4, 2e-4], [3e-4, 4e-4]]}}, "rope_thetas": [1e4, 1e6],
         "windows": [512, 0], "created": 1.0}
FIELDS = ["model", "basis", "geometry", "sensitivity", "rope_thetas", "windows", "created", "measured"]
NUMBERS = st.integers() | st.floats() | st.just(0) | st.just(1.0) | st.just(-1e-4)


def parses_sanely_or_refuses(doc, name: str = "tiny-lm") -> None:
    try:
        cal = calibration.parse(doc, name)
    except ValueError:
        return
    lo, hi = calibration.SENSITIVITY
    assert all(lo < x <= hi and math.isfinite(x) for t in cal.tables.values() for kv in t for x in kv)
    assert cal.rope_thetas is None or all(1.0 < x <= calibration.ROPE_BASES[1] for x in cal.rope_thetas)
    assert cal.geometry is None or all(isinstance(n, int) and n > 0 for n in cal.geometry)


@BOUNDED
@given(JSON)
def test_any_json_parses_sanely_or_is_refused(doc):
    parses_sanely_or_refuses(doc)


@BOUNDED
@given(st.sampled_from(FIELDS), JSON | st.lists(NUMBERS, max_size=3) | st.lists(st.lists(NUMBERS, max_size=3), max_size=3))
def test_a_valid_artefact_with_a_field_replaced_parses_sanely_or_is_refused(field, value):
    parses_sanely_or_refuses(VALID | {field: value})
    parses_sanely_or_refuses(VALID | {"sensitivity": {"basis": {"layers": value}}})


@BOUNDED
@given(st.binary(max_size=256) | st.text(max_size=64).map(str.encode))
def test_bytes_load_as_json_or_are_refused(data):
    try:
        doc = calibration.loads(data, "tiny-lm")
    except ValueError:
        return
    parses_sanely_or_refuses(doc)


NAME_ALPHABET = st.sampled_from("abz09-./%?#\n A_")


@BOUNDED
@given(st.text(NAME_ALPHABET, max_size=12) | st.text(max_size=12))
def test_a_name_is_one_path_segment_or_refused_everywhere(name):
    accepted = specs.object_name_problem("x", name) == []
    try:
        path = kube.Kube.path("v1", "secrets", "ns", name)
    except ValueError:
        assert not accepted, name
        return
    assert accepted, name
    assert path == f"/api/v1/namespaces/ns/secrets/{name}" and ".." not in path.split("/") and name.count("/") == 0
    assert json.dumps(name) == f'"{name}"'  # nothing to escape in it
