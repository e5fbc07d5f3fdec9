"""A pool that names its model: the sidecars serve it, and the operator runs `kvfetcher calibrate
--publish` as a Job when the pool's store has no calibration of it; the Calibrated condition
follows the store and the Job, and says why when it is False."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import torch
from op_helpers import POOLS, Api, cond, external_pool, is_ready, s3_secret
from pod_security import restricted_violations
from test_op_builders import EXTERNAL, MANAGED, gpu_pod, pool

from kvfetcher import config as settings
from kvfetcher.codec import basis
from kvfetcher.format import calibration as cal
from kvfetcher.store import from_url
from kvfetcher_operator import builders, calibration, injection, minio, users

PVC_SOURCE = {"persistentVolumeClaim": {"claimName": "models", "path": "llama-3/8b.gguf"}}
MODEL = {"name": "meta-llama/llama-3-8b", "calibration": {"source": PVC_SOURCE}}


def container(obj: dict[str, Any]) -> dict[str, Any]:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def env_of(obj: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(obj)["env"]}


def test_the_job_calibrates_the_model_from_its_claim_into_the_pools_store() -> None:
    p = pool({**MANAGED, "model": MODEL})
    job = calibration.job(p)
    kubernetes_validate.validate(job, "1.30.0", strict=True)
    assert container(job)["args"] == ["calibrate", "--model", "/model/llama-3/8b.gguf", "--tag", "meta-llama--llama-3-8b",
                                      "--publish", "http://cache-minio.ml.svc:9000/kvcache"]
    assert container(job)["image"] == "ghcr.io/kvfetcher/kvfetcher-sidecar:0.1.0"
    template = job["spec"]["template"]
    assert template["spec"]["volumes"][0] == {"name": "model", "persistentVolumeClaim": {"claimName": "models",
                                                                                         "readOnly": True}}
    assert {"name": "model", "mountPath": "/model", "readOnly": True} in container(job)["volumeMounts"]
    # Never injected, restricted, no API token, gone with the pool; its exit code ends up in the condition.
    assert injection.INJECT_LABEL not in template["metadata"]["labels"]
    assert restricted_violations(template["spec"]) == [] and template["spec"]["automountServiceAccountToken"] is False
    assert template["spec"]["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == 1
    assert "terminationMessagePolicy" not in container(job)  # its log is never copied into the status
    assert job["metadata"]["ownerReferences"] == [builders.owner_reference(p)]
    # The model's copy and the artefact go to its scratch volume, not the image's home.
    env = env_of(job)
    assert env[settings.CACHE.name] == "/work/cache" and env[settings.CALIBRATION_DIR.name] == "/work/calibration"


def test_the_job_reaches_the_store_as_the_calibrator_only() -> None:
    """Managed MinIO: its own user, who may write calibrations and nothing else (the sidecars only read
    them); never MinIO's root. External: the pool's credentials, region and CA, as the evictor's."""
    env = env_of(calibration.job(pool({**MANAGED, "model": MODEL})))
    assert env[settings.S3_ACCESS_KEY.name]["secretKeyRef"] == {"name": "cache-kvfetcher", "key": "calibratorAccessKey"}
    assert env[settings.S3_SECRET_KEY.name]["secretKeyRef"] == {"name": "cache-kvfetcher", "key": "calibratorSecretKey"}
    granted = {(a, r) for s in users.calibrator_policy("kvcache")["Statement"] for a in s["Action"] for r in s["Resource"]}
    assert granted == {("s3:GetBucketLocation", "arn:aws:s3:::kvcache"), ("s3:ListBucket", "arn:aws:s3:::kvcache"),
                       ("s3:GetObject", "arn:aws:s3:::kvcache/_meta/calibration/*"),
                       ("s3:PutObject", "arn:aws:s3:::kvcache/_meta/calibration/*")}
    labels = builders.labels("cache", builders.CALIBRATION)
    (policy,) = [g for g in minio.guards(pool(MANAGED)) if g["kind"] == "NetworkPolicy"]
    assert {"podSelector": {"matchLabels": labels}} in policy["spec"]["ingress"][0]["from"]

    external = calibration.job(pool({**EXTERNAL, "model": MODEL}))
    env = env_of(external)
    assert env[settings.S3_ACCESS_KEY.name]["secretKeyRef"] == {"name": "creds", "key": "id"}
    assert env[settings.S3_CA_FILE.name] == f"{injection.CA_DIR}/ca.crt"
    assert container(external)["args"][-1] == "https://s3.example.com/kv"
    assert injection.ca_volume(pool(EXTERNAL)) in external["spec"]["template"]["spec"]["volumes"]
    kubernetes_validate.validate(external, "1.30.0", strict=True)


