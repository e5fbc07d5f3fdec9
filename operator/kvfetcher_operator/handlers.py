"""The reconciler role: thin kopf handlers that validate, build, apply, probe storage, write status.
Every step idempotent; one replica runs them (the webhook is `admission`'s, in its own replicas).

create, update, resume (after an operator restart) and a periodic resync all run the same
`reconcile`, so that whatever state a pool's children or storage are in, the next pass brings
them to the spec and the status tells the truth. Storage that is not there yet makes the
change handlers retry; an invalid spec does not (only a new spec can fix it).
"""
from __future__ import annotations

import copy
import os
import socket
import tempfile
from typing import Any
from urllib.parse import urlsplit

import kopf

from . import bucket, builders, calibration, conditions, endpoints, evictor, injection, kube, metrics, minio, users
from . import runtime  # noqa: F401  (registers the shared startup, login and cleanup handlers)
from . import spec as specs
from .conditions import CALIBRATED, CONFIG_VALID, EVICTOR_READY, INJECTION_READY, READY, STORAGE_READY
from .config import RESYNC_SECONDS, Config
from .webhook import WEBHOOK_ID

POOL = (specs.GROUP, specs.VERSION, specs.PLURAL)


class NotReady(Exception):
    """Storage (or the webhook) is not usable yet; `reason` becomes the condition's reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@kopf.on.startup()
def configure_endpoints(memo: kopf.Memo, **_: Any) -> None:
    memo.endpoints = endpoint_policy(memo.cfg, memo.kube)


def endpoint_policy(cfg: Config, k: kube.Kube) -> endpoints.Policy:
    """The configured endpoint policy, with the Kubernetes API server's own addresses denied too."""
    api_host = urlsplit(k.cfg.host).hostname or ""
    try:
        api_addresses = {info[4][0] for info in socket.getaddrinfo(api_host, None)}
    except OSError:
        api_addresses = set()
    return endpoints.Policy().extended(deny=[*cfg.endpoint_deny.split(","), *api_addresses],
                                       allow=cfg.endpoint_allow.split(","), hosts=cfg.endpoint_hosts.split(","))


@kopf.index("pods", annotations={injection.INJECTED_ANNOTATION: kopf.PRESENT})
def injected_pods(namespace: str, name: str, annotations: Any, **_: Any) -> dict[tuple[str, str], str]:
    return {(namespace, annotations[injection.INJECTED_ANNOTATION]): name}


def _pool(body: kopf.Body) -> dict[str, Any]:
    return {"metadata": copy.deepcopy(dict(body.metadata)), "spec": copy.deepcopy(dict(body.spec)),
            "status": copy.deepcopy(dict(body.status))}


def _ca_file(pool: dict[str, Any], k: kube.Kube, ref: dict[str, Any]) -> str:
    secret = k.get("v1", "secrets", pool["metadata"]["namespace"], ref["name"])
    data = builders.decode_secret_data((secret or {}).get("data"))
    if ref["key"] not in data:
        raise NotReady("CASecretMissing", f"Secret {ref['name']} with key {ref['key']} not found")
    path = os.path.join(tempfile.gettempdir(), f"kvfetcher-ca-{pool['metadata']['uid']}.pem")
    with open(path, "w") as f:
        f.write(data[ref["key"]])
    return path


