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