def test_a_model_image_is_mounted_as_an_image_volume_and_the_job_image_and_resources_are_the_pools() -> None:
    spec = {**MANAGED, "model": {"name": "gemma-3-270m", "calibration": {
        "source": {"image": {"reference": "registry.example.com/models/gemma:1", "path": "gemma.gguf"}},
        "job": {"image": "kvfetcher-hf:0.1.0", "resources": {"limits": {"memory": "4Gi"}}}}}}
    job = calibration.job(pool(spec))
    kubernetes_validate.validate(job, "1.35.0", strict=True)  # image volumes: Kubernetes 1.33+
    assert job["spec"]["template"]["spec"]["volumes"][0] == {
        "name": "model", "image": {"reference": "registry.example.com/models/gemma:1"}}
    assert container(job)["args"][2:5] == ["/model/gemma.gguf", "--tag", "gemma-3-270m"]
    assert container(job)["image"] == "kvfetcher-hf:0.1.0" and container(job)["resources"] == {"limits": {"memory": "4Gi"}}


def test_one_job_per_calibration_whatever_the_passes() -> None:
    """The name carries a digest of what the Job runs: the same spec finds its Job, another makes a new one."""
    p = pool({**MANAGED, "model": MODEL})
    name = calibration.job(p)["metadata"]["name"]
    assert name == calibration.job(copy.deepcopy(p))["metadata"]["name"] and name.startswith("cache-calibrate-")
    moved = pool({**MANAGED, "model": {**MODEL, "calibration": {"source": {
        "persistentVolumeClaim": {"claimName": "models", "path": "llama-3/8b-instruct"}}}}})
    assert calibration.job(moved)["metadata"]["name"] != name
    assert len(calibration.job(pool({**MANAGED, "model": MODEL}, name="c" * 40))["metadata"]["name"]) <= 63


def test_the_condition_follows_the_store_and_the_job() -> None:
    p = pool({**MANAGED, "model": MODEL})
    job = calibration.job(p)
    name = job["metadata"]["name"]
    assert calibration.readiness(p, ["llama-3-8b-0123456789ab.json"], None, [])[:2] == (True, "Calibrated")
    ok, reason, message = calibration.readiness(p, [], job, [{"metadata": {"name": f"{name}-x"}, "status": {
        "containerStatuses": [{"state": {"waiting": {"reason": "ImagePullBackOff"}}}]}}])
    assert (ok, reason) == (False, "Calibrating") and "ImagePullBackOff" in message
    failed = {**job, "status": {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                                "message": "Job has reached the specified backoff limit"}]}}
    pod = {"metadata": {"name": f"{name}-y"}, "status": {"containerStatuses": [{"state": {"terminated": {
        "exitCode": 1, "message": "FileNotFoundError: no model at /model/llama-3/8b.gguf\n"}}}]}}
    ok, reason, message = calibration.readiness(p, [], failed, [pod])
    assert (ok, reason) == (False, "JobFailed")
    assert "BackoffLimitExceeded" in message and "exited with code 1" in message and "delete the Job" in message
    assert "no model at" not in message
    complete = {**job, "status": {"conditions": [{"type": "Complete", "status": "True"}]}}
    assert calibration.readiness(p, [], complete, [])[:2] == (False, "NotPublished")
    sourceless = pool({**MANAGED, "model": {"name": "llama-3-8b/bfloat16"}})
    ok, reason, message = calibration.readiness(sourceless, [], None, [])
    assert (ok, reason) == (False, "NoSource") and "refused" in message


