"""The pool's evictor: one Deployment per pool that keeps its store under `retention.maxSize` and
`retention.ttlDays` by running `kvfetcher evict` (the sidecar image's CLI) every
`retention.evictIntervalSeconds`.

A Deployment of one replica, not a CronJob: a pass is due every minute or so, the CronJob
schedule's finest grain, and starting a pod with Python and the store client each time would
cost more than the pass; the CLI's own `--every` loop paces it, one long-lived process keeps its
connections, and a crash is restarted with back-off by the kubelet. `Recreate` stops the old pod
before a new one starts, so a spec change never runs two evictors on one store (were it to happen,
two passes delete the same objects: deletes are idempotent).

The evictor reaches the store as the pool's sidecars do (storage_env: the same scoped
credentials, by Secret reference; never MinIO's root), and nothing else: no service account
token, no Service, restricted Pod Security. It carries no `kvfetcher.io/inject` label, so the
webhook never injects it; managed MinIO's NetworkPolicy lets it in by its component label.
"""
from __future__ import annotations

import copy
from typing import Any

from . import builders, injection, minio
from . import spec as specs

COMPONENT = builders.EVICTOR
RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}


def name(pool_name: str) -> str:
    return f"{pool_name}-evictor"


def store_url(pool: dict[str, Any]) -> str:
    """The store as `kvfetcher evict --store` names it: the endpoint URL and the bucket."""
    endpoint, bucket = builders.storage_location(pool)
    return f"{endpoint}/{bucket}"


def args(pool: dict[str, Any]) -> list[str]:
    """`kvfetcher evict`'s arguments: the store, the TTL, the pass interval, and the byte bound if any."""
    retention = specs.with_defaults(pool["spec"])["retention"]
    out = ["evict", "--store", store_url(pool), "--ttl-days", str(retention["ttlDays"]),
           "--every", str(retention["evictIntervalSeconds"])]
    if "maxSize" in retention:
        out += ["--max-bytes", str(specs.quantity_bytes(retention["maxSize"]))]
    return out


def deployment(pool: dict[str, Any]) -> dict[str, Any]:
    pool_name = pool["metadata"]["name"]
    side = specs.with_defaults(pool["spec"])["sidecar"]
    pod_labels = builders.labels(pool_name, COMPONENT)
    ca = injection.ca_volume(pool)
    container = {
        "name": COMPONENT,
        "image": side["image"],
        "imagePullPolicy": side["imagePullPolicy"],
        "args": args(pool),
        "env": injection.storage_env(pool),
        "resources": copy.deepcopy(RESOURCES),
        "securityContext": copy.deepcopy(injection.SECURITY_CONTEXT),
        "volumeMounts": [{"name": ca["name"], "mountPath": injection.CA_DIR, "readOnly": True}] if ca else [],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": builders.child_meta(pool, name(pool_name), COMPONENT),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": pod_labels},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    "volumes": [ca] if ca else [],
                },
            },
        },
    }


def selector(pool_name: str) -> str:
    """The label selector of the pool's evictor pod."""
    return ",".join(f"{k}={v}" for k, v in sorted(builders.labels(pool_name, COMPONENT).items()))


def readiness(pool: dict[str, Any], current: dict[str, Any] | None,
              pods: list[dict[str, Any]]) -> tuple[bool, str, str]:
    """(running, reason, message) of the pool's evictor, from its Deployment and pods as the API reports them."""
    meta = pool["metadata"]
    if current is None:
        return False, "NotCreated", "the evictor is created once the storage is ready"
    if int((current.get("status") or {}).get("availableReplicas") or 0) < 1:
        return False, "EvictorStarting", (f"Deployment {name(meta['name'])} has no available replica"
                                          f"{minio.pods_waiting(pods, 1)}")
    retention = specs.with_defaults(pool["spec"])["retention"]
    bound = f"under {retention['maxSize']} and " if "maxSize" in retention else ""
    return True, "Evicting", (f"Deployment {name(meta['name'])} keeps the store {bound}within {retention['ttlDays']} "
                              f"days, every {retention['evictIntervalSeconds']} s")
