"""The operator end to end: kopf with the real handlers against a Kubernetes API emulator (kmock)
over HTTP; the bucket step against a real S3 server (moto) on loopback.

What the emulator does not do, the tests do in its place, and say so: it sets no
resourceVersion or generation (the test objects carry them as an API server would set them),
runs no StatefulSet controller (the test writes readyReplicas) and no garbage collector.
"""
from __future__ import annotations

import asyncio
import base64
import ssl
import uuid
from typing import Any

import aiohttp
import jsonpatch
import kubernetes_validate
import pytest
from op_helpers import POOLS, Api, cond, external_pool, is_ready, run_operator, s3_secret

from kvfetcher_operator import bucket, builders, injection


def managed_pool(name: str, **spec: Any) -> dict[str, Any]:
    pool = external_pool(name, "http://unused", "unused")
    pool["spec"] = {"storage": {"managed": {"replicas": 1, "size": "10Gi"}}, **spec}
    return pool


def events(api: Api, name: str) -> list[dict[str, Any]]:
    """Events the operator posted about a pool, read from the requests the emulator received."""
    out = []
    for request in api.emulator:
        if request.method == "POST" and request.resource is not None and request.resource.plural == "events":
            if (request.data or {}).get("involvedObject", {}).get("name") == name:
                out.append(request.data)
    return out


async def test_external_pool_becomes_ready_with_bucket_and_evictor(operator, api: Api, s3: str) -> None:
    await api.create("v1/secrets", s3_secret())
    await api.create(POOLS, external_pool("ext", s3, "ext-bucket", retention={"ttlDays": 3}))
    pool = await api.wait_for(POOLS, "default", "ext", is_ready)
    status = pool["status"]
    assert status["phase"] == "Ready" and status["observedGeneration"] == 1
    assert status["endpoint"] == s3 and status["bucket"] == "ext-bucket"
    assert {c["type"]: c["status"] for c in status["conditions"]} == {  # no evictor pod runs here
        "Ready": "True", "StorageReady": "True", "ConfigValid": "True", "InjectionReady": "True", "EvictorReady": "False"}
    assert cond(pool, "StorageReady")["reason"] == "BucketReady"
    assert bucket.ttl_days(bucket.Target(s3, "ext-bucket", "testing", "testing")) is None  # the evictor's job
    deployment = await api.get("apps/v1/deployments", "default", "ext-evictor")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "evict", "--store", f"{s3}/ext-bucket", "--ttl-days", "3", "--every", "60"]
    secret = await api.get("v1/secrets", "default", "ext-kvfetcher")
    values = builders.decode_secret_data(secret["data"])
    assert values["endpoint"] == s3 and values["bucket"] == "ext-bucket" and len(values["authToken"]) > 30
    assert "accessKey" not in values  # external credentials stay in the user's Secret
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-ext"
    assert any(e["reason"] == "BucketReady" for e in events(api, "ext"))


async def test_invalid_spec_gets_config_valid_false_with_reason(operator, api: Api) -> None:
    bad = managed_pool("bad", codec={"defaultPreset": "raw", "allowedPresets": ["exact", "q8"],
                                     "chunkTokens": 100})
    bad["spec"]["storage"]["managed"]["replicas"] = 2
    await api.create(POOLS, bad)
    pool = await api.wait_for(POOLS, "default", "bad", lambda o: cond(o, "ConfigValid").get("status") == "False")
    valid = cond(pool, "ConfigValid")
    assert valid["reason"] == "InvalidSpec"
    assert "replicas" in valid["message"] and "chunkTokens" in valid["message"]
    assert "defaultPreset" in valid["message"]
    assert pool["status"]["phase"] == "Failed" and cond(pool, "Ready")["status"] == "False"
    assert await api.get("v1/secrets", "default", "bad-kvfetcher") is None  # nothing built from a bad spec
    assert await api.get("apps/v1/statefulsets", "default", "bad-minio") is None
    warnings = [e for e in events(api, "bad") if e["type"] == "Warning"]
    assert any(e["reason"] == "InvalidSpec" for e in warnings)

    # Fixing the spec (a new generation) makes it valid; storage then has its own say.
    fixed = {"spec": {"codec": {"defaultPreset": "auto", "allowedPresets": ["exact", "q8"], "chunkTokens": 128},
                      "storage": {"managed": {"replicas": 1}}}, "metadata": {"generation": 2}}
    await api.patch(POOLS, "default", "bad", fixed)
    pool = await api.wait_for(POOLS, "default", "bad", lambda o: cond(o, "ConfigValid").get("status") == "True")
    assert pool["status"]["observedGeneration"] == 2


