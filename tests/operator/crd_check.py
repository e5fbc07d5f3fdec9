"""Validate a custom resource against a CRD's openAPIV3Schema as an API server would, offline.

Three steps, in the API server's order: apply the schema's defaults, check the structural
schema (types, enums, bounds, patterns, required) with jsonschema, then evaluate every
`x-kubernetes-validations` CEL rule at its node with cel-python. Kubernetes' CEL extension
libraries (quantity, url, ...) are not available there; this CRD's rules use only core CEL.
"""
from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema

_CEL = celpy.Environment()


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    value = copy.deepcopy(value)
    if isinstance(value, dict) and schema.get("type") == "object":
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def _cel_errors(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    errors = []
    for rule in schema.get("x-kubernetes-validations") or []:
        program = _CEL.program(_CEL.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(value)}):
            errors.append(f"{path or '<root>'}: {rule.get('message') or rule['rule']}")
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                errors += _cel_errors(sub, value[key], f"{path}.{key}" if path else key)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += _cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def validate(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """All reasons the API server would refuse `obj`; empty when it would accept it."""
    defaulted = apply_defaults(schema, obj)
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
              for e in validator.iter_errors(defaulted)]
    if errors:  # the API server stops at structural errors too
        return errors
    return _cel_errors(schema, defaulted, "")
