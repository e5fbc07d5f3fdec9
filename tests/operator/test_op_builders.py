"""The pure builders and the pure pod mutation: every object they make is a valid Kubernetes 1.30
object (strict schema validation), and they say what the design says."""
from __future__ import annotations

import base64
from typing import Any

import kubernetes_validate
import pytest

from kvfetcher import config as settings
from kvfetcher_operator import builders, conditions, injection, minio


def pool(spec: dict[str, Any], name: str = "cache", ready: bool = True) -> dict[str, Any]:
    conds = conditions.put([], "Ready", ready, "Ready" if ready else "MinIOStarting", "", 1, at="2026-01-01T00:00:00Z")
    return {"metadata": {"name": name, "namespace": "ml", "uid": "u-1", "generation": 1},
            "spec": spec, "status": {"conditions": conds, "phase": "Ready" if ready else "Provisioning"}}


MANAGED = {"storage": {"managed": {"replicas": 4, "size": "100Gi", "storageClassName": "ssd"}},
           "retention": {"dataPolicy": "Delete", "maxSize": "1Ti"}}
EXTERNAL = {"storage": {"external": {"endpoint": "https://s3.example.com/", "bucket": "kv", "region": "eu-1",
                                     "credentialsSecretRef": {"name": "creds", "accessKeyKey": "id"},
                                     "tls": {"caSecretRef": {"name": "ca"}}}},
            "tenancy": {"saltFrom": "PodLabel", "labelKey": "tenant"}}


def valid(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, "1.30.0", strict=True)


def test_minio_children_are_valid_and_owned() -> None:
    p = pool(MANAGED)
    sts = minio.statefulset(p)
    for obj in [sts, *minio.services(p), builders.secret(p, builders.secret_values(p, None))]:
        valid(obj)
        assert obj["metadata"]["ownerReferences"] == [builders.owner_reference(p)]
        assert obj["metadata"]["namespace"] == "ml"
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Delete"
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "ssd"
    assert sts["spec"]["template"]["spec"]["containers"][0]["args"][1] == \
        "http://cache-minio-{0...3}.cache-minio-hl.ml.svc.cluster.local/data"
    standalone = minio.statefulset(pool({"storage": {"managed": {}}}))
    assert standalone["spec"]["template"]["spec"]["containers"][0]["args"][1] == "/data"
    assert standalone["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Retain"


def test_secret_values_are_kept_and_completed() -> None:
    p = pool(MANAGED)
    tokens = iter(f"token{i}" * 8 for i in range(10))
    first = builders.secret_values(p, None, token=lambda n: next(tokens))
    assert set(first) == {"authToken", "tenantSalt", "accessKey", "secretKey", "endpoint", "bucket"}
    assert first["endpoint"] == "http://cache-minio.ml.svc:9000" and first["bucket"] == "kvcache"
    again = builders.secret_values(p, {k: v for k, v in first.items() if k != "tenantSalt"},
                                   token=lambda n: "fresh")
    assert {k: v for k, v in again.items() if k != "tenantSalt"} == \
        {k: v for k, v in first.items() if k != "tenantSalt"}
    assert again["tenantSalt"] == "fresh"
    secret = builders.secret(p, first)
    assert base64.b64decode(secret["data"]["secretKey"]).decode() == first["secretKey"]
    external = builders.secret_values(pool(EXTERNAL), None)
    assert "accessKey" not in external and external["endpoint"] == "https://s3.example.com"


def test_names_have_limits() -> None:
    assert builders.name_problems("x" * 40) == []
    assert builders.name_problems("x" * 41)


def gpu_pod(**extra: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "m", "namespace": "ml", "annotations": {injection.POOL_ANNOTATION: "cache"},
                         "labels": {injection.INJECT_LABEL: "true", "tenant": "a"}},
            "spec": {"containers": [{"name": "proxy", "image": "envoy"},
                                    {"name": "model", "image": "vllm", **extra}]}}


