"""The Helm chart, rendered by a real Helm engine (helm-python-sdk, Helm v4 in a shared library):
several value sets render, lint clean in strict mode and give only manifests that pass strict
Kubernetes 1.30 schema validation; values.schema.json refuses bad values."""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from pod_security import restricted_violations, workload_pod_spec

from kvfetcher_operator import builders, calibration, evictor, injection, kube, minio, webhook

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvfetcher"
NAMESPACE = "kvfetcher-system"

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "cert-manager-own-issuer": {
        "webhook": {"port": 10443, "certificates": {"mode": "certManager",
                                                    "certManager": {"issuerRef": {"name": "ca", "kind": "ClusterIssuer"}}},
                    "namespaceSelector": {"matchLabels": {"gpu": "true"}}},
        "metrics": {"port": 9090, "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                    "prometheusRule": {"enabled": True, "labels": {"release": "prom"}}},
        "grafanaDashboard": {"enabled": False},
        "operator": {"verbose": True, "retrySeconds": 5},
        "poolNamespaces": ["ml", "team-b"],
    },
    "namespaced": {"watchNamespaces": ["ml", "team-b"], "image": {"digest": "sha256:" + "a" * 64},
                   "networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]},
                   "operator": {"endpoints": {"deny": ["10.96.0.0/12"], "hosts": ["s3.example.com"]}}},
    "cert-manager-self-signed": {
        "webhook": {"certificates": {"mode": "certManager"}},
        "serviceAccount": {"create": False, "name": "kvf-operator", "webhookName": "kvf-webhook"},
        "image": {"repository": "registry.local/kvf-operator", "tag": "dev", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
}
# Kinds from other projects' CRDs (cert-manager, Prometheus Operator): no bundled schema to check against.
FOREIGN = {"Certificate", "Issuer", "ServiceMonitor", "PodMonitor", "PrometheusRule"}


@pytest.fixture(scope="module")
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(str(CHART))


def render(chart: helm_python.Chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    out = chart.render(values, name="kvf", namespace=NAMESPACE, is_install=True)
    return [doc for path, text in out.items() if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def test_install_notes_tell_how_to_wait_for_a_pool(chart: helm_python.Chart) -> None:
    out = chart.render({}, name="kvf", namespace=NAMESPACE, is_install=True)
    (notes,) = [text for path, text in out.items() if path.endswith("NOTES.txt")]
    assert "kubectl wait --for=condition=Ready kvcachepool/" in notes


@pytest.mark.parametrize("name", VALUE_SETS)
def test_renders_lint_clean_and_valid_for_kubernetes_1_30(chart: helm_python.Chart, name: str) -> None:
    values = VALUE_SETS[name]
    report = helm_python.lint(str(CHART), values, strict=True, kube_version="v1.30.0", namespace=NAMESPACE)
    assert report["errors"] == [] and all(m["severity"] < 2 for m in report["messages"]), report
    docs = render(chart, values)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "ClusterRole", "ClusterRoleBinding", "Service", "MutatingWebhookConfiguration"} <= kinds
    for doc in docs:
        pod_spec = workload_pod_spec(doc)
        if pod_spec is not None:  # every workload passes Pod Security "restricted"
            assert restricted_violations(pod_spec) == [], doc["metadata"]["name"]
        if doc["kind"] in FOREIGN:
            assert doc["apiVersion"] in ("cert-manager.io/v1", "monitoring.coreos.com/v1") and doc["spec"]
        else:
            kubernetes_validate.validate(doc, "1.30.0", strict=True)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in by_kind(docs, kind) if d["metadata"]["name"] == name]
    return found


def test_webhook_points_at_the_operator_handler_and_never_blocks(chart: helm_python.Chart) -> None:
    docs = render(chart, {})
    (config,) = by_kind(docs, "MutatingWebhookConfiguration")
    (hook,) = config["webhooks"]
    assert hook["failurePolicy"] == "Ignore" and hook["sideEffects"] == "None"
    assert hook["clientConfig"]["service"]["path"] == f"/{webhook.WEBHOOK_ID}"
    assert hook["objectSelector"] == {"matchLabels": {injection.INJECT_LABEL: "true"}}
    assert hook["rules"][0]["operations"] == ["CREATE"] and hook["rules"][0]["resources"] == ["pods"]
    assert {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": [NAMESPACE]} in \
        hook["namespaceSelector"]["matchExpressions"]

    # Self-signed mode: the serving certificate is for the webhook Service and chains to the caBundle.
    (secret,) = [s for s in by_kind(docs, "Secret") if s["type"] == "kubernetes.io/tls"]
    ca_pem = base64.b64decode(hook["clientConfig"]["caBundle"])
    assert ca_pem == base64.b64decode(secret["data"]["ca.crt"])
    ca = x509.load_pem_x509_certificate(ca_pem)
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    cert.verify_directly_issued_by(ca)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert f"kvf-kvfetcher-webhook.{NAMESPACE}.svc" in sans
    (service,) = [s for s in by_kind(docs, "Service") if s["metadata"]["name"] == "kvf-kvfetcher-webhook"]
    assert service["spec"]["ports"][0]["port"] == 443


def test_cert_manager_mode_injects_the_ca_instead(chart: helm_python.Chart) -> None:
    docs = render(chart, VALUE_SETS["cert-manager-self-signed"])
    (config,) = by_kind(docs, "MutatingWebhookConfiguration")
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{NAMESPACE}/kvf-kvfetcher-webhook"
    assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    (cert,) = by_kind(docs, "Certificate")
    assert cert["spec"]["secretName"] == "kvf-kvfetcher-webhook-tls"
    assert cert["spec"]["issuerRef"]["name"] == by_kind(docs, "Issuer")[0]["metadata"]["name"]
    assert not [s for s in by_kind(docs, "Secret")]  # cert-manager writes it
    own = render(chart, VALUE_SETS["cert-manager-own-issuer"])
    assert not by_kind(own, "Issuer") and by_kind(own, "Certificate")[0]["spec"]["issuerRef"]["kind"] == "ClusterIssuer"


def rules_of(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    return {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}


def test_rbac_is_least_privilege(chart: helm_python.Chart) -> None:
    """Cluster-wide, the operator reads and writes Secrets (and MinIO's objects) only in
    namespaces bound to its pool-namespace ClusterRole; what is bound cluster-wide reads no Secret."""
    docs = render(chart, {"poolNamespaces": ["ml"]})
    roles = {r["metadata"]["name"]: r for r in by_kind(docs, "ClusterRole")}
    assert not any("*" in str(rule) for role in roles.values() for rule in role["rules"])
    binding = named(docs, "ClusterRoleBinding", "kvf-kvfetcher")
    cluster_wide = rules_of(roles[binding["roleRef"]["name"]])
    assert not {r for _, r in cluster_wide} & {"secrets", "services", "statefulsets", "deployments",
                                               "poddisruptionbudgets", "networkpolicies", "configmaps"}
    assert cluster_wide[("", "pods")] == {"list", "watch"}
    (hooks,) = [r for r in roles["kvf-kvfetcher"]["rules"] if r["resources"] == ["mutatingwebhookconfigurations"]]
    assert hooks["verbs"] == ["get"] and hooks["resourceNames"] == ["kvf-kvfetcher"]

    per_namespace = rules_of(roles["kvf-kvfetcher-pool-namespace"])
    assert per_namespace[("", "secrets")] == {"get", "create", "patch"}  # never list or watch every Secret
    assert per_namespace[("policy", "poddisruptionbudgets")] == per_namespace[("networking.k8s.io", "networkpolicies")] \
        == {"get", "create", "patch"}
    assert "delete" not in set().union(*per_namespace.values(), *cluster_wide.values())  # owner references do it
    (bound,) = by_kind(docs, "RoleBinding")
    assert bound["metadata"]["namespace"] == "ml" and bound["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "kvf-kvfetcher-pool-namespace"}
    assert bound["subjects"] == [{"kind": "ServiceAccount", "name": "kvf-kvfetcher", "namespace": NAMESPACE}]
    assert not by_kind(render(chart, {}), "RoleBinding")  # nothing bound until a namespace is named


def test_the_pool_namespace_role_lets_the_operator_apply_every_child(chart: helm_python.Chart) -> None:
    """Every object the operator applies in a pool's namespace (a managed pool has them all) is
    granted there: get, create and patch, and no more."""
    model = {"name": "m", "calibration": {"source": {"persistentVolumeClaim": {"claimName": "c", "path": "m.gguf"}}}}
    pool = {"metadata": {"name": "p", "namespace": "ml", "uid": "u"}, "spec": {"storage": {"managed": {}}, "model": model}}
    children = [builders.secret(pool, {}), minio.statefulset(pool), evictor.deployment(pool), calibration.job(pool),
                *minio.services(pool), *minio.guards(pool)]
    docs = render(chart, {"poolNamespaces": ["ml"]})
    per_namespace = rules_of(named(docs, "ClusterRole", "kvf-kvfetcher-pool-namespace"))
    for child in children:
        group = child["apiVersion"].rpartition("/")[0]
        assert per_namespace.get((group, kube.PLURALS[child["kind"]])) == {"get", "create", "patch"}, child["kind"]
    assert per_namespace[("", "persistentvolumeclaims")] == {"get"}  # the calibration's source is checked, never changed


def test_namespaced_mode_grants_nothing_cluster_wide_on_namespaced_objects(chart: helm_python.Chart) -> None:
    """With watchNamespaces, Secrets, Services and StatefulSets are writable only there."""
    docs = render(chart, VALUE_SETS["namespaced"])
    cluster_role = named(docs, "ClusterRole", "kvf-kvfetcher")
    assert {r for rule in cluster_role["rules"] for r in rule["resources"]} == {
        "mutatingwebhookconfigurations", "customresourcedefinitions"}
    roles = [r for r in by_kind(docs, "Role") if r["metadata"]["name"] == "kvf-kvfetcher"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml", "team-b"]
    assert rules_of(roles[0])[("", "secrets")] == {"get", "create", "patch"}
    assert rules_of(roles[0])[("kvfetcher.io", "kvcachepools")] >= {"list", "watch"}
    bindings = [b for b in by_kind(docs, "RoleBinding") if b["metadata"]["name"] == "kvf-kvfetcher"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["ml", "team-b"]
    assert {b["roleRef"]["kind"] for b in bindings} == {"Role"}
    container = named(docs, "Deployment", "kvf-kvfetcher")["spec"]["template"]["spec"]["containers"][0]
    assert "--namespace=ml" in container["args"] and "--namespace=team-b" in container["args"]
    assert container["image"] == "ghcr.io/kvfetcher/kvfetcher-operator@sha256:" + "a" * 64
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KVFETCHER_ENDPOINT_DENY"] == "10.96.0.0/12" and env["KVFETCHER_ENDPOINT_HOSTS"] == "s3.example.com"


def test_network_policy_opens_only_the_webhook_and_listed_metrics_peers(chart: helm_python.Chart) -> None:
    """The chart ships a NetworkPolicy for the operator and one for the webhook pods."""
    policy = named(render(chart, {}), "NetworkPolicy", "kvf-kvfetcher-webhook")
    assert policy["spec"]["ingress"] == [{"ports": [{"port": port, "protocol": "TCP"}
                                                    for port in ("webhook", "health", "ready")]}]
    policy = named(render(chart, VALUE_SETS["namespaced"]), "NetworkPolicy", "kvf-kvfetcher-webhook")
    assert policy["spec"]["ingress"][1]["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    assert policy["spec"]["ingress"][1]["from"][0]["namespaceSelector"]["matchLabels"] == {"name": "monitoring"}


def test_deployment_wires_the_operator(chart: helm_python.Chart) -> None:
    docs = render(chart, VALUE_SETS["cert-manager-own-issuer"])
    container = named(docs, "Deployment", "kvf-kvfetcher")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    hook = named(docs, "Deployment", "kvf-kvfetcher-webhook")["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in hook["env"]}["KVFETCHER_WEBHOOK_PORT"] == "10443"
    assert env["KVFETCHER_METRICS_PORT"] == "9090"
    assert env["KVFETCHER_RETRY_SECONDS"] == "5"
    assert env["KVFETCHER_WEBHOOK_CONFIGURATION"] == by_kind(docs, "MutatingWebhookConfiguration")[0]["metadata"]["name"]
    assert "--verbose" in container["args"] and "--standalone" in container["args"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    (monitor,) = by_kind(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert by_kind(docs, "PodMonitor")[0]["spec"]["podMetricsEndpoints"][0]["port"] == "kvfetcher"
    assert not by_kind(docs, "ConfigMap")  # dashboard off in this set


def test_dashboard_covers_the_sidecar_metrics(chart: helm_python.Chart) -> None:
    (configmap,) = by_kind(render(chart, {}), "ConfigMap")
    dashboard = json.loads(configmap["data"]["kvfetcher-sidecar.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in ("kvfetcher_lookups_total", "kvfetcher_hit_tokens_total", "kvfetcher_lookup_tokens_total",
                   "kvfetcher_store_dropped_chunks_total", "kvfetcher_decode_warm_up_seconds",
                   "kvfetcher_fetch_predicted_seconds_sum", "kvfetcher_fetch_actual_seconds_sum", "kvfetcher_store_up",
                   "kvfetcher_fetch_seconds_bucket",
                   "kvfetcher_store_seconds_bucket", "kvfetcher_bytes_read_total", "kvfetcher_bytes_written_total",
                   "kvfetcher_compression_ratio", "kvfetcher_decode_bytes_per_second",
                   "kvfetcher_preset_decisions_total", "kvfetcher_fallbacks_total", "kvfetcher_errors_total",
                   "kvfetcher_store_queue_depth"):
        assert metric in exprs, metric
    assert "by (preset)" in exprs and exprs.count("by (reason)") == 2
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_chart_crd_is_the_same_file_as_crds() -> None:
    assert (CHART / "crds" / "kvcachepools.kvfetcher.io.yaml").read_bytes() == \
        (REPO / "crds" / "kvcachepools.kvfetcher.io.yaml").read_bytes()
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == sorted(p.name for p in (REPO / "crds").iterdir())


def test_chart_ships_the_crd(chart: helm_python.Chart) -> None:
    crds = chart.crds
    text = json.dumps(crds) if not isinstance(crds, str) else crds
    assert "kvcachepools.kvfetcher.io" in text


@pytest.mark.parametrize("values", [
    {"webhook": {"certificates": {"mode": "manual"}}},
    {"webhook": {"port": 443}},
    {"metrics": {"port": "8080"}},
    {"operator": {"retrySeconds": 0}},
    {"replicaCount": 2},
    {"image": {"repository": ""}},
    {"metrics": {"serviceMonitor": {"interval": "often"}}},
    {"webhook": {"certificates": {"mode": "certManager", "certManager": {"issuerRef": {"kind": "Vault"}}}}},
], ids=["cert-mode", "privileged-port", "port-as-string", "zero-retry", "unknown-key", "empty-image",
        "bad-interval", "issuer-kind"])
def test_values_schema_refuses_bad_values(chart: helm_python.Chart, values: dict[str, Any]) -> None:
    with pytest.raises(helm_python.HelmValuesError, match="don't meet the specifications of the schema"):
        chart.render(values, name="kvf", namespace=NAMESPACE, is_install=True)


def exported_metrics() -> set[str]:
    """Every series name the sidecar and the operator export (histograms' and counters' suffixes included)."""
    from prometheus_client import generate_latest

    from kvfetcher.metrics import Metrics
    from kvfetcher_operator import metrics

    text = Metrics().exposition().decode() + generate_latest(metrics.REGISTRY).decode()
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    return families | {f + s for f in families for s in ("_total", "_sum", "_count", "_bucket", "_info")}


def test_dashboard_and_alerts_name_only_exported_metrics(chart: helm_python.Chart) -> None:
    docs = render(chart, VALUE_SETS["cert-manager-own-issuer"] | {"grafanaDashboard": {"enabled": True}})
    (rule,) = by_kind(docs, "PrometheusRule")
    alerts = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {"KVFetcherStoreUnreachable", "KVFetcherPoolNotReady", "KVFetcherStoreChunksDropped"} <= set(alerts)
    assert rule["metadata"]["labels"]["release"] == "prom"
    (configmap,) = by_kind(docs, "ConfigMap")
    panels = json.loads(configmap["data"]["kvfetcher-sidecar.json"])["panels"]
    exprs = list(alerts.values()) + [t["expr"] for p in panels for t in p["targets"]]
    named_metrics = {m for e in exprs for m in re.findall(r"\bkvfetcher_[a-z_]+", e)}
    assert named_metrics and named_metrics <= exported_metrics(), named_metrics - exported_metrics()
    assert not by_kind(render(chart, {}), "PrometheusRule")  # off by default: its CRD may be absent


def test_the_service_monitor_gets_through_the_default_network_policy(chart: helm_python.Chart) -> None:
    """With only the ServiceMonitor turned on, the scrape is let in: its selector finds the metrics
    Service, whose pods' NetworkPolicies admit Prometheus on the metrics port."""
    docs = render(chart, {"metrics": {"serviceMonitor": {"enabled": True}}})
    (monitor,) = by_kind(docs, "ServiceMonitor")
    service = named(docs, "Service", "kvf-kvfetcher-metrics")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    port = monitor["spec"]["endpoints"][0]["port"]
    assert port in {p["name"] for p in service["spec"]["ports"]}
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    for policy in by_kind(docs, "NetworkPolicy"):
        assert policy["spec"]["podSelector"]["matchLabels"].items() >= service["spec"]["selector"].items()
        admitted = [rule for rule in policy["spec"]["ingress"] if {"port": "metrics", "protocol": "TCP"} in rule["ports"]]
        assert admitted and any(peer.get("podSelector", {}).get("matchLabels") == prometheus and
                                peer.get("namespaceSelector") == {} for peer in admitted[0]["from"]), policy
    # Without the ServiceMonitor, and unless metricsFrom lists peers, metrics stay closed.
    for policy in by_kind(render(chart, {}), "NetworkPolicy"):
        assert all("metrics" not in str(rule["ports"]) for rule in policy["spec"]["ingress"])


def env_of(deployment: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_a_registry_mirror_reaches_every_image(chart: helm_python.Chart, monkeypatch: pytest.MonkeyPatch) -> None:
    """global.imageRegistry: the operator's image, and the sidecar's and MinIO's of pools naming
    none, all from the mirror; a pool's own image still wins."""
    docs = render(chart, {"global": {"imageRegistry": "mirror.example.com"}})
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    for name in ("kvf-kvfetcher", "kvf-kvfetcher-webhook"):
        deployment = named(docs, "Deployment", name)
        image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image == f"mirror.example.com/kvfetcher/kvfetcher-operator:{version}"
        env = env_of(deployment)
        assert env["KVFETCHER_SIDECAR_IMAGE"] == f"mirror.example.com/kvfetcher/kvfetcher-sidecar:{version}"
        assert env["KVFETCHER_MINIO_IMAGE"].startswith("mirror.example.com/minio/minio:RELEASE.")
    # What the webhook then injects (it reads the variables the chart set).
    from test_op_builders import MANAGED, gpu_pod, pool

    for key in ("KVFETCHER_SIDECAR_IMAGE", "KVFETCHER_MINIO_IMAGE"):
        monkeypatch.setenv(key, env[key])
    decision = injection.mutate(gpu_pod(), pool(MANAGED))
    assert decision.patch["spec"]["initContainers"][0]["image"] == env["KVFETCHER_SIDECAR_IMAGE"]
    assert minio.statefulset(pool(MANAGED))["spec"]["template"]["spec"]["containers"][0]["image"] == env["KVFETCHER_MINIO_IMAGE"]
    own = pool({**MANAGED, "sidecar": {"image": "registry.local/own-sidecar:1"}})
    assert injection.mutate(gpu_pod(), own).patch["spec"]["initContainers"][0]["image"] == "registry.local/own-sidecar:1"
    # A repository without a registry gets the mirror in front; a digest pins.
    docs = render(chart, {"global": {"imageRegistry": "mirror.example.com/"},
                          "sidecar": {"image": {"repository": "kvfetcher-sidecar", "digest": "sha256:" + "b" * 64}}})
    assert env_of(named(docs, "Deployment", "kvf-kvfetcher"))["KVFETCHER_SIDECAR_IMAGE"] == \
        "mirror.example.com/kvfetcher-sidecar@sha256:" + "b" * 64


def test_fullname_override_and_pod_labels(chart: helm_python.Chart) -> None:
    docs = render(chart, {"fullnameOverride": "kvcache", "podLabels": {"team": "ml-platform"}})
    names = {d["metadata"]["name"] for d in docs if d["kind"] in ("Deployment", "Service", "ClusterRole")}
    assert {"kvcache", "kvcache-webhook", "kvcache-metrics", "kvcache-pool-namespace"} <= names
    (config,) = by_kind(docs, "MutatingWebhookConfiguration")
    assert config["webhooks"][0]["clientConfig"]["service"]["name"] == "kvcache-webhook"
    for deployment in by_kind(docs, "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert labels["team"] == "ml-platform"
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_an_upgrade_says_how_to_upgrade_the_crd(chart: helm_python.Chart) -> None:
    """Helm installs crds/ once and never upgrades it: the upgrade's notes and the docs say what to run."""
    out = chart.render({}, name="kvf", namespace=NAMESPACE, is_upgrade=True)
    (notes,) = [text for path, text in out.items() if path.endswith("NOTES.txt")]
    command = "kubectl apply --server-side -f charts/kvfetcher/crds/"
    assert command in notes
    assert command in (REPO / "README.md").read_text() and command in (REPO / "docs" / "operations.md").read_text()
