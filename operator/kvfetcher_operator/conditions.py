"""Kubernetes-style status conditions, as pure functions over the list in status.conditions.

lastTransitionTime moves only when a condition's status flips, as `kubectl wait` and
humans expect; reason and message are always refreshed.
"""
from __future__ import annotations

import datetime
from typing import Any

READY = "Ready"
STORAGE_READY = "StorageReady"
CONFIG_VALID = "ConfigValid"
INJECTION_READY = "InjectionReady"
EVICTOR_READY = "EvictorReady"  # informational: Ready does not wait for it
CALIBRATED = "Calibrated"  # informational: the store has the calibration of spec.model
TYPES = (READY, STORAGE_READY, CONFIG_VALID, INJECTION_READY, EVICTOR_READY, CALIBRATED)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def find(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)


def is_true(conditions: list[dict[str, Any]] | None, type_: str) -> bool:
    found = find(conditions, type_)
    return bool(found) and found.get("status") == "True"


def is_current(conditions: list[dict[str, Any]] | None, type_: str, generation: int | None) -> bool:
    """Whether a condition is True for the spec of ``generation``: observed at that generation (a
    condition without one, or a pool without one, counts as observed)."""
    found = find(conditions, type_)
    return is_true(conditions, type_) and generation in (None, found.get("observedGeneration", generation))


def put(
    conditions: list[dict[str, Any]] | None,
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    generation: int | None = None,
    at: str | None = None,
) -> list[dict[str, Any]]:
    """A new list with one condition set (status None means Unknown); the others kept in order."""
    text = {True: "True", False: "False", None: "Unknown"}[status]
    old = find(conditions, type_)
    new: dict[str, Any] = {
        "type": type_,
        "status": text,
        "reason": reason,
        "message": message,
        "lastTransitionTime": old["lastTransitionTime"] if old and old.get("status") == text
        else (at or now()),
    }
    if generation is not None:
        new["observedGeneration"] = generation
    rest = [dict(c) for c in conditions or [] if c.get("type") != type_]
    ordered = rest + [new]
    return sorted(ordered, key=lambda c: TYPES.index(c["type"]) if c["type"] in TYPES else len(TYPES))


def changed(before: list[dict[str, Any]] | None, after: list[dict[str, Any]], type_: str) -> bool:
    """Whether a condition's status or reason differs: worth an Event, unlike a refreshed message."""
    old, new = find(before, type_), find(after, type_)
    return old is None or new is None or (old["status"], old["reason"]) != (new["status"], new["reason"])