def storage_target(pool: dict[str, Any], k: kube.Kube, root: dict[str, str] | None) -> bucket.Target:
    """Where the bucket is and the operator's credentials (managed: MinIO's `root`); NotReady while unreachable."""
    spec = specs.with_defaults(pool["spec"])
    endpoint, bucket_name = builders.storage_location(pool)
    namespace = pool["metadata"]["namespace"]
    if "managed" in spec["storage"]:
        sts = k.get("apps/v1", "statefulsets", namespace, builders.minio_name(pool["metadata"]["name"]))
        ready, wanted = minio.ready_replicas(sts)
        if wanted == 0 or ready < wanted:
            pods = k.list("v1", "pods", namespace, minio.selector(pool))
            raise NotReady("MinIOStarting", f"{ready}/{wanted or spec['storage']['managed']['replicas']} "
                                            f"MinIO replicas ready{minio.pods_waiting(pods, wanted)}")
        return bucket.Target(endpoint, bucket_name, root["rootUser"], root["rootPassword"])
    external = spec["storage"]["external"]
    ref = external["credentialsSecretRef"]
    secret = k.get("v1", "secrets", namespace, ref["name"])
    if secret is None:
        raise NotReady("CredentialsMissing", f"Secret {namespace}/{ref['name']} not found")
    creds = builders.decode_secret_data(secret.get("data"))
    missing = [key for key in (ref["accessKeyKey"], ref["secretKeyKey"]) if not creds.get(key)]
    if missing:
        raise NotReady("CredentialsMissing", f"Secret {namespace}/{ref['name']} lacks key(s) {missing}")
    tls = external.get("tls") or {}
    ca = _ca_file(pool, k, tls["caSecretRef"]) if tls.get("caSecretRef") else None
    return bucket.Target(endpoint, bucket_name, creds[ref["accessKeyKey"]], creds[ref["secretKeyKey"]],
                         region=external.get("region"), ca_file=ca, insecure=bool(tls.get("insecureSkipVerify")))


def owner_id(pool: dict[str, Any]) -> str:
    """Who claims a bucket: the pool's namespace and name (a re-created pool finds its retained data)."""
    return f"{pool['metadata']['namespace']}/{pool['metadata']['name']}"


def check_references(pool: dict[str, Any], k: kube.Kube, policy: endpoints.Policy) -> None:
    """What must hold before anything is built or called: an allowed endpoint, the tenancy Secret."""
    spec = specs.with_defaults(pool["spec"])
    namespace = pool["metadata"]["namespace"]
    if "external" in spec["storage"]:
        refused = endpoints.problem(spec["storage"]["external"]["endpoint"], policy)
        if refused:
            raise NotReady("EndpointRefused", refused)
    ref = spec["tenancy"].get("secretRef") if spec["tenancy"]["saltFrom"] == "Secret" else None
    if ref:
        data = (k.get("v1", "secrets", namespace, ref["name"]) or {}).get("data") or {}
        if not data.get(ref["key"]):
            raise NotReady("TenancySecretMissing", f"Secret {namespace}/{ref['name']} with key {ref['key']} not found")


def injection_readiness(spec: dict[str, Any], cfg: Config, k: kube.Kube) -> tuple[bool, str, str]:
    if not spec["injection"]["enabled"]:
        return True, "Disabled", "injection is disabled; clients reach the storage on their own"
    if cfg.webhook_configuration is None:
        return True, "WebhookServing", "the webhook is served (its MutatingWebhookConfiguration is not checked)"
    try:
        config = k.get("admissionregistration.k8s.io/v1", "mutatingwebhookconfigurations", None,
                       cfg.webhook_configuration)
    except Exception as e:
        return False, "WebhookCheckFailed", f"{type(e).__name__}: {e}"
    return injection.webhook_readiness(config, cfg.webhook_configuration, f"/{WEBHOOK_ID}")


def evictor_readiness(pool: dict[str, Any], k: kube.Kube) -> tuple[bool, str, str]:
    meta = pool["metadata"]
    try:
        current = k.get("apps/v1", "deployments", meta["namespace"], evictor.name(meta["name"]))
        pods = k.list("v1", "pods", meta["namespace"], evictor.selector(meta["name"])) if current else []
    except Exception as e:
        return False, "EvictorCheckFailed", f"{type(e).__name__}: {e}"
    return evictor.readiness(pool, current, pods)


def calibration_state(pool: dict[str, Any], k: kube.Kube,
                      target: bucket.Target | None) -> tuple[bool | None, str, str] | None:
    """Whether the store has the calibration of `spec.model` (None: the pool names no model): looked
    for there, else made by the calibration Job (created here when the model names a source, and its
    claim exists)."""
    spec, meta = specs.with_defaults(pool["spec"]), pool["metadata"]
    if "model" not in spec:
        return None
    if target is None:
        return None, "StorageNotReady", "the store is looked at once the storage is ready"
    try:
        published = bucket.calibrations(target, calibration.tag(spec["model"]["name"]))
    except Exception as e:
        return None, "StoreCheckFailed", f"the store's calibrations cannot be listed: {bucket.describe(e)}"
    source = (spec["model"].get("calibration") or {}).get("source")
    if published or not source:
        return calibration.readiness(pool, published, None, [])
    claim = (source.get("persistentVolumeClaim") or {}).get("claimName")
    desired = calibration.job(pool)
    name = desired["metadata"]["name"]
    try:
        if claim and k.get("v1", "persistentvolumeclaims", meta["namespace"], claim) is None:
            return False, "SourceMissing", f"PersistentVolumeClaim {meta['namespace']}/{claim} (the model) not found"
        job = k.get("batch/v1", "jobs", meta["namespace"], name) or k.apply(desired)
        pods = k.list("v1", "pods", meta["namespace"], f"batch.kubernetes.io/job-name={name}")
    except Exception as e:
        return False, "JobNotCreated", f"calibration Job {name}: {type(e).__name__}: {e}"
    return calibration.readiness(pool, published, job, pods)


