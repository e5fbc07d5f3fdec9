"""The KVCachePool CRD: a valid Kubernetes object, the examples pass it, bad pools fail it, and
the operator's own validation and defaults agree with it."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from crd_check import apply_defaults, validate

from kvfetcher_operator import spec as specs

REPO = Path(__file__).resolve().parents[2]


def pool(spec: dict[str, Any], name: str = "p") -> dict[str, Any]:
    return {"apiVersion": "kvfetcher.io/v1alpha1", "kind": "KVCachePool",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}


MANAGED = {"storage": {"managed": {}}}
EXTERNAL = {"storage": {"external": {"endpoint": "https://s3.example.com", "bucket": "kv-cache",
                                     "credentialsSecretRef": {"name": "creds"}}}}


def test_crd_is_a_valid_kubernetes_1_30_object(crd: dict[str, Any]) -> None:
    kubernetes_validate.validate(crd, "1.30.0", strict=True)
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["kvp"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'


def example_pools() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "KVCachePool":
                out.append((path.name, doc))
    return out


@pytest.mark.parametrize("name,doc", example_pools(), ids=[n for n, _ in example_pools()])
def test_example_pools_pass_the_crd_and_the_operator(name: str, doc: dict[str, Any],
                                                     pool_schema: dict[str, Any]) -> None:
    assert validate(pool_schema, doc) == []
    assert specs.problems(doc["spec"]) == []


def test_other_examples_are_valid_kubernetes_objects() -> None:
    docs = [d for p in sorted((REPO / "examples").glob("*.yaml"))
            for d in yaml.safe_load_all(p.read_text()) if d and d.get("kind") != "KVCachePool"]
    assert {d["kind"] for d in docs} == {"Secret", "Deployment"}
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)


@pytest.mark.parametrize("base", [MANAGED, EXTERNAL], ids=["managed", "external"])
def test_operator_defaults_equal_the_crd_defaults(base: dict[str, Any], pool_schema: dict[str, Any],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The same but for the images: the CRD defaults none, so that the operator's configured ones
    (the chart's, a registry mirror's) reach every pool that names none."""
    from_crd = apply_defaults(pool_schema, pool(base))["spec"]
    monkeypatch.setenv("KVFETCHER_SIDECAR_IMAGE", "mirror.example.com/kvfetcher/kvfetcher-sidecar:9.9")
    monkeypatch.setenv("KVFETCHER_MINIO_IMAGE", "mirror.example.com/minio/minio:tag")
    ours = specs.with_defaults(base)
    assert ours["sidecar"].pop("image") == "mirror.example.com/kvfetcher/kvfetcher-sidecar:9.9"
    if "managed" in ours["storage"]:
        assert ours["storage"]["managed"].pop("image") == "mirror.example.com/minio/minio:tag"
    assert ours == from_crd


