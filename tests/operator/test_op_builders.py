"""The pure builders and the pure pod mutation: every object they make is a valid Kubernetes 1.30
object (strict schema validation), and they say what the design says."""
from __future__ import annotations

import base64
from typing import Any

import kubernetes_validate
import pytest
from pod_security import restricted_violations

from kvfetcher import config as settings
from kvfetcher_operator import builders, conditions, evictor, injection, minio


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
    assert set(first) == {"authToken", "tenantSalt", "objectKey", "accessKey", "secretKey", *builders.CALIBRATOR_KEYS,
                          "endpoint", "bucket"}
    assert first["calibratorAccessKey"] != first["accessKey"]  # the calibration Job's own MinIO user
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
    assert builders.name_problems("x" * 40, MANAGED) == []
    assert builders.name_problems("x" * 41, MANAGED)
    # A managed pool's Services need a DNS label; an external pool only needs a Secret name.
    assert builders.name_problems("1st.pool", MANAGED) and builders.name_problems("1st.pool", EXTERNAL) == []


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
                 "KVFETCHER_S3_SECRET_KEY", "KVFETCHER_AUTH_TOKEN", "KVFETCHER_TENANT", "KVFETCHER_OBJECT_KEY"):
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "cache-kvfetcher", name
    assert env["KVFETCHER_OBJECT_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "objectKey"
    assert env["KVFETCHER_MODEL"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['kvfetcher.io/model']"
    assert env["KVFETCHER_CHUNK_TOKENS"]["value"] == "256"
    # The default store preset needs the model's RoPE base, which this pod does not give; and its
    # sidecar has no GPU (below), so it codes the portable -zstd variant, not nvCOMP's -ans.
    assert env["KVFETCHER_PRESET"]["value"] == "q8-zstd" and "KVFETCHER_ROPE_THETA" not in env
    assert out["metadata"]["annotations"][injection.STORE_ANNOTATION].startswith("q8-zstd (balanced-zstd need")
    assert "KVFETCHER_DECODE_PROCS" not in env and "KVFETCHER_TTFT_BUDGET_S" not in env  # the sidecar's defaults
    # A device-plugin GPU cannot be shared, so the sidecar gets none, explicitly, and the pod says so.
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "void"
    assert out["metadata"]["annotations"][injection.GPU_ANNOTATION].startswith("none")
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "compute,utility,video"
    assert side["args"] == ["serve", "--port", "8500", "--socket", "/run/kvfetcher/kvfetcher.sock"]
    assert side["readinessProbe"]["httpGet"]["path"] == "/servingz"  # the socket served, not the store
    assert "nvidia.com/gpu" not in str(side["resources"])
    assert out["spec"]["shareProcessNamespace"] is True
    model = out["spec"]["containers"][1]
    assert {"name": "KVFETCHER_SOCKET", "value": injection.SOCKET} in model["env"]
    assert "volumeMounts" not in out["spec"]["containers"][0]  # the GPU container, not the first one
    assert [v["name"] for v in out["spec"]["volumes"]] == ["kvfetcher-socket"]  # buffers are memfds: no /dev/shm
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
        pod["metadata"]["annotations"][injection.ROPE_THETA_ANNOTATION] = "500000"
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
    assert all(m["mountPath"] != "/dev/shm" for m in side["volumeMounts"])  # buffers are memfds, passed over the socket
    assert [v["name"] for v in out["spec"]["volumes"]] == ["dshm", "kvfetcher-socket", "kvfetcher-s3-ca"]
    assert out["metadata"]["annotations"][injection.GPU_ANNOTATION] == "shares the model container's resource claims"


@pytest.mark.parametrize("the_pool,pod_change,reason", [
    (None, None, "no Ready KVCachePool ml/cache with injection enabled"),
    (pool(MANAGED, ready=False), None, "no Ready KVCachePool ml/cache with injection enabled"),
    (pool({**MANAGED, "injection": {"enabled": False}}), None, "no Ready KVCachePool ml/cache with injection enabled"),
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


def restricted_pod(**model: Any) -> dict[str, Any]:
    pod = gpu_pod(**model)
    pod["spec"]["securityContext"] = {"runAsNonRoot": True, "runAsUser": 2000, "runAsGroup": 2000,
                                      "seccompProfile": {"type": "RuntimeDefault"}}
    for c in pod["spec"]["containers"]:
        c["securityContext"] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    return pod


def test_injected_pod_stays_pod_security_restricted() -> None:
    """A restricted model pod is still restricted once injected; the model joins the socket's group."""
    pod = restricted_pod(resources={"limits": {"nvidia.com/gpu": "1"}})
    assert restricted_violations(pod["spec"]) == []
    out = injection.apply_merge_patch(pod, injection.mutate(pod, pool(MANAGED)).patch)
    valid(out)
    assert restricted_violations(out["spec"]) == []
    assert out["spec"]["securityContext"]["supplementalGroups"] == [injection.SIDECAR_UID]
    assert out["spec"]["securityContext"]["runAsUser"] == 2000  # the pod's own settings stay
    # Without the pod-level settings, the sidecar alone is still compliant.
    bare = gpu_pod()
    out = injection.apply_merge_patch(bare, injection.mutate(bare, pool(MANAGED)).patch)
    assert [v for v in restricted_violations(out["spec"]) if v.startswith("kvfetcher")] == []


def test_restricted_check_catches_what_the_profile_forbids() -> None:
    pod = restricted_pod()
    pod["spec"]["containers"][0]["securityContext"] = {"allowPrivilegeEscalation": False}
    pod["spec"]["volumes"] = [{"name": "host", "hostPath": {"path": "/"}}]
    found = restricted_violations(pod["spec"])
    assert any("capabilities must drop ALL" in v for v in found) and any("hostPath" in v for v in found)


def test_gpu_access_follows_the_models_allocation() -> None:
    """Never NVIDIA_VISIBLE_DEVICES=all; the model's own device list is shared, 'all' is not."""
    listed = gpu_pod(env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "GPU-1234"}], resources={"limits": {"nvidia.com/gpu": "1"}})
    side = injection.apply_merge_patch(listed, injection.mutate(listed, pool(MANAGED)).patch)["spec"]["initContainers"][0]
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "GPU-1234"} in side["env"]
    everything = gpu_pod(env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}], resources={"limits": {"nvidia.com/gpu": "1"}})
    side = injection.apply_merge_patch(everything, injection.mutate(everything, pool(MANAGED)).patch)
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in side["spec"]["initContainers"][0]["env"]