async def test_managed_pool_builds_minio_and_waits_for_it(operator, api: Api) -> None:
    await api.create(POOLS, managed_pool("mgd", retention={"dataPolicy": "Delete"}))
    pool = await api.wait_for(POOLS, "default", "mgd", lambda o: cond(o, "StorageReady").get("reason") == "MinIOStarting")
    assert pool["status"]["phase"] == "Provisioning"
    # Not just a count: why no replica is ready (here: no pod was ever created).
    assert cond(pool, "StorageReady")["message"].startswith("0/1 MinIO replicas ready; 0 of 1 pods exist")
    sts = await api.get("apps/v1/statefulsets", "default", "mgd-minio")
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Delete"
    assert sts["metadata"]["ownerReferences"][0]["kind"] == "KVCachePool"
    for name in ("mgd-minio", "mgd-minio-hl"):
        service = await api.get("v1/services", "default", name)
        assert service["metadata"]["ownerReferences"] and [p["port"] for p in service["spec"]["ports"]] == [9000]
    assert (await api.get("policy/v1/poddisruptionbudgets", "default", "mgd-minio"))["spec"]["maxUnavailable"] == 1
    netpol = await api.get("networking.k8s.io/v1/networkpolicies", "default", "mgd-minio")
    assert netpol["spec"]["ingress"][0]["ports"] == [{"port": 9000, "protocol": "TCP"}]
    creds = builders.decode_secret_data((await api.get("v1/secrets", "default", "mgd-kvfetcher"))["data"])
    assert creds["accessKey"] and creds["secretKey"] and creds["endpoint"] == "http://mgd-minio.default.svc:9000"
    # MinIO's root is in its own Secret, the pool's Secret holds the sidecars' user.
    root = await api.get("v1/secrets", "default", "mgd-minio-root")
    assert root["metadata"]["ownerReferences"][0]["uid"] == "uid-mgd"
    assert builders.decode_secret_data(root["data"])["rootUser"] != creds["accessKey"]

    # The emulator runs no StatefulSet controller: report the replica ready as one would.
    # MinIO itself cannot run here, so the bucket call to the in-cluster name must fail, and say so.
    await api.patch("apps/v1/statefulsets", "default", "mgd-minio", {"status": {"readyReplicas": 1}})
    pool = await api.wait_for(POOLS, "default", "mgd",
                              lambda o: cond(o, "StorageReady").get("reason") == "BucketUnavailable")
    assert "mgd-minio.default.svc" in cond(pool, "StorageReady")["message"]
    assert cond(pool, "Ready")["status"] == "False"

    # Scaling to 4 replicas patches the StatefulSet into distributed mode, and only its mutable
    # fields: the new volume size cannot be applied to the claim templates, and an Event says so.
    await api.patch(POOLS, "default", "mgd", {"spec": {"storage": {"managed": {"replicas": 4, "size": "20Gi"}}},
                                              "metadata": {"generation": 2}})
    sts = await api.wait_for("apps/v1/statefulsets", "default", "mgd-minio", lambda o: o["spec"]["replicas"] == 4)
    assert "{0...3}" in sts["spec"]["template"]["spec"]["containers"][0]["args"][1]
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "10Gi"
    for _ in range(50):
        if any(e["reason"] == "VolumeChangeNotApplied" and "10Gi" in e["message"] for e in events(api, "mgd")):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(f"no VolumeChangeNotApplied event: {events(api, 'mgd')}")
    after = builders.decode_secret_data((await api.get("v1/secrets", "default", "mgd-kvfetcher"))["data"])
    assert after["secretKey"] == creds["secretKey"]  # credentials are never rotated under the data


