"""The control plane's third-round findings: the webhook injects only a spec the reconciler has
validated, resource semantics and pods it cannot serve, calibration Jobs' bounds and what they may
leak, and the chart's defaults."""
from __future__ import annotations

from pathlib import Path

import helm_python
import pytest
import yaml

from kvfetcher_operator import calibration, conditions, injection, minio
from kvfetcher_operator import spec as specs

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvfetcher"


def pod(**spec) -> dict:
    return {"metadata": {"name": "m", "namespace": "ml", "annotations": {injection.POOL_ANNOTATION: "cache"},
                         "labels": {injection.INJECT_LABEL: "true"}},
            "spec": {"containers": [{"name": "model", "image": "vllm"}], **spec}}


def ready_pool(observed: int = 1, generation: int = 1, **spec) -> dict:
    conds = conditions.put([], conditions.READY, True, "Ready", "", generation=observed)
    return {"metadata": {"name": "cache", "namespace": "ml", "generation": generation},
            "spec": {"storage": {"managed": {}}, **spec}, "status": {"conditions": conds, "phase": "Ready"}}


# --- finding 10 ------------------------------------------------------------------------------


def test_the_webhook_skips_a_pool_whose_ready_is_for_an_older_generation():
    """A new spec is injected only once the reconciler has validated it (Ready observed at its generation)."""
    decision = injection.mutate(pod(), ready_pool(observed=1, generation=2))
    assert decision.outcome == "skipped" and "older spec" in decision.reason
    assert injection.mutate(pod(), ready_pool(observed=2, generation=2)).outcome == "injected"


def test_the_pool_index_keeps_the_generation():
    from kvfetcher_operator import admission  # (registers the webhook role's kopf handlers)

    out = admission.pools(namespace="ml", name="cache", meta={"generation": 7}, spec={}, status={})
    assert out[("ml", "cache")]["metadata"]["generation"] == 7


# --- finding 11 ------------------------------------------------------------------------------


def test_resources_a_pod_would_be_refused_for_make_the_spec_invalid():
    base = {"storage": {"managed": {}}}
    for resources, word in [({"requests": {"memory": "8Gi"}, "limits": {"memory": "4Gi"}}, "above its limit"),
                            ({"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}, "above its limit"),
                            ({"limits": {"gpu": "1"}}, "not a resource"),
                            ({"limits": {"kubernetes.io/thing": "1"}}, "not a resource"),
                            ({"limits": "4Gi"}, "must map")]:
        problems = specs.problems(base | {"sidecar": {"resources": resources}})
        assert any(word in p for p in problems), (resources, problems)
    fine = {"requests": {"cpu": "500m", "memory": "2Gi", "hugepages-2Mi": "1Gi"}, "limits": {"memory": "2Gi", "nvidia.com/gpu": 1}}
    assert specs.problems(base | {"sidecar": {"resources": fine}}) == []


def test_host_network_and_windows_pods_are_not_injected():
    for extra in ({"hostNetwork": True}, {"os": {"name": "windows"}}):
        decision = injection.mutate(pod(**extra), ready_pool())
        assert decision.outcome == "skipped" and "hostNetwork" in decision.reason
    assert injection.mutate(pod(os={"name": "linux"}), ready_pool()).outcome == "injected"


# --- finding 12: calibration Jobs ------------------------------------------------------------


def test_a_calibration_job_is_bounded_in_time_and_never_copies_its_log_into_the_status():
    p = ready_pool(model={"name": "org/m", "calibration": {"source": {"persistentVolumeClaim": {"claimName": "w", "path": "m"}}}})
    p["metadata"]["uid"] = "u"
    job = calibration.job(p)
    assert job["spec"]["activeDeadlineSeconds"] > 0 and job["spec"]["ttlSecondsAfterFinished"] > 0
    assert "terminationMessagePolicy" not in job["spec"]["template"]["spec"]["containers"][0]
    failed = {**job, "status": {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}}
    leaked = {"metadata": {"name": "x"}, "status": {"containerStatuses": [{"state": {"terminated": {
        "exitCode": 1, "message": "botocore: AWS_SECRET_ACCESS_KEY=hunter2 refused"}}}]}}
    ok, reason, message = calibration.readiness(p, [], failed, [leaked])
    assert reason == "JobFailed" and "hunter2" not in message and "exited with code 1" in message


# --- finding 12: managed MinIO and the chart -------------------------------------------------


def test_managed_minio_gets_default_requests():
    pool = ready_pool()
    pool["metadata"]["uid"] = "u"
    (container,) = minio.statefulset(pool)["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"] == {"cpu": "250m", "memory": "1Gi"}


def _render(values):
    out = helm_python.Chart.load(str(CHART)).render(values, name="kvf", namespace="kvfetcher-system", is_install=True)
    return [d for p, t in out.items() if not p.endswith("NOTES.txt") for d in yaml.safe_load_all(t) if d]


def test_watch_namespaces_narrow_the_webhooks_namespace_selector():
    (config,) = [d for d in _render({"watchNamespaces": ["ml", "team-b"]}) if d["kind"] == "MutatingWebhookConfiguration"]
    assert {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["ml", "team-b"]} in \
        config["webhooks"][0]["namespaceSelector"]["matchExpressions"]
    (config,) = [d for d in _render({}) if d["kind"] == "MutatingWebhookConfiguration"]
    assert all(e["operator"] != "In" for e in config["webhooks"][0]["namespaceSelector"]["matchExpressions"])


def test_without_created_accounts_both_roles_need_their_own():
    for values in ({"serviceAccount": {"create": False}}, {"serviceAccount": {"create": False, "name": "op"}}):
        with pytest.raises(Exception, match="serviceAccount"):
            _render(values)
    docs = _render({"serviceAccount": {"create": False, "name": "op", "webhookName": "hook"}})
    accounts = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["serviceAccountName"] for d in docs if d["kind"] == "Deployment"}
    assert set(accounts.values()) == {"op", "hook"}
