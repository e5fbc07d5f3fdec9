"""The chart: the webhook is its own highly available Deployment, with a
read-only ServiceAccount; the reconciler stays one replica without a webhook port."""
from __future__ import annotations

from typing import Any

import helm_python
import pytest
from pod_security import restricted_violations
from test_op_chart import CHART, VALUE_SETS, by_kind, named, render

READ_ONLY = {"get", "list", "watch"}


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render(helm_python.Chart.load(str(CHART)), {})


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def test_webhook_deployment_is_highly_available(docs: list[dict[str, Any]]) -> None:
    hook = named(docs, "Deployment", "kvf-kvfetcher-webhook")
    labels = hook["spec"]["selector"]["matchLabels"]
    assert hook["spec"]["replicas"] == 2
    assert hook["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    (container,) = pod_spec(hook)["containers"]
    assert "--role=webhook" in container["args"] and "--readiness=http://0.0.0.0:8082/readyz" in container["args"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "ready"}
    (term,) = pod_spec(hook)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"] == {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": labels}}
    assert restricted_violations(pod_spec(hook)) == []

    pdb = named(docs, "PodDisruptionBudget", "kvf-kvfetcher-webhook")
    assert pdb["spec"] == {"minAvailable": 1, "selector": {"matchLabels": labels}}
    service = named(docs, "Service", "kvf-kvfetcher-webhook")
    assert service["spec"]["selector"] == labels == hook["spec"]["template"]["metadata"]["labels"]


def test_reconciler_is_one_replica_without_the_webhook(docs: list[dict[str, Any]]) -> None:
    reconciler = named(docs, "Deployment", "kvf-kvfetcher")
    hook = named(docs, "Deployment", "kvf-kvfetcher-webhook")
    assert reconciler["spec"]["replicas"] == 1 and reconciler["spec"]["strategy"] == {"type": "Recreate"}
    (container,) = pod_spec(reconciler)["containers"]
    assert "--role=reconciler" in container["args"]
    assert "webhook" not in {p["name"] for p in container["ports"]}
    # The two selectors pick disjoint pods; the webhook Service reaches only the webhook's.
    reconciler_labels = reconciler["spec"]["template"]["metadata"]["labels"]
    service = named(docs, "Service", "kvf-kvfetcher-webhook")
    assert not set(service["spec"]["selector"].items()) <= set(reconciler_labels.items())
    assert not set(hook["spec"]["selector"]["matchLabels"].items()) <= set(reconciler_labels.items())
    policy = named(docs, "NetworkPolicy", "kvf-kvfetcher")
    assert "webhook" not in str(policy["spec"]["ingress"])


def rules(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    return {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}


@pytest.mark.parametrize("values", ["defaults", "namespaced"])
def test_webhook_account_is_read_only_on_pools(values: str) -> None:
    docs = render(helm_python.Chart.load(str(CHART)), VALUE_SETS[values])
    sa = pod_spec(named(docs, "Deployment", "kvf-kvfetcher-webhook"))["serviceAccountName"]
    assert sa == "kvf-kvfetcher-webhook" and named(docs, "ServiceAccount", sa)
    bound = [b for b in by_kind(docs, "ClusterRoleBinding") + by_kind(docs, "RoleBinding")
             if any(s["name"] == sa for s in b["subjects"])]
    granted: dict[tuple[str, str], set[str]] = {}
    for binding in bound:
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace")
        role = named([d for d in docs if d["metadata"].get("namespace") == namespace], ref["kind"], ref["name"])
        for key, verbs in rules(role).items():
            granted.setdefault(key, set()).update(verbs)
    assert set().union(*granted.values()) <= READ_ONLY
    assert set(granted) == {("kvfetcher.io", "kvcachepools"), ("apiextensions.k8s.io", "customresourcedefinitions")}
    if values == "namespaced":  # pools are readable only in the watched namespaces
        cluster = named(docs, "ClusterRole", "kvf-kvfetcher-webhook")
        assert ("kvfetcher.io", "kvcachepools") not in rules(cluster)
        assert sorted(b["metadata"]["namespace"] for b in bound if b["kind"] == "RoleBinding") == ["ml", "team-b"]