async def test_update_and_delete_with_data_policy(operator, api: Api, s3: str) -> None:
    await api.create("v1/secrets", s3_secret())
    target = bucket.Target(s3, "doomed", "testing", "testing")
    await api.create(POOLS, external_pool("gone", s3, "doomed", retention={"dataPolicy": "Delete"}))
    await api.wait_for(POOLS, "default", "gone", is_ready)
    bucket.client(target).put_object("doomed", bucket.PREFIX + "ab/abc/raw.kvfc", __import__("io").BytesIO(b"kv"), 2)

    await api.patch(POOLS, "default", "gone", {"spec": {"retention": {"ttlDays": 30}}, "metadata": {"generation": 2}})
    await api.wait_for(POOLS, "default", "gone", lambda o: (o["status"].get("observedGeneration") == 2
                                                            and is_ready(o)))

    await api.delete(POOLS, "default", "gone")
    await api.wait_for(POOLS, "default", "gone", lambda o: o is None)
    assert not bucket.client(target).bucket_exists("doomed")
    assert any(e["reason"] == "DataDeleted" for e in events(api, "gone"))


async def test_retain_policy_releases_the_credentials(operator, api: Api) -> None:
    await api.create(POOLS, managed_pool("kept"))
    await api.wait_for("v1/secrets", "default", "kept-kvfetcher", lambda o: o is not None)
    await api.delete(POOLS, "default", "kept")
    await api.wait_for(POOLS, "default", "kept", lambda o: o is None)
    for name in ("kept-kvfetcher", "kept-minio-root"):  # kept for the retained volumes
        secret = await api.get("v1/secrets", "default", name)
        assert not secret["metadata"].get("ownerReferences")


async def test_missing_credentials_are_explained(operator, api: Api, s3: str) -> None:
    await api.create(POOLS, external_pool("nocreds", s3, "nocreds"))
    pool = await api.wait_for(POOLS, "default", "nocreds",
                              lambda o: cond(o, "StorageReady").get("reason") == "CredentialsMissing")
    assert "default/s3-creds not found" in cond(pool, "StorageReady")["message"]
    await api.create("v1/secrets", s3_secret())  # the retry picks it up
    await api.wait_for(POOLS, "default", "nocreds", is_ready)


async def test_resume_after_restart_changes_nothing(api: Api, s3: str, request: pytest.FixtureRequest) -> None:
    """A second operator process over the same cluster state keeps credentials and readiness."""
    await api.create("v1/secrets", s3_secret())
    async with run_operator(request):
        await api.create(POOLS, external_pool("again", s3, "again"))
        await api.wait_for(POOLS, "default", "again", is_ready)
        first = (await api.get("v1/secrets", "default", "again-kvfetcher"))["data"]
    seen = len(list(api.emulator))
    async with run_operator(request):
        # The resumed operator reconciles (its status patch shows up in the emulator's request log)...
        for _ in range(100):
            if any(r.method == "PATCH" and r.resource is not None and r.resource.plural == "kvcachepools"
                   and r.name == "again" for r in list(api.emulator)[seen:]):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the second operator did not resume the pool")
        # ...and leaves credentials, readiness and the finalizer as they were.
        pool = await api.wait_for(POOLS, "default", "again", is_ready)
        assert (await api.get("v1/secrets", "default", "again-kvfetcher"))["data"] == first
        assert pool["metadata"]["finalizers"] == ["kvfetcher.io/finalizer"]


def review(pod: dict[str, Any], namespace: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace, "operation": "CREATE", "dryRun": False,
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": pod, "oldObject": None,
        },
    }


def model_pod(pool: str | None) -> dict[str, Any]:
    """A pod as a ReplicaSet creates it: no metadata.namespace, the namespace only in the request."""
    annotations = {injection.POOL_ANNOTATION: pool} if pool else {}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "vllm-", "labels": {injection.INJECT_LABEL: "true"}, "annotations": annotations},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0",
                                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
    }


