"""The control plane's third-round findings: the webhook injects only a spec the reconciler has
validated, resource semantics and pods it cannot serve, calibration Jobs' bounds and what they may
leak, and the chart's defaults."""
from __future__ import annotations

from kvfetcher_operator import conditions, injection


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
    from kvfetcher_operator import admission

    entry = admission.pools.__wrapped__ if hasattr(admission.pools, "__wrapped__") else admission.pools
    out = entry(namespace="ml", name="cache", meta={"generation": 7}, spec={}, status={})
    assert out[("ml", "cache")]["metadata"]["generation"] == 7


# --- finding 11 ------------------------------------------------------------------------------


def test_resources_a_pod_would_be_refused_for_make_the_spec_invalid():
    from kvfetcher_operator import spec as specs

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
    from kvfetcher_operator import calibration

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