def _announce(body: kopf.Body, before: list[dict[str, Any]], after: list[dict[str, Any]]) -> None:
    """One Event per condition change, not per pass."""
    for type_ in conditions.TYPES:
        if conditions.changed(before, after, type_):
            found = conditions.find(after, type_)
            if found is None:
                continue
            post = kopf.info if found["status"] == "True" else kopf.warn
            post(body, reason=found["reason"], message=f"{type_}={found['status']}: {found['message']}")


def _write(patch: kopf.Patch, pool: dict[str, Any], conds: list[dict[str, Any]], phase: str,
           injected: int, **fields: Any) -> None:
    meta = pool["metadata"]
    patch.status["conditions"] = conds
    patch.status["phase"] = phase
    patch.status["injectedPods"] = injected
    if meta.get("generation") is not None:
        patch.status["observedGeneration"] = meta["generation"]
    for key, value in fields.items():
        patch.status[key] = value
    metrics.POOLS.set(meta["namespace"], meta["name"], phase)
    metrics.CONDITIONS.set(meta["namespace"], meta["name"], conds)


def provision(body: kopf.Body, pool: dict[str, Any], k: kube.Kube, memo: kopf.Memo, announce: bool) -> bucket.Target:
    """Children applied and storage claimed, then the evictor; NotReady (or NameConflict) says
    what is missing. Returns the store as the operator reaches it."""
    spec = specs.with_defaults(pool["spec"])
    meta = pool["metadata"]
    endpoint, bucket_name = builders.storage_location(pool)
    check_references(pool, k, memo.endpoints)
    existing = k.get("v1", "secrets", meta["namespace"], builders.secret_name(meta["name"]))
    current = builders.decode_secret_data((existing or {}).get("data"))
    root = root_credentials(pool, k, current) if "managed" in spec["storage"] else None
    values = builders.secret_values(pool, current, root_user=root and root["rootUser"])
    k.apply(builders.secret(pool, values))
    if "managed" in spec["storage"]:
        for child in minio.services(pool) + minio.guards(pool, memo.cfg.namespace):
            k.apply(child)
        desired = minio.statefulset(pool)
        applied = k.apply(desired, mutable_spec=minio.MUTABLE_FIELDS)
        for drift in minio.volume_drift(applied, desired) if announce else []:
            kopf.warn(body, reason="VolumeChangeNotApplied", message=drift)
    target = storage_target(pool, k, root)
    try:
        bucket.ensure(target, owner_id(pool))
    except bucket.Claimed as e:
        raise NotReady("BucketInUse", str(e)) from e
    except Exception as e:
        raise NotReady("BucketUnavailable", f"bucket {bucket_name} at {endpoint}: {bucket.describe(e)}") from e
    if root is not None:
        try:
            users.ensure_user(target, values["accessKey"], values["secretKey"], users.POLICY,
                              users.sidecar_policy(bucket_name))
            users.ensure_user(target, *(values[key] for key in builders.CALIBRATOR_KEYS), users.CALIBRATOR_POLICY,
                              users.calibrator_policy(bucket_name))
        except Exception as e:
            raise NotReady("SidecarUserFailed", f"MinIO users for the pool at {endpoint}: {bucket.describe(e)}") from e
    k.apply(evictor.deployment(pool))
    return target