async def admit(operator: dict[str, Any], pod: dict[str, Any],
                namespace: str = "default") -> tuple[dict[str, Any], dict[str, Any]]:
    """POST an AdmissionReview to the webhook over HTTPS (verifying its certificate); the response and patched pod."""
    context = ssl.create_default_context(cafile=str(operator["ca"]))
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{operator['webhook']}/inject-sidecar", json=review(pod, namespace),
                                ssl=context) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
    response = answer["response"]
    patched = pod
    if response.get("patch"):
        assert response["patchType"] == "JSONPatch"
        patched = jsonpatch.apply_patch(pod, __import__("json").loads(base64.b64decode(response["patch"])))
    return response, patched


async def admit_until(operator: dict[str, Any], pod: dict[str, Any], check: Any, namespace: str = "default",
                      timeout: float = 10) -> tuple[dict[str, Any], dict[str, Any]]:
    """Admit until `check(patched pod)` holds: the webhook's pool index follows the watch stream."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        response, patched = await admit(operator, pod, namespace)
        if check(patched) or asyncio.get_running_loop().time() > deadline:
            return response, patched
        await asyncio.sleep(0.1)


def skipped(pod: dict[str, Any]) -> str:
    return pod["metadata"].get("annotations", {}).get(injection.SKIPPED_ANNOTATION, "")


async def test_webhook_injects_into_pods_of_a_ready_pool(operator, api: Api, s3: str) -> None:
    # In a namespace other than "default": the pool is found through the request's namespace.
    await api.create("v1/secrets", s3_secret("ml"))
    await api.create(POOLS, external_pool("serve", s3, "serve", namespace="ml", codec={"defaultPreset": "q8"}))
    await api.wait_for(POOLS, "ml", "serve", is_ready)

    response, pod = await admit_until(operator, model_pod("serve"), lambda p: "initContainers" in p["spec"], "ml")
    assert response["allowed"] is True
    sidecar = pod["spec"]["initContainers"][0]
    assert sidecar["name"] == "kvfetcher" and sidecar["restartPolicy"] == "Always"
    assert "nvidia.com/gpu" not in str(sidecar["resources"])
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["KVFETCHER_S3_SECRET_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "s3-creds", "key": "secretKey"}
    assert env["KVFETCHER_PRESET"]["value"] == "q8"
    assert "video" in env["NVIDIA_DRIVER_CAPABILITIES"]["value"]
    assert pod["metadata"]["annotations"][injection.INJECTED_ANNOTATION] == "serve"
    assert "namespace" not in pod["metadata"]  # the namespace shim does not leak into the patch
    pod["metadata"]["name"] = "vllm-abc12"
    kubernetes_validate.validate(pod, "1.30.0", strict=True)

    # The same pod again (a reinvocation): no second sidecar, no patch at all.
    again, same = await admit(operator, pod, "ml")
    assert again["allowed"] is True and "patch" not in again and same == pod

    # Injected pods are counted in the pool's status once the API has them.
    await api.create("v1/pods", {**pod, "metadata": {**pod["metadata"], "namespace": "ml"}})
    await api.wait_for(POOLS, "ml", "serve", lambda o: o["status"].get("injectedPods") == 1)


async def test_webhook_never_blocks_a_pod_for_a_missing_or_unready_pool(operator, api: Api) -> None:
    response, pod = await admit(operator, model_pod("nowhere"))
    assert response["allowed"] is True
    assert pod["metadata"]["annotations"][injection.SKIPPED_ANNOTATION] == \
        "no Ready KVCachePool default/nowhere with injection enabled"
    assert pod["spec"] == model_pod("nowhere")["spec"]

    await api.create(POOLS, managed_pool("starting"))
    await api.wait_for(POOLS, "default", "starting", lambda o: (o or {}).get("status", {}).get("phase"))
    response, pod = await admit(operator, model_pod("starting"))
    assert response["allowed"] is True and "initContainers" not in pod["spec"]
    assert skipped(pod) == "no Ready KVCachePool default/starting with injection enabled"  # as if absent

    response, pod = await admit(operator, model_pod(None))
    assert response["allowed"] is True and "no kvfetcher.io/pool annotation" in \
        pod["metadata"]["annotations"][injection.SKIPPED_ANNOTATION]


async def test_injection_ready_follows_the_webhook_configuration(api: Api, s3: str, request,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFETCHER_WEBHOOK_CONFIGURATION", "kvf")
    hooks = "admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
    await api.create("v1/secrets", s3_secret())
    async with run_operator(request):
        await api.create(POOLS, external_pool("hooked", s3, "hooked"))
        pool = await api.wait_for(POOLS, "default", "hooked",
                                  lambda o: cond(o, "InjectionReady").get("reason") == "WebhookConfigurationMissing")
        assert cond(pool, "StorageReady")["status"] == "True" and cond(pool, "Ready")["status"] == "False"
        config = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                  "metadata": {"name": "kvf"}, "webhooks": [{"name": "inject.kvfetcher.io", "clientConfig": {
                      "service": {"name": "kvf-webhook", "namespace": "kvf", "path": "/inject-sidecar"}}}]}
        async with api.session.post(f"/apis/{hooks}", json=config) as r:
            assert r.status < 300, await r.text()
        await api.wait_for(POOLS, "default", "hooked",
                           lambda o: cond(o, "InjectionReady").get("reason") == "WebhookCANotInjected")
        async with api.session.patch(f"/apis/{hooks}/kvf", headers={"Content-Type": "application/merge-patch+json"},
                                     json={"webhooks": [{**config["webhooks"][0], "clientConfig": {
                                         **config["webhooks"][0]["clientConfig"], "caBundle": "Y2E="}}]}) as r:
            assert r.status < 300, await r.text()
        await api.wait_for(POOLS, "default", "hooked", is_ready)


async def test_metrics_report_pools_by_phase_and_errors(operator, api: Api) -> None:
    await api.create(POOLS, managed_pool("m1", codec={"chunkTokens": 7}))
    await api.wait_for(POOLS, "default", "m1", lambda o: (o or {}).get("status", {}).get("phase") == "Failed")
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{operator['metrics']}/metrics") as r:
            text = await r.text()
    assert 'kvfetcher_operator_pools{phase="Failed"} 1.0' in text
    assert 'kvfetcher_operator_reconcile_errors_total{reason="InvalidSpec"}' in text


async def post_raw(operator: dict[str, Any], body: bytes) -> int:
    context = ssl.create_default_context(cafile=str(operator["ca"]))
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{operator['webhook']}/inject-sidecar", data=body, ssl=context,
                                headers={"Content-Type": "application/json"}) as r:
            return r.status


async def test_webhook_answers_malformed_reviews_400_and_takes_big_pods(operator, api: Api, s3: str) -> None:
    """Malformed reviews are the caller's error (400), not ours (500); a pod
    over aiohttp's 1 MiB default is still injected, up to the API server's own ~3 MiB limit."""
    import json
    good = review(model_pod("big"))
    for bad in ([], {}, {"request": None}, {"request": {**good["request"], "resource": None}},
                {"request": {**good["request"], "object": []}},
                {"request": {**good["request"], "object": {"metadata": "x"}}}):
        assert await post_raw(operator, json.dumps(bad).encode()) == 400, bad
    assert await post_raw(operator, b"{not json") == 400

    await api.create("v1/secrets", s3_secret())
    await api.create(POOLS, external_pool("big", s3, "big"))
    await api.wait_for(POOLS, "default", "big", is_ready)
    pod = model_pod("big")
    pod["metadata"]["annotations"]["filler"] = "x" * (2 * 2**20)
    response, patched = await admit_until(operator, pod, lambda p: "initContainers" in p["spec"])
    assert patched["spec"]["initContainers"][0]["name"] == "kvfetcher"
    assert await post_raw(operator, b" " * (4 * 2**20)) == 413