def test_injection_into_a_device_plugin_pod() -> None:
    pod = gpu_pod(resources={"limits": {"nvidia.com/gpu": "1"}})
    decision = injection.mutate(pod, pool(MANAGED))
    assert decision.outcome == "injected"
    out = injection.apply_merge_patch(pod, decision.patch)
    valid(out)
    side = out["spec"]["initContainers"][0]
    env = {e["name"]: e for e in side["env"]}
    for name in ("KVFETCHER_S3_ENDPOINT", "KVFETCHER_S3_BUCKET", "KVFETCHER_S3_ACCESS_KEY",
                 "KVFETCHER_S3_SECRET_KEY", "KVFETCHER_AUTH_TOKEN", "KVFETCHER_TENANT"):
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "cache-kvfetcher", name
    assert env["KVFETCHER_CHUNK_TOKENS"]["value"] == "256" and env["KVFETCHER_PRESET"]["value"] == "auto"
    assert "KVFETCHER_DECODE_PROCS" not in env and "KVFETCHER_TTFT_BUDGET_S" not in env  # the sidecar's defaults
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "compute,utility,video"
    assert side["args"] == ["serve", "--port", "8500", "--socket", "/run/kvfetcher/kvfetcher.sock"]
    assert side["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert "nvidia.com/gpu" not in str(side["resources"])
    assert out["spec"]["shareProcessNamespace"] is True
    model = out["spec"]["containers"][1]
    assert {"name": "KVFETCHER_SOCKET", "value": injection.SOCKET} in model["env"]
    assert "volumeMounts" not in out["spec"]["containers"][0]  # the GPU container, not the first one
    assert {"name": "kvfetcher-shm", "mountPath": "/dev/shm"} in model["volumeMounts"]
    assert {"name": "kvfetcher-shm", "mountPath": "/dev/shm"} in side["volumeMounts"]
    assert {"name": "kvfetcher-shm", "emptyDir": {"medium": "Memory"}} in out["spec"]["volumes"]
    assert injection.mutate(out, pool(MANAGED)).outcome == "unchanged"


def test_the_operator_injects_exactly_the_settings_marked_injected() -> None:
    """Across pools that use every optional field, the operator sets in each container exactly the
    settings that container's table marks injected (and the NVIDIA runtime's variables)."""
    external = EXTERNAL["storage"]["external"]
    insecure = {"storage": {"external": {**external, "tls": {"insecureSkipVerify": True}}},
                "tenancy": {"saltFrom": "Secret", "secretRef": {"name": "t", "key": "salt"}}}
    tuned = {**EXTERNAL, "sidecar": {"decodeProcesses": 4, "ttftBudgetSeconds": 1.5}}
    sidecar: set[str] = set()
    model: set[str] = set()
    for spec in (MANAGED, tuned, insecure):
        pod = gpu_pod(resources={"limits": {"nvidia.com/gpu": "1"}})
        out = injection.apply_merge_patch(pod, injection.mutate(pod, pool(spec)).patch)
        sidecar |= {e["name"] for e in out["spec"]["initContainers"][0]["env"]}
        model |= {e["name"] for e in out["spec"]["containers"][1]["env"]}
    assert {n for n in sidecar if not n.startswith("NVIDIA_")} == {s.name for s in settings.SIDECAR if s.inject}
    assert model == {s.name for s in settings.CLIENT if s.inject}


def test_injection_with_dra_claims_external_storage_and_label_salt() -> None:
    pod = gpu_pod(resources={"claims": [{"name": "gpu"}]}, volumeMounts=[{"name": "dshm", "mountPath": "/dev/shm"}])
    pod["spec"]["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}]
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "source": {"resourceClaimTemplateName": "one-gpu"}}]  # 1.30 shape
    mps = {**EXTERNAL, "sidecar": {"decodeProcesses": 4, "ttftBudgetSeconds": 1.5}}
    out = injection.apply_merge_patch(pod, injection.mutate(pod, pool(mps)).patch)
    valid(out)
    side = out["spec"]["initContainers"][0]
    env = {e["name"]: e for e in side["env"]}
    assert side["resources"]["claims"] == [{"name": "gpu"}] and "NVIDIA_VISIBLE_DEVICES" not in env
    assert env["KVFETCHER_DECODE_PROCS"]["value"] == "4" and env["KVFETCHER_TTFT_BUDGET_S"]["value"] == "1.5"
    assert env["KVFETCHER_S3_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "creds", "key": "id"}
    assert env["KVFETCHER_TENANT"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['tenant']"
    assert env["KVFETCHER_S3_CA_FILE"]["value"] == "/etc/kvfetcher/s3-ca/ca.crt"
    assert {"name": "kvfetcher-s3-ca", "mountPath": "/etc/kvfetcher/s3-ca", "readOnly": True} in side["volumeMounts"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in side["volumeMounts"]  # the model's own /dev/shm
    assert [v["name"] for v in out["spec"]["volumes"]] == ["dshm", "kvfetcher-socket", "kvfetcher-s3-ca"]


@pytest.mark.parametrize("the_pool,pod_change,reason", [
    (None, None, "not found"),
    (pool(MANAGED, ready=False), None, "is not Ready (phase Provisioning)"),
    (pool({**MANAGED, "injection": {"enabled": False}}), None, "injection disabled"),
    (pool({**MANAGED, "injection": {"modelContainer": "llm"}}), None, "'llm' not found"),
    (pool(MANAGED), "no-annotation", "no kvfetcher.io/pool annotation"),
])
def test_skipped_pods_pass_unchanged_with_a_reason(the_pool, pod_change, reason) -> None:
    pod = gpu_pod()
    if pod_change == "no-annotation":
        pod["metadata"]["annotations"] = {}
    decision = injection.mutate(pod, the_pool)
    assert decision.outcome == "skipped"
    out = injection.apply_merge_patch(pod, decision.patch)
    assert reason in out["metadata"]["annotations"][injection.SKIPPED_ANNOTATION]
    assert out["spec"] == pod["spec"]
    valid(out)


def test_conditions_keep_transition_time_until_status_flips() -> None:
    c = conditions.put([], "Ready", False, "Starting", "wait", 1, at="t1")
    c = conditions.put(c, "Ready", False, "StillStarting", "wait more", 2, at="t2")
    assert conditions.find(c, "Ready")["lastTransitionTime"] == "t1"
    assert conditions.find(c, "Ready")["observedGeneration"] == 2
    c2 = conditions.put(c, "Ready", True, "Ready", "ok", 2, at="t3")
    assert conditions.find(c2, "Ready")["lastTransitionTime"] == "t3"
    assert conditions.changed(c, c2, "Ready") and not conditions.changed(c2, c2, "Ready")
    c3 = conditions.put(c2, "ConfigValid", True, "Valid", "", 2, at="t3")
    assert [x["type"] for x in c3] == ["Ready", "ConfigValid"]