def root_credentials(pool: dict[str, Any], k: kube.Kube, pool_values: dict[str, str]) -> dict[str, str]:
    """Managed MinIO's root credentials, in their own Secret (made, or kept as they are)."""
    meta = pool["metadata"]
    name = builders.root_secret_name(meta["name"])
    found = k.get("v1", "secrets", meta["namespace"], name)
    root = builders.root_values(builders.decode_secret_data((found or {}).get("data")), pool_values)
    k.apply(builders.secret(pool, root, name))
    return root


def reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, injected_pods: kopf.Index,
              retry_until_ready: bool) -> None:
    pool = _pool(body)
    meta, gen = pool["metadata"], pool["metadata"].get("generation")
    before = pool["status"].get("conditions") or []
    conds = before
    injected = len(list(injected_pods.get((meta["namespace"], meta["name"]), [])))

    issues = builders.name_problems(meta["name"], pool["spec"]) + specs.problems(pool["spec"])
    if issues:
        conds = conditions.put(conds, CONFIG_VALID, False, "InvalidSpec", "; ".join(issues), gen)
        conds = conditions.put(conds, READY, False, "ConfigInvalid", "the spec is invalid: see ConfigValid", gen)
        _write(patch, pool, conds, "Failed", injected)
        _announce(body, before, conds)
        metrics.RECONCILE_ERRORS.labels("InvalidSpec").inc()
        return
    conds = conditions.put(conds, CONFIG_VALID, True, "Valid", "the spec is valid", gen)

    k: kube.Kube = memo.kube
    spec = specs.with_defaults(pool["spec"])
    endpoint, bucket_name = builders.storage_location(pool)
    secret_name = builders.secret_name(meta["name"])
    error: NotReady | None = None
    target: bucket.Target | None = None
    try:
        target = provision(body, pool, k, memo, announce=retry_until_ready)
        conds = conditions.put(conds, STORAGE_READY, True, "BucketReady",
                               f"bucket {bucket_name} at {endpoint} is ready", gen)
    except NotReady as e:
        error = e
        conds = conditions.put(conds, STORAGE_READY, False, e.reason, str(e), gen)
    except kube.NameConflict as e:
        error = NotReady("NameConflict", str(e))
        conds = conditions.put(conds, STORAGE_READY, False, error.reason, str(error), gen)
    except kube.ApiError as e:
        error = (NotReady("Forbidden", f"the operator may not act in namespace {meta['namespace']} (HTTP 403): "
                                       f"bind its pool-namespace ClusterRole there (docs/security.md)")
                 if e.status == 403 else NotReady("ApplyFailed", f"ApiError: {e}"))
        conds = conditions.put(conds, STORAGE_READY, False, error.reason, str(error), gen)
    except Exception as e:  # an API call failed: say so, and let kopf retry
        error = NotReady("ApplyFailed", f"{type(e).__name__}: {e}")
        conds = conditions.put(conds, STORAGE_READY, False, error.reason, str(error), gen)

    conds = conditions.put(conds, EVICTOR_READY, *evictor_readiness(pool, k), gen)
    calibrated = calibration_state(pool, k, target)
    conds = (conditions.put(conds, CALIBRATED, *calibrated, gen) if calibrated
             else [c for c in conds if c.get("type") != CALIBRATED])  # no model, nothing to calibrate
    injection_ok, reason, message = injection_readiness(spec, memo.cfg, k)
    conds = conditions.put(conds, INJECTION_READY, injection_ok, reason, message, gen)
    if error is None and not injection_ok:
        error = NotReady(reason, message)  # Ready needs both; the retry re-checks the webhook
    if error is None:
        conds = conditions.put(conds, READY, True, "Ready", "storage is ready and pods can be injected", gen)
        phase = "Ready"
    else:
        conds = conditions.put(conds, READY, False, error.reason, f"not ready: {error}", gen)
        phase = "Provisioning"
        metrics.RECONCILE_ERRORS.labels(error.reason).inc()
    _write(patch, pool, conds, phase, injected, endpoint=endpoint, bucket=bucket_name, secretName=secret_name)
    _announce(body, before, conds)
    if error is not None and retry_until_ready:
        raise kopf.TemporaryError(str(error), delay=memo.cfg.retry_seconds)


@kopf.on.resume(*POOL)
@kopf.on.create(*POOL)
@kopf.on.update(*POOL, field="spec")
def on_change(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, injected_pods: kopf.Index, **_: Any) -> None:
    reconcile(body, patch, memo, injected_pods, retry_until_ready=True)


