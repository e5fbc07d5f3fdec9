"""The pool's model calibration: a Job that runs `kvfetcher calibrate --publish` into the pool's store
when `spec.model` names a calibration source and the store has no calibration of the model yet.

The model is `spec.model.name`, the fingerprint the pool's sidecars serve; a calibration applies
to every fingerprint that starts with its tag, the whole name with `/` written `--` (as the
sidecar matches it). The Job reads the model from a volume mounted read-only at MODEL_DIR: a PersistentVolumeClaim
of the pool's namespace, or an OCI image (Kubernetes image volumes). No hostPath: whoever may
create a pool would read any node file through the operator's Job.

The Job's name carries a digest of its pod template, so a spec change that alters what it would
run makes a new Job (a Job's template is immutable), and an unchanged spec finds its Job again:
one Job per calibration, whatever the passes. A Job runs at most DEADLINE_S and is deleted
KEEP_FINISHED_S after it ends; a failed one stays until then, and with it the `Calibrated`
condition's reason and its pod's exit code (never its output, which may hold what it read from its
environment), unless the spec changes or someone deletes it (then the next pass runs it again).

It tags the artefact with the pool's object key (the sidecars install no calibration without a
valid tag). It reaches the store with scoped credentials (storage_env, as the evictor): managed MinIO's
calibrator user, who may only list the bucket and read and write calibrations, never MinIO's root
or the sidecars' user (who may only read them); an external store's own credentials. No service
account token, restricted Pod Security, never injected; managed MinIO lets it in by its component.
"""
from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from kvfetcher import config as settings

from . import builders, evictor, injection, minio
from . import spec as specs

COMPONENT = builders.CALIBRATION
MODEL_DIR = "/model"
WORK_DIR = "/work"  # the CLI's writable places: the model's plain copy, the artefact before publishing
RESOURCES = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "32Gi"}}
DEADLINE_S = 12 * 3600  # a calibration running longer fails (DeadlineExceeded)
KEEP_FINISHED_S = 24 * 3600  # a finished Job is deleted after this; a failed one then runs again


def tag(model_name: str) -> str:
    """The calibration tag of a served model, what the store files it under: its whole name, one path
    component (the sidecar's ``codec.basis.tag_of``; the operator does not import the data plane)."""
    return model_name.replace("/", "--")


def _volumes(source: dict[str, Any]) -> list[dict[str, Any]]:
    claim = source.get("persistentVolumeClaim")
    if claim:
        model = {"persistentVolumeClaim": {"claimName": claim["claimName"], "readOnly": True}}
    else:
        model = {"image": {"reference": source["image"]["reference"]}}
    return [{"name": "model", **model}, {"name": "work", "emptyDir": {}}]


def _source_path(source: dict[str, Any]) -> str:
    return (source.get("persistentVolumeClaim") or source.get("image"))["path"]


def _template(pool: dict[str, Any]) -> dict[str, Any]:
    spec = specs.with_defaults(pool["spec"])
    model, side = spec["model"], spec["sidecar"]
    job = model["calibration"].get("job") or {}
    source = model["calibration"]["source"]
    ca = injection.ca_volume(pool)
    mounts = [{"name": "model", "mountPath": MODEL_DIR, "readOnly": True}, {"name": "work", "mountPath": WORK_DIR}]
    pool_secret = builders.secret_name(pool["metadata"]["name"])
    env = injection.storage_env(pool, builders.CALIBRATOR_KEYS) + [
        # the pool's object key: the artefact is tagged with it, and the pool's sidecars take no other
        {"name": settings.OBJECT_KEY.name, "valueFrom": {"secretKeyRef": {"name": pool_secret, "key": "objectKey"}}},
        {"name": settings.CACHE.name, "value": f"{WORK_DIR}/cache"},
        {"name": settings.CALIBRATION_DIR.name, "value": f"{WORK_DIR}/calibration"},
        {"name": "HOME", "value": WORK_DIR},  # transformers' caches
    ]
    container = {
        "name": COMPONENT,
        "image": job.get("image", side["image"]),
        "imagePullPolicy": side["imagePullPolicy"],
        "args": ["calibrate", "--model", f"{MODEL_DIR}/{_source_path(source)}", "--tag", tag(model["name"]),
                 "--publish", evictor.store_url(pool)],
        "env": env,
        "resources": copy.deepcopy(job.get("resources") or RESOURCES),
        "securityContext": copy.deepcopy(injection.SECURITY_CONTEXT),
        "volumeMounts": mounts + ([{"name": ca["name"], "mountPath": injection.CA_DIR, "readOnly": True}] if ca else []),
    }
    return {
        "metadata": {"labels": builders.labels(pool["metadata"]["name"], COMPONENT)},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [container],
            "volumes": _volumes(source) + ([ca] if ca else []),
        },
    }


def job(pool: dict[str, Any]) -> dict[str, Any]:
    """The calibration Job of a pool whose `spec.model.calibration` names a source; its name ends in
    a digest of what it runs."""
    template = _template(pool)
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:8]
    name = f"{pool['metadata']['name']}-calibrate-{digest}"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": builders.child_meta(pool, name, COMPONENT),
        "spec": {"backoffLimit": 1, "activeDeadlineSeconds": DEADLINE_S, "ttlSecondsAfterFinished": KEEP_FINISHED_S,
                 "template": template},
    }


def _last_words(pods: list[dict[str, Any]]) -> str:
    """Which pod failed and how; never its output (its log may hold what it read from its environment)."""
    for pod in pods:
        for c in (pod.get("status") or {}).get("containerStatuses") or []:
            ended = (c.get("state") or {}).get("terminated") or {}
            if ended.get("exitCode"):
                return (f"; pod {pod['metadata']['name']} exited with code {ended['exitCode']} "
                        f"({ended.get('reason', 'Error')}): see its log")
    return ""


def readiness(pool: dict[str, Any], published: list[str], current: dict[str, Any] | None,
              pods: list[dict[str, Any]]) -> tuple[bool, str, str]:
    """(calibrated, reason, message) from what the store holds under the model's tag (`published`),
    the calibration Job as the API reports it (None: none) and its pods."""
    model = specs.with_defaults(pool["spec"])["model"]
    where = f"_meta/calibration/{tag(model['name'])}/ of the pool's store"
    if published:
        return True, "Calibrated", f"{where} holds {published[-1]}: calibrated presets serve {model['name']}"
    if "calibration" not in model:
        return False, "NoSource", (f"{where} holds no calibration and spec.model.calibration names no source: "
                                   f"presets that need one are refused for {model['name']} (unless the sidecar "
                                   f"image ships its calibration)")
    if current is None:
        return False, "NotCreated", "the calibration Job is created once the storage is ready"
    name = current["metadata"]["name"]
    status = current.get("status") or {}
    done = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    if "Failed" in done:
        why = done["Failed"]
        return False, "JobFailed", (f"Job {name} failed ({why.get('reason')}: {why.get('message', '')})"
                                    f"{_last_words(pods)}; fix the cause, then delete the Job to run it again")
    if "Complete" in done:
        return False, "NotPublished", f"Job {name} succeeded, yet {where} holds no calibration"
    return False, "Calibrating", (f"Job {name} calibrates {MODEL_DIR}/{_source_path(model['calibration']['source'])}"
                                  f"{minio.pods_waiting(pods, 1) if pods else ''}")