def _with(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(base)
    *parents, leaf = path.split(".")
    node = spec
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return spec


MODEL = _with(MANAGED, "model", {"name": "llama-3/bf16", "calibration": {
    "source": {"persistentVolumeClaim": {"claimName": "models", "path": "llama-3.gguf"}}}})

BAD = [
    ("both storages", {"storage": {**MANAGED["storage"], **EXTERNAL["storage"]}}, "exactly one"),
    ("no storage kind", {"storage": {}}, "exactly one"),
    ("2 MinIO replicas", _with(MANAGED, "storage.managed.replicas", 2), "replicas"),
    ("bad size", _with(MANAGED, "storage.managed.size", "lots"), "size"),
    ("bad bucket", _with(EXTERNAL, "storage.external.bucket", "Has_Caps"), "bucket"),
    ("endpoint with path", _with(EXTERNAL, "storage.external.endpoint", "https://s3/x/y"), "endpoint"),
    ("tls on http", _with(_with(EXTERNAL, "storage.external.endpoint", "http://s3:9000"),
                          "storage.external.tls", {"insecureSkipVerify": True}), "https"),
    ("ca and insecure", _with(EXTERNAL, "storage.external.tls",
                              {"insecureSkipVerify": True, "caSecretRef": {"name": "ca"}}), "exclude"),
    ("unknown preset", _with(MANAGED, "codec.defaultPreset", "lossy"), "defaultPreset"),
    ("default outside allowed", _with(MANAGED, "codec", {"defaultPreset": "raw", "allowedPresets": ["q8"]}),
     "defaultPreset"),
    ("auto is not a preset to allow", _with(MANAGED, "codec.allowedPresets", ["auto"]), "allowedPresets"),
    ("no presets", _with(MANAGED, "codec.allowedPresets", []), "allowedPresets"),
    ("odd chunk", _with(MANAGED, "codec.chunkTokens", 100), "chunkTokens"),
    ("tiny chunk", _with(MANAGED, "codec.chunkTokens", 8), "chunkTokens"),
    ("privileged port", _with(MANAGED, "sidecar.port", 80), "port"),
    ("too many decode processes", _with(MANAGED, "sidecar.decodeProcesses", 64), "decodeProcesses"),
    ("zero ttft budget", _with(MANAGED, "sidecar.ttftBudgetSeconds", 0), "ttftBudgetSeconds"),
    ("ttft budget as text", _with(MANAGED, "sidecar.ttftBudgetSeconds", "2s"), "ttftBudgetSeconds"),
    ("zero ttl", _with(MANAGED, "retention.ttlDays", 0), "ttlDays"),
    ("bad maxSize", _with(MANAGED, "retention.maxSize", "1 TB"), "maxSize"),
    ("bad policy", _with(MANAGED, "retention.dataPolicy", "Archive"), "dataPolicy"),
    ("label salt without label", _with(MANAGED, "tenancy.saltFrom", "PodLabel"), "labelKey"),
    ("secret salt without secret", _with(MANAGED, "tenancy.saltFrom", "Secret"), "secretRef"),
    # What the webhook copies into a pod must be valid there.
    ("label key not a qualified name", _with(_with(MANAGED, "tenancy.saltFrom", "PodLabel"), "tenancy.labelKey",
                                             "team']; x['"), "labelKey"),
    ("sidecar resources not quantities", _with(MANAGED, "sidecar.resources", {"limits": {"memory": "lots"}}),
     "sidecar.resources"),
    ("MinIO resources not quantities", _with(MANAGED, "storage.managed.resources", {"requests": {"cpu": "1 core"}}),
     "storage.managed.resources"),
    # Sizes above zero, endpoints without user info or query, S3's bucket rules.
    ("zero size", _with(MANAGED, "storage.managed.size", "0"), "size"),
    ("zero maxSize", _with(MANAGED, "retention.maxSize", "0Gi"), "maxSize"),
    ("endpoint with user info", _with(EXTERNAL, "storage.external.endpoint", "https://u:p@s3.example.com"), "endpoint"),
    ("endpoint with query", _with(EXTERNAL, "storage.external.endpoint", "https://s3.example.com?x=1"), "endpoint"),
    ("bucket with double dot", _with(EXTERNAL, "storage.external.bucket", "kv..cache"), "bucket"),
    ("bucket like an IP", _with(EXTERNAL, "storage.external.bucket", "192.168.5.4"), "bucket"),
    ("bucket with xn-- prefix", _with(MANAGED, "storage.managed.bucket", "xn--cache"), "bucket"),
    # The model: a fingerprint whose tag files its calibration; one source, a path inside it.
    ("model without a name", _with(MANAGED, "model", {}), "model.name"),
    ("model name with an empty tag", _with(MANAGED, "model.name", "/llama"), "model.name"),
    ("model name with a space", _with(MANAGED, "model.name", "llama 3"), "model.name"),
    ("calibration without a source", _with(MODEL, "model.calibration", {"source": {}}), "exactly one"),
    ("calibration from two sources", _with(MODEL, "model.calibration.source", {
        "persistentVolumeClaim": {"claimName": "m", "path": "x.gguf"}, "image": {"reference": "m:1", "path": "x"}}),
     "exactly one"),
    ("model path outside the volume", _with(MODEL, "model.calibration.source.persistentVolumeClaim.path",
                                            "../etc/passwd"), "path"),
    ("absolute model path", _with(MODEL, "model.calibration.source.persistentVolumeClaim.path", "/etc"), "path"),
    ("model image without a reference", _with(MODEL, "model.calibration.source", {"image": {"path": "x"}}),
     "reference"),
    ("calibration Job resources not quantities", _with(MODEL, "model.calibration.job.resources",
                                                       {"limits": {"memory": "lots"}}), "job.resources"),
]


@pytest.mark.parametrize("case,spec,word", BAD, ids=[c for c, _, _ in BAD])
def test_bad_pools_are_refused_by_the_crd_and_by_the_operator(case: str, spec: dict[str, Any], word: str,
                                                               pool_schema: dict[str, Any]) -> None:
    crd_errors = validate(pool_schema, pool(spec))
    assert crd_errors, f"the CRD accepted: {case}"
    operator_errors = specs.problems(spec)
    assert any(word in e for e in operator_errors), operator_errors


def test_long_names_are_refused(pool_schema: dict[str, Any]) -> None:
    assert validate(pool_schema, pool(MANAGED, name="x" * 41))
    assert validate(pool_schema, pool(MANAGED, name="x" * 40)) == []


def test_valid_quantities_and_names_are_accepted(pool_schema: dict[str, Any]) -> None:
    """Everything Kubernetes calls a quantity is one here too."""
    for size in ("1e3", "500m", "1Ei", "50Gi", "1.5T", "+2Gi"):
        spec = _with(MANAGED, "retention.maxSize", size)
        assert validate(pool_schema, pool(spec)) == [] and specs.problems(spec) == [], size
    spec = _with(MANAGED, "sidecar.resources", {"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"cpu": 2}})
    assert validate(pool_schema, pool(spec)) == [] and specs.problems(spec) == []
    assert validate(pool_schema, pool(EXTERNAL, name="1st.pool")) == []  # external: no Service to name
    assert validate(pool_schema, pool(MANAGED, name="1st.pool")) and \
        validate(pool_schema, pool(MANAGED, name="first-pool")) == []


def test_quantities() -> None:
    assert specs.quantity_bytes("1e3") == 1000 and specs.quantity_bytes("1Ei") == 2**60
    assert specs.quantity_bytes("500m") == 1  # rounded up to whole bytes
    assert specs.quantity_bytes("50Gi") == 50 * 2**30
    assert specs.quantity_bytes("1.5T") == 1_500_000_000_000
    with pytest.raises(ValueError):
        specs.quantity_bytes("1 TB")
