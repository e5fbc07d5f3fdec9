"""Pure builders for a pool's managed MinIO: a StatefulSet with its volume claims, two Services,
a PodDisruptionBudget and a NetworkPolicy.

One replica runs MinIO standalone; four or more run it distributed with erasure coding, the
peers finding each other through the headless Service. The StatefulSet's PVC retention
policy carries the pool's data policy, so that `Delete` removes the volumes with the pool
and `Retain` keeps them for a later pool of the same name.

MinIO runs with root credentials from their own Secret (`<pool>-minio-root`), which only MinIO
and the operator read; the sidecars get a MinIO user limited to the pool's bucket (users.py).
MinIO pods are Pod Security "restricted" compliant, mount no service account token, spread
over nodes, and take S3 traffic only from their peers, the pool's injected pods and the
operator; the console is not served, metrics need a token.
"""
from __future__ import annotations

import copy
from typing import Any

from . import builders
from . import spec as specs

DATA_PATH = "/data"
# MinIO's container without `storage.managed.resources`: requests only (scheduled for what it needs,
# never OOM-killed by a guessed limit)
DEFAULT_RESOURCES = {"requests": {"cpu": "250m", "memory": "1Gi"}}


def headless_name(pool_name: str) -> str:
    return f"{builders.minio_name(pool_name)}-hl"


def _managed(pool: dict[str, Any]) -> dict[str, Any]:
    return specs.with_defaults(pool["spec"])["storage"]["managed"]


def server_args(pool: dict[str, Any]) -> list[str]:
    meta = pool["metadata"]
    replicas = _managed(pool)["replicas"]
    if replicas == 1:
        target = DATA_PATH
    else:
        sts, hl = builders.minio_name(meta["name"]), headless_name(meta["name"])
        target = f"http://{sts}-{{0...{replicas - 1}}}.{hl}.{meta['namespace']}.svc.cluster.local{DATA_PATH}"
    return ["server", target, "--address", f":{builders.S3_PORT}"]


def services(pool: dict[str, Any]) -> list[dict[str, Any]]:
    """The client Service (S3 on 9000) and the headless one that gives each replica a DNS name."""
    name = pool["metadata"]["name"]
    selector = builders.labels(name, "minio")
    ports = [{"name": "s3", "port": builders.S3_PORT, "targetPort": "s3", "protocol": "TCP"}]
    client = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": builders.child_meta(pool, builders.minio_name(name), "minio"),
        "spec": {"type": "ClusterIP", "selector": selector, "ports": ports},
    }
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": builders.child_meta(pool, headless_name(name), "minio"),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector, "ports": ports},
    }
    return [client, headless]


def statefulset(pool: dict[str, Any]) -> dict[str, Any]:
    meta = pool["metadata"]
    name = meta["name"]
    managed = _managed(pool)
    policy = specs.with_defaults(pool["spec"])["retention"]["dataPolicy"]
    root = builders.root_secret_name(name)
    pod_labels = builders.labels(name, "minio")
    probe = {"httpGet": {"path": "/minio/health/ready", "port": "s3"}, "periodSeconds": 10, "failureThreshold": 3}
    claim_spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": managed["size"]}},
    }
    if managed.get("storageClassName"):
        claim_spec["storageClassName"] = managed["storageClassName"]
    container = {
        "name": "minio",
        "image": managed["image"],
        "args": server_args(pool),
        "env": [
            {"name": "MINIO_ROOT_USER", "valueFrom": {"secretKeyRef": {"name": root, "key": "rootUser"}}},
            {"name": "MINIO_ROOT_PASSWORD", "valueFrom": {"secretKeyRef": {"name": root, "key": "rootPassword"}}},
            {"name": "MINIO_BROWSER", "value": "off"},
        ],
        "ports": [{"name": "s3", "containerPort": builders.S3_PORT, "protocol": "TCP"}],
        "readinessProbe": probe,
        "livenessProbe": {**probe, "httpGet": {"path": "/minio/health/live", "port": "s3"}},
        "volumeMounts": [{"name": "data", "mountPath": DATA_PATH}],
        "resources": managed.get("resources") or copy.deepcopy(DEFAULT_RESOURCES),
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": builders.child_meta(pool, builders.minio_name(name), "minio"),
        "spec": {
            "serviceName": headless_name(name),
            "replicas": managed["replicas"],
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": pod_labels},
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": policy, "whenScaled": "Retain"},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000, "runAsNonRoot": True,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "topologySpreadConstraints": [{
                        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": pod_labels}}],
                    "containers": [container],
                },
            },
            "volumeClaimTemplates": [{
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "data", "labels": pod_labels},
                "spec": claim_spec,
            }],
        },
    }


