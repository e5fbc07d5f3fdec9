"""Pure builders from a KVCachePool (a dict as the API returns it) to the names and objects it owns.

Nothing here talks to the API or reads the clock; handlers apply what these return. Random
values (credentials, tokens, salts) come in through a `token` function so that a builder's
output depends only on its inputs.
"""
from __future__ import annotations

import base64
import re
import secrets
from collections.abc import Callable
from typing import Any

from . import spec as specs

MAX_NAME = 40
S3_PORT = 9000
EVICTOR = "evictor"  # the evictor's component label (evictor.py)
CALIBRATION = "calibration"  # the calibration Job's component label (calibration.py)
#: the pool Secret's keys of managed MinIO's calibrator user (users.calibrator_policy)
CALIBRATOR_KEYS = ("calibratorAccessKey", "calibratorSecretKey")


def name_problems(name: str, spec: dict[str, Any]) -> list[str]:
    """The pool's own name feeds StatefulSet and Service names, which have their own limits."""
    out = [] if len(name) <= MAX_NAME else [
        f"metadata.name: at most {MAX_NAME} characters (its MinIO StatefulSet and Services derive from it)"]
    if "managed" in (spec.get("storage") or {}) and not re.match(specs.DNS_LABEL_PATTERN, name):
        out.append("metadata.name: a managed pool's name must be a DNS label starting with a letter "
                   "(its MinIO Services derive from it)")
    return out


def secret_name(pool_name: str) -> str:
    return f"{pool_name}-kvfetcher"


def minio_name(pool_name: str) -> str:
    return f"{pool_name}-minio"


def root_secret_name(pool_name: str) -> str:
    """Managed MinIO's root credentials: for MinIO and the operator, never referenced by a sidecar."""
    return f"{pool_name}-minio-root"


def labels(pool_name: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kvfetcher",
        "app.kubernetes.io/instance": pool_name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "kvfetcher-operator",
        "kvfetcher.io/pool": pool_name,
    }


def owner_reference(pool: dict[str, Any]) -> dict[str, Any]:
    """Makes a child garbage-collected with its pool."""
    meta = pool["metadata"]
    return {
        "apiVersion": f"{specs.GROUP}/{specs.VERSION}",
        "kind": specs.KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_meta(pool: dict[str, Any], name: str, component: str) -> dict[str, Any]:
    meta = pool["metadata"]
    return {
        "name": name,
        "namespace": meta["namespace"],
        "labels": labels(meta["name"], component),
        "ownerReferences": [owner_reference(pool)],
    }


def storage_location(pool: dict[str, Any]) -> tuple[str, str]:
    """(S3 endpoint URL, bucket) that the sidecars and the operator use."""
    storage = specs.with_defaults(pool["spec"])["storage"]
    if "managed" in storage:
        meta = pool["metadata"]
        return f"http://{minio_name(meta['name'])}.{meta['namespace']}.svc:{S3_PORT}", storage["managed"]["bucket"]
    external = storage["external"]
    return external["endpoint"].rstrip("/"), external["bucket"]


def _access_key(token: Callable[[int], str]) -> str:
    return "kvf" + token(12).replace("-", "").replace("_", "").lower()[:13]


def secret_values(
    pool: dict[str, Any],
    existing: dict[str, str] | None,
    token: Callable[[int], str] = secrets.token_urlsafe,
    root_user: str | None = None,
) -> dict[str, str]:
    """What the pool's Secret holds: kept values stay (rotating them would strand data), missing ones are made.

    Managed storage gets the sidecars' own MinIO user (never `root_user`, MinIO's root: a
    Secret that still holds the root user gets a new sidecar user) and the calibration Job's; every pool gets the
    sidecar's auth token, a tenant salt and the key that authenticates its stored objects; endpoint and bucket are here so that pods read
    them by reference.
    """
    existing = dict(existing or {})
    endpoint, bucket = storage_location(pool)
    wanted: dict[str, Callable[[], str]] = {
        "authToken": lambda: token(32),
        "tenantSalt": lambda: token(16),
        "objectKey": lambda: token(32),
    }
    if "managed" in pool["spec"]["storage"]:
        if root_user and existing.get("accessKey") == root_user:
            del existing["accessKey"], existing["secretKey"]
        wanted["accessKey"] = lambda: _access_key(token)
        wanted["secretKey"] = lambda: token(30)
        wanted[CALIBRATOR_KEYS[0]] = lambda: _access_key(token)
        wanted[CALIBRATOR_KEYS[1]] = lambda: token(30)
    values = {key: existing.get(key) or make() for key, make in wanted.items()}
    values.update(endpoint=endpoint, bucket=bucket)
    return values


def root_values(
    existing_root: dict[str, str] | None,
    pool_values: dict[str, str] | None,
    token: Callable[[int], str] = secrets.token_urlsafe,
) -> dict[str, str]:
    """Managed MinIO's root credentials, kept once made.

    A pool made before sidecars had their own user kept MinIO's root in its own Secret
    (`accessKey`, `secretKey`): without a root Secret, those are the root (MinIO's data was
    made with them).
    """
    kept = dict(existing_root or {})
    if not kept.get("rootUser") and (pool_values or {}).get("accessKey"):
        kept = {"rootUser": pool_values["accessKey"], "rootPassword": pool_values.get("secretKey", "")}
    return {"rootUser": kept.get("rootUser") or _access_key(token),
            "rootPassword": kept.get("rootPassword") or token(30)}


def secret(pool: dict[str, Any], values: dict[str, str], name: str | None = None) -> dict[str, Any]:
    """The pool's Secret (or, named, another Secret it owns) holding `values`."""
    pool_name = pool["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_meta(pool, name or secret_name(pool_name), "credentials"),
        "type": "Opaque",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in sorted(values.items())},
    }


def decode_secret_data(data: dict[str, str] | None) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in (data or {}).items()}