def test_the_sidecar_serves_the_pools_model_and_a_pod_of_another_is_not_injected() -> None:
    p = pool({**MANAGED, "model": {"name": "llama-3-8b/bfloat16"}})
    pod = gpu_pod(resources={"claims": [{"name": "gpu"}]})
    out = injection.apply_merge_patch(pod, injection.mutate(pod, p).patch)
    env = {e["name"]: e for e in out["spec"]["initContainers"][0]["env"]}
    assert env[settings.MODEL.name] == {"name": settings.MODEL.name, "value": "llama-3-8b/bfloat16"}
    pod["metadata"]["annotations"][injection.MODEL_ANNOTATION] = "llama-3-8b/bfloat16"  # the same: injected
    assert injection.mutate(pod, p).outcome == "injected"
    pod["metadata"]["annotations"][injection.MODEL_ANNOTATION] = "mistral-7b/bfloat16"
    decision = injection.mutate(pod, p)
    assert decision.outcome == "skipped" and "mistral" not in decision.reason and "llama-3-8b/bfloat16" in decision.reason
    unnamed = injection.sidecar_container(pool(MANAGED), None)  # no spec.model: the pod's annotation
    (model_env,) = [e for e in unnamed["env"] if e["name"] == settings.MODEL.name]
    assert model_env["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{injection.MODEL_ANNOTATION}']"


def publish_calibration(endpoint: str, bucket_name: str, tag: str, tmp: Path) -> list[str]:
    """A calibration of model `tag` put into the bucket as `kvfetcher calibrate --publish` puts it."""
    g = torch.Generator().manual_seed(0)
    b = basis.build(tag, torch.linalg.qr(torch.randn(1, 2, 1, 16, 16, generator=g))[0], torch.zeros(1, 2, 1, 16))
    doc = cal.artefact(tag, {"basis": {"layers": [[1e-4, 1e-4]]}}, b.name, (1, 1, 16), None, None)
    store = from_url(f"{endpoint}/{bucket_name}", env={"KVFETCHER_S3_ACCESS_KEY": "testing",
                                                       "KVFETCHER_S3_SECRET_KEY": "testing"})
    return cal.publish(store, cal.write(doc, tmp), basis.save(b, tmp))


def calibrated(obj: dict[str, Any] | None, reason: str) -> bool:
    return cond(obj, "Calibrated").get("reason") == reason


async def test_the_operator_runs_the_job_until_the_store_has_the_calibration(operator, api: Api, s3: str,
                                                                             tmp_path: Path) -> None:
    await api.create("v1/secrets", s3_secret())
    await api.create(POOLS, external_pool("cal", s3, "cal-bucket", model=MODEL))
    pool_obj = await api.wait_for(POOLS, "default", "cal", lambda o: calibrated(o, "SourceMissing"))
    assert "PersistentVolumeClaim default/models" in cond(pool_obj, "Calibrated")["message"]
    assert is_ready(pool_obj)  # informational: the pool serves meanwhile, calibrated presets refused

    await api.create("v1/persistentvolumeclaims", {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                                   "metadata": {"name": "models", "namespace": "default"}})
    pool_obj = await api.wait_for(POOLS, "default", "cal", lambda o: calibrated(o, "Calibrating"))
    name = calibration.job(pool_obj)["metadata"]["name"]
    job = await api.get("batch/v1/jobs", "default", name)
    assert container(job)["args"] == ["calibrate", "--model", "/model/llama-3/8b.gguf", "--tag", "meta-llama--llama-3-8b",
                                      "--publish", f"{s3}/cal-bucket"]
    assert job["metadata"]["ownerReferences"][0]["uid"] == "uid-cal"

    # The emulator runs no Job controller: report the pod's failure and the Job's as Kubernetes would.
    await api.create("v1/pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": f"{name}-abcde", "namespace": "default", "labels": {"batch.kubernetes.io/job-name": name}},
        "spec": {"containers": [{"name": "calibration", "image": "x"}]}})
    await api.patch("v1/pods", "default", f"{name}-abcde", {"status": {"containerStatuses": [{
        "name": "calibration", "state": {"terminated": {"exitCode": 1, "message": "ModuleNotFoundError: transformers"}}}]}})
    await api.patch("batch/v1/jobs", "default", name, {"status": {"conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "message": "backoff limit"}]}})
    pool_obj = await api.wait_for(POOLS, "default", "cal", lambda o: calibrated(o, "JobFailed"))
    assert "exited with code 1" in cond(pool_obj, "Calibrated")["message"]  # never its output

    published = publish_calibration(s3, "cal-bucket", "meta-llama--llama-3-8b", tmp_path)  # e.g. by hand, or a rerun
    pool_obj = await api.wait_for(POOLS, "default", "cal", lambda o: calibrated(o, "Calibrated"))
    assert cond(pool_obj, "Calibrated")["status"] == "True"
    assert Path(published[0]).name in cond(pool_obj, "Calibrated")["message"]
    async with api.session.get("/apis/batch/v1/namespaces/default/jobs") as listing:  # one Job, however many passes
        assert [i["metadata"]["name"] for i in (await listing.json())["items"]] == [name]


async def test_no_job_once_the_store_has_the_calibration(operator, api: Api, s3: str, tmp_path: Path) -> None:
    from kvfetcher_operator import bucket

    bucket.ensure(bucket.Target(s3, "have-cal", "testing", "testing"), "default/have")
    publish_calibration(s3, "have-cal", "meta-llama--llama-3-8b", tmp_path)
    await api.create("v1/secrets", s3_secret())
    await api.create(POOLS, external_pool("have", s3, "have-cal", model=MODEL))
    pool_obj = await api.wait_for(POOLS, "default", "have", lambda o: calibrated(o, "Calibrated"))
    assert cond(pool_obj, "Calibrated")["status"] == "True"
    async with api.session.get("/apis/batch/v1/namespaces/default/jobs") as listing:
        assert (await listing.json())["items"] == []


async def test_without_a_source_the_condition_says_calibrated_presets_are_refused(operator, api: Api, s3: str) -> None:
    """And a pool that names no model has no Calibrated condition (one left from a model is removed)."""
    await api.create("v1/secrets", s3_secret())
    await api.create(POOLS, external_pool("nojob", s3, "nojob-bucket", model={"name": "llama-3-8b/bfloat16"}))
    pool_obj = await api.wait_for(POOLS, "default", "nojob", lambda o: calibrated(o, "NoSource"))
    assert "names no source" in cond(pool_obj, "Calibrated")["message"] and is_ready(pool_obj)
    await api.patch(POOLS, "default", "nojob", {"spec": {"model": None}, "metadata": {"generation": 2}})
    await api.wait_for(POOLS, "default", "nojob", lambda o: is_ready(o) and not cond(o, "Calibrated"))


async def test_a_bad_model_makes_the_spec_invalid(operator, api: Api, s3: str) -> None:
    bad = {"name": "llama-3-8b", "calibration": {"source": {"persistentVolumeClaim": {"claimName": "m",
                                                                                      "path": "../../etc"}}}}
    await api.create("v1/secrets", s3_secret())
    await api.create(POOLS, external_pool("badmodel", s3, "badmodel-bucket", model=bad))
    pool_obj = await api.wait_for(POOLS, "default", "badmodel", lambda o: cond(o, "ConfigValid").get("status") == "False")
    assert "model.calibration.source.persistentVolumeClaim.path" in cond(pool_obj, "ConfigValid")["message"]
    async with api.session.get("/apis/batch/v1/namespaces/default/jobs") as listing:
        assert (await listing.json())["items"] == []


def test_the_operators_tag_is_the_one_the_sidecar_matches() -> None:
    from kvfetcher.codec import basis

    for name in ("meta-llama/Meta-Llama-3-8B-Instruct", "gemma-3-270m", "org/family/variant"):
        assert calibration.tag(name) == basis.tag_of(name) and basis.is_for(calibration.tag(name), name)
    # one organisation's models do not share a calibration
    assert not basis.is_for(calibration.tag("meta-llama/Meta-Llama-3-8B"), "meta-llama/Meta-Llama-3-70B")