def selector(pool: dict[str, Any]) -> str:
    """The label selector of the pool's MinIO pods."""
    return ",".join(f"{k}={v}" for k, v in sorted(builders.labels(pool["metadata"]["name"], "minio").items()))


def guards(pool: dict[str, Any], operator_namespace: str | None = None) -> list[dict[str, Any]]:
    """The PodDisruptionBudget (one replica down at a time) and the NetworkPolicy of the pool's MinIO.

    S3 is open to the MinIO peers, the injected pods of the pool's namespace, the pool's evictor and
    calibration Job, and the operator (in `operator_namespace`, or any namespace when it is not
    known); nothing else gets in.
    """
    name = pool["metadata"]["name"]
    pod_labels = builders.labels(name, "minio")
    operator = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvfetcher",
                                                "app.kubernetes.io/component": "operator"}},
                "namespaceSelector": ({"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}}
                                      if operator_namespace else {})}
    peers = [{"podSelector": {"matchLabels": pod_labels}},
             {"podSelector": {"matchLabels": {"kvfetcher.io/inject": "true"}}}, operator,
             {"podSelector": {"matchLabels": builders.labels(name, builders.EVICTOR)}},
             {"podSelector": {"matchLabels": builders.labels(name, builders.CALIBRATION)}}]
    pdb = {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": builders.child_meta(pool, builders.minio_name(name), "minio"),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": pod_labels}},
    }
    policy = {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": builders.child_meta(pool, builders.minio_name(name), "minio"),
        "spec": {"podSelector": {"matchLabels": pod_labels}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": peers, "ports": [{"port": builders.S3_PORT, "protocol": "TCP"}]}]},
    }
    return [pdb, policy]


def pods_waiting(pods: list[dict[str, Any]], wanted: int) -> str:
    """Why MinIO pods are not ready, as far as their status says (empty when it says nothing)."""
    if len(pods) < max(wanted, 1):
        return (f"; {len(pods)} of {max(wanted, 1)} pods exist (the StatefulSet's events say why the others "
                f"were not created, e.g. Pod Security admission or a quota)")
    for pod in pods:
        status = pod.get("status") or {}
        for c in status.get("containerStatuses") or []:
            waiting = (c.get("state") or {}).get("waiting")
            if waiting:
                return f"; pod {pod['metadata']['name']}: {waiting.get('reason')}"
        for c in status.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                return f"; pod {pod['metadata']['name']} unschedulable: {c.get('message', '')[:200]}"
    return ""


def ready_replicas(sts: dict[str, Any] | None) -> tuple[int, int]:
    """(ready, wanted) replicas of a StatefulSet as the API reports it."""
    if not sts:
        return 0, 0
    return int((sts.get("status") or {}).get("readyReplicas") or 0), int(sts["spec"].get("replicas") or 1)


def volume_drift(current: dict[str, Any], desired: dict[str, Any]) -> list[str]:
    """Volume settings the pool asks for but the existing StatefulSet cannot take (its claim templates are immutable)."""
    def claim(sts: dict[str, Any]) -> dict[str, Any]:
        templates = (sts.get("spec") or {}).get("volumeClaimTemplates") or [{}]
        return templates[0].get("spec") or {}
    now, want = claim(current), claim(desired)
    out = []
    size_now = ((now.get("resources") or {}).get("requests") or {}).get("storage")
    size_want = want["resources"]["requests"]["storage"]
    if size_now and size_now != size_want:
        out.append(f"volume size stays {size_now} (asked: {size_want}): resize the PVCs, or recreate the pool")
    if now.get("storageClassName") != want.get("storageClassName") and size_now:
        out.append(f"storageClassName stays {now.get('storageClassName')!r} (asked: {want.get('storageClassName')!r})")
    return out


# A StatefulSet's spec is immutable except for these fields: updates patch only them.
MUTABLE_FIELDS = ("replicas", "template", "persistentVolumeClaimRetentionPolicy", "updateStrategy", "minReadySeconds")