@kopf.timer(*POOL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def resync(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, injected_pods: kopf.Index, **_: Any) -> None:
    """Catch drift the watch does not show: storage going away, children deleted, pods injected."""
    reconcile(body, patch, memo, injected_pods, retry_until_ready=False)


@kopf.on.delete(*POOL)
def finalize(body: kopf.Body, memo: kopf.Memo, injected_pods: kopf.Index, retry: int, **_: Any) -> None:
    """Apply the data policy once no pod uses the pool; the children go with it through their owner references.

    While injected pods exist, deletion waits (their sidecars need the Secret on restart).
    Retain keeps the data: the PVCs stay (the StatefulSet's retention policy), the bucket and its
    claim stay, and the pool's Secret (credentials, tenant salt) is released, to be taken back by
    a pool of the same name. Delete removes the data: the PVCs go with the StatefulSet; of an
    external bucket, what this pool wrote (and the bucket, if it created it) is removed, a step
    at a time, retried until it is done.
    """
    pool = _pool(body)
    meta = pool["metadata"]
    metrics.POOLS.set(meta["namespace"], meta["name"], "Terminating")
    users = list(injected_pods.get((meta["namespace"], meta["name"]), []))
    if users:
        if retry % 10 == 0:
            kopf.warn(body, reason="PoolInUse", message=f"deletion waits for {len(users)} pod(s) that use the pool, "
                                                        f"such as {sorted(users)[0]}")
        raise kopf.TemporaryError(f"{len(users)} pods still use the pool", delay=memo.cfg.retry_seconds)
    if specs.problems(pool["spec"]):
        metrics.POOLS.forget(meta["namespace"], meta["name"])
        metrics.CONDITIONS.forget(meta["namespace"], meta["name"])
        return
    spec = specs.with_defaults(pool["spec"])
    if spec["retention"]["dataPolicy"] == "Retain":
        release_secret(body, pool, memo.kube)
    elif "external" in spec["storage"]:
        delete_data(body, pool, memo, retry)
    metrics.POOLS.forget(meta["namespace"], meta["name"])
    metrics.CONDITIONS.forget(meta["namespace"], meta["name"])


def release_secret(body: kopf.Body, pool: dict[str, Any], k: kube.Kube) -> None:
    """Let go of the pool's Secrets (its own, and managed MinIO's root) so that they outlive it."""
    meta = pool["metadata"]
    owner = builders.owner_reference(pool)
    released = []
    for name in (builders.secret_name(meta["name"]), builders.root_secret_name(meta["name"])):
        secret = k.get("v1", "secrets", meta["namespace"], name)
        if secret is None or (kube.controller(secret) or {}).get("uid") != owner["uid"]:
            continue
        k.patch("v1", "secrets", meta["namespace"], name, {"metadata": {
            "ownerReferences": None, "annotations": {kube.RELEASED_ANNOTATION: kube.released_mark(owner)}}})
        released.append(name)
    if released:
        kopf.info(body, reason="DataRetained", message=f"data and Secret(s) {', '.join(released)} (credentials, "
                                                       f"tenant salt) are kept (dataPolicy Retain)")


def delete_data(body: kopf.Body, pool: dict[str, Any], memo: kopf.Memo, retry: int) -> None:
    k: kube.Kube = memo.kube
    try:
        check_references(pool, k, memo.endpoints)
        removed, done = bucket.remove(storage_target(pool, k, None), owner_id(pool))
    except bucket.Claimed as e:
        kopf.warn(body, reason="DataNotDeleted", message=str(e))
        return
    except Exception as e:
        text = e.args[0] if isinstance(e, NotReady) else bucket.describe(e)
        if retry % 10 == 0:
            kopf.warn(body, reason="DataNotDeletedYet", message=f"{text}; retrying (set retention.dataPolicy "
                                                                f"to Retain to delete the pool without its data)")
        raise kopf.TemporaryError(f"bucket not emptied yet: {text}", delay=memo.cfg.retry_seconds) from e
    if not done:
        raise kopf.TemporaryError(f"{removed} objects removed, more to go", delay=0.1)
    kopf.info(body, reason="DataDeleted", message=f"the pool's objects are removed ({removed} in the last step)")
