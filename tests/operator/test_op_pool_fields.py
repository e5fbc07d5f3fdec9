"""No KVCachePool field that nothing reads: changing any field of the CRD's spec to another valid
value changes what the operator builds: the injected pod, the pool's Secret, MinIO's objects or
the evictor (whose arguments carry the retention settings) or the calibration Job."""
from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from crd_check import validate

from kvfetcher_operator import builders, calibration, evictor, injection, minio
from kvfetcher_operator import spec as specs
from test_op_builders import gpu_pod, pool

MANAGED = {"storage": {"managed": {}}}
EXTERNAL = {"storage": {"external": {"endpoint": "https://s3.example.com", "bucket": "kv-cache",
                                     "credentialsSecretRef": {"name": "creds"}}}}
TLS_CA = {"storage": {"external": {**EXTERNAL["storage"]["external"], "tls": {"caSecretRef": {"name": "ca"}}}}}
LABEL_SALT = {**MANAGED, "tenancy": {"saltFrom": "PodLabel", "labelKey": "tenant"}}
SECRET_SALT = {**MANAGED, "tenancy": {"saltFrom": "Secret", "secretRef": {"name": "salt"}}}
QUANTITIES = {"cpu": "2"}
PVC_MODEL = {**MANAGED, "model": {"name": "llama-3/bf16", "calibration": {
    "source": {"persistentVolumeClaim": {"claimName": "models", "path": "llama-3.gguf"}}}}}
IMAGE_MODEL = {**MANAGED, "model": {"name": "llama-3/bf16", "calibration": {
    "source": {"image": {"reference": "registry.example.com/models/llama-3:1", "path": "weights"}}}}}

# field path under spec -> (a valid pool without it, or with another value; a new value)
CHANGES: dict[str, tuple[dict[str, Any], Any]] = {
    "storage.managed.replicas": (MANAGED, 4),
    "storage.managed.size": (MANAGED, "1Ti"),
    "storage.managed.storageClassName": (MANAGED, "ssd"),
    "storage.managed.image": (MANAGED, "minio:other"),
    "storage.managed.bucket": (MANAGED, "other"),
    "storage.managed.resources.requests": (MANAGED, QUANTITIES),
    "storage.managed.resources.limits": (MANAGED, QUANTITIES),
    "storage.external.endpoint": (EXTERNAL, "https://s3.other.example.com"),
    "storage.external.bucket": (EXTERNAL, "other"),
    "storage.external.region": (EXTERNAL, "eu-west-1"),
    "storage.external.credentialsSecretRef.name": (EXTERNAL, "other"),
    "storage.external.credentialsSecretRef.accessKeyKey": (EXTERNAL, "id"),
    "storage.external.credentialsSecretRef.secretKeyKey": (EXTERNAL, "key"),
    "storage.external.tls.insecureSkipVerify": (EXTERNAL, True),
    "storage.external.tls.caSecretRef.name": (TLS_CA, "other"),
    "storage.external.tls.caSecretRef.key": (TLS_CA, "bundle.pem"),
    "codec.storePresets": (MANAGED, ["raw"]),
    "codec.defaultPreset": (MANAGED, "exact"),
    "codec.allowedPresets": (MANAGED, ["raw", "q8"]),
    "codec.chunkTokens": (MANAGED, 512),
    "injection.enabled": (MANAGED, False),
    "injection.modelContainer": (MANAGED, "model"),  # the pod has no GPU: "proxy" by default
    "sidecar.image": (MANAGED, "sidecar:other"),
    "sidecar.imagePullPolicy": (MANAGED, "Always"),
    "sidecar.port": (MANAGED, 9500),
    "sidecar.resources.requests": (MANAGED, QUANTITIES),
    "sidecar.resources.limits": (MANAGED, QUANTITIES),
    "sidecar.decodeProcesses": (MANAGED, 3),
    "sidecar.ttftBudgetSeconds": (MANAGED, 2.5),
    "model.name": (MANAGED, "llama-3/bf16"),  # the sidecar serves it
    "model.calibration.source.persistentVolumeClaim.claimName": (PVC_MODEL, "other"),
    "model.calibration.source.persistentVolumeClaim.path": (PVC_MODEL, "llama/hf"),
    "model.calibration.source.image.reference": (IMAGE_MODEL, "registry.example.com/models/llama-3:2"),
    "model.calibration.source.image.path": (IMAGE_MODEL, "model.gguf"),
    "model.calibration.job.image": (PVC_MODEL, "kvfetcher-hf:other"),
    "model.calibration.job.resources.requests": (PVC_MODEL, QUANTITIES),
    "model.calibration.job.resources.limits": (PVC_MODEL, QUANTITIES),
    "retention.ttlDays": (MANAGED, 30),
    "retention.maxSize": (MANAGED, "2Ti"),
    "retention.evictIntervalSeconds": (MANAGED, 300),
    "retention.dataPolicy": (MANAGED, "Delete"),
    "tenancy.saltFrom": (MANAGED, "PodLabel"),
    "tenancy.labelKey": (LABEL_SALT, "team"),
    "tenancy.secretRef.name": (SECRET_SALT, "other"),
    "tenancy.secretRef.key": (SECRET_SALT, "other"),
}


def leaf_paths(schema: dict[str, Any], prefix: str = "") -> list[str]:
    """Every settable field under `schema` (an object without declared properties counts as one)."""
    if schema.get("type") != "object" or "properties" not in schema:
        return [prefix]
    return [p for key, sub in schema["properties"].items()
            for p in leaf_paths(sub, f"{prefix}.{key}" if prefix else key)]


def changed(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(base)
    *parents, leaf = path.split(".")
    node = spec
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    if path == "tenancy.saltFrom":
        spec["tenancy"]["labelKey"] = "tenant"
    return spec


def built(spec: dict[str, Any]) -> str:
    """Everything the operator builds for a pool."""
    p = pool(spec)
    pod = gpu_pod()
    pod["metadata"]["annotations"][injection.ROPE_THETA_ANNOTATION] = "10000"
    out: dict[str, Any] = {
        "pod": injection.mutate(pod, p).patch,
        "evictor": evictor.deployment(p),
        "secret": builders.secret_values(p, {}, token=lambda n: "t" * n),
    }
    if "calibration" in spec.get("model", {}):
        out["calibration"] = calibration.job(p)
    if "managed" in spec["storage"]:
        out["minio"] = [minio.statefulset(p), *minio.services(p), *minio.guards(p)]
    return json.dumps(out, sort_keys=True)


def test_every_field_of_the_crd_is_in_the_table(pool_schema: dict[str, Any]) -> None:
    assert sorted(leaf_paths(pool_schema["properties"]["spec"])) == sorted(CHANGES)


@pytest.mark.parametrize("path", sorted(CHANGES))
def test_changing_a_field_changes_what_the_operator_does(path: str, pool_schema: dict[str, Any]) -> None:
    base, value = CHANGES[path]
    spec = changed(base, path, value)
    for s in (base, spec):
        assert specs.problems(s) == [] and validate(pool_schema, {"metadata": {"name": "p"}, "spec": s}) == []
    assert built(spec) != built(base), f"{path}: nothing reads it"