@pytest.mark.parametrize("change,reason", [
    (lambda p: p["spec"].update(volumes=[{"name": "kvfetcher-socket", "emptyDir": {}}]), "volume name kvfetcher-socket"),
    (lambda p: p["spec"]["containers"][0].update(volumeMounts=[{"name": "x", "mountPath": "/run/kvfetcher/"}]),
     "mount path /run/kvfetcher"),
    (lambda p: p["spec"]["containers"][0].update(ports=[{"containerPort": 8500}]), "port 8500"),
    (lambda p: p["metadata"]["labels"].pop("tenant"), "pod label tenant, which the pod lacks"),
], ids=["volume", "mount", "port", "tenant-label"])
def test_collisions_and_missing_tenant_label_skip_with_a_reason(change, reason) -> None:
    """The webhook never makes a pod the API server rejects, nor one that shares an empty salt."""
    pod = gpu_pod()
    change(pod)
    decision = injection.mutate(pod, pool({**MANAGED, "tenancy": EXTERNAL["tenancy"]}))
    assert decision.outcome == "skipped" and reason in decision.reason
    assert "initContainers" not in injection.apply_merge_patch(pod, decision.patch)["spec"]


def test_the_patch_never_removes_an_absent_annotation() -> None:
    """kopf turns a None into a JSON-patch remove, which the API server rejects for a missing key."""
    pod = gpu_pod()
    patch = injection.mutate(pod, pool(MANAGED)).patch
    assert injection.SKIPPED_ANNOTATION not in patch["metadata"]["annotations"]
    pod["metadata"]["annotations"][injection.SKIPPED_ANNOTATION] = "earlier skip"
    assert injection.mutate(pod, pool(MANAGED)).patch["metadata"]["annotations"][injection.SKIPPED_ANNOTATION] is None


def test_minio_is_restricted_spread_and_fenced() -> None:
    """Restricted, no token, spread over nodes; no console; S3 only from peers, pods, operator."""
    p = pool(MANAGED)
    sts = minio.statefulset(p)
    spec = sts["spec"]["template"]["spec"]
    assert restricted_violations(spec) == []
    assert spec["automountServiceAccountToken"] is False
    assert spec["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert "MINIO_PROMETHEUS_AUTH_TYPE" not in env and env["MINIO_BROWSER"] == "off"
    assert all(port["port"] == 9000 for s in minio.services(p) for port in s["spec"]["ports"])
    pdb, netpol = minio.guards(p, "kvfetcher-system")
    for obj in (pdb, netpol):
        valid(obj)
    sources = netpol["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {"kvfetcher.io/inject": "true"}}} in sources
    assert sources[2]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "kvfetcher-system"}}
    assert sources[3] == {"podSelector": {"matchLabels": evictor.deployment(p)["spec"]["selector"]["matchLabels"]}}


def test_a_review_cannot_tell_a_missing_pool_from_an_unusable_one() -> None:
    """Anyone reaching the webhook port can send reviews naming any namespace; an absent,
    a disabled and a not-Ready pool get the same patch (the reason differs in the operator's log only)."""
    decisions = [injection.mutate(gpu_pod(), p) for p in (
        None, pool(MANAGED, ready=False), pool({**MANAGED, "injection": {"enabled": False}}))]
    assert decisions[0].patch == decisions[1].patch == decisions[2].patch
    assert len({d.reason for d in decisions}) == 3
