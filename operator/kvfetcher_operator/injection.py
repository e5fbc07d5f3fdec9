"""The pure pod mutation behind the admission webhook: add the kvfetcher sidecar to an opted-in pod.

A pod opts in with the label `kvfetcher.io/inject=true` (the webhook's objectSelector, so other
pods never reach us) and the annotation `kvfetcher.io/pool=<pool>` naming a pool in its own
namespace (Secrets are read by reference, and references cannot cross namespaces).

What the sidecar gets, and why:
- It is a native sidecar (an init container with restartPolicy Always, Kubernetes 1.29+): it
  is up, socket and all, before the model container starts, and does not keep Jobs alive.
- It reaches a GPU only through the model container's own allocation, never by requesting one
  (a second `nvidia.com/gpu` request would take a second GPU) and never through
  NVIDIA_VISIBLE_DEVICES=all: with DRA it shares the model's resource claims; where the model
  container names its devices in NVIDIA_VISIBLE_DEVICES it gets the same list; with the device
  plugin alone (whose allocation cannot be shared) it gets no GPU, and the pod's
  `kvfetcher.io/gpu-access` annotation says so.
- NVIDIA_DRIVER_CAPABILITIES includes `video`, without which the runtime mounts no NVDEC library.
- The pod's IPC namespace is shared by its containers already; CUDA IPC also needs the peer
  process visible, hence shareProcessNamespace. The Unix socket lives on a shared emptyDir;
  host-memory KV buffers are sealed memfds passed over it (never files), so no /dev/shm volume
  is added: a memfd counts against the pod's memory, not against any volume's size.
- Endpoint, bucket, credentials, token, tenant salt and object key come from Secret references,
  never literals (with `tenancy.saltFrom: PodLabel` the salt is the value of a pod label instead).
- The model fingerprint the sidecar serves is the pool's `spec.model.name`, else the pod's
  `kvfetcher.io/model` annotation: set by whoever makes the pool or the pod, not claimed by the
  model process per request. So is the model's RoPE base (`kvfetcher.io/rope-theta`), without
  which the pool's pre-RoPE presets cannot be stored: the sidecar then stores the others (or the
  q8 variant of the same back end); the pod's `kvfetcher.io/store-presets` says what and why.
- A model container that runs vLLM (`vllm serve ...`, `python -m vllm.entrypoints...`, args-only
  on an image named for vLLM, or the same inside `sh -c "..."`) without its own
  `--kv-transfer-config` gets one naming the kvfetcher connector on the sidecar's socket (its image
  must have `kvfetcher[vllm]`; :mod:`.vllm_args`); the pod annotation
  `kvfetcher.io/vllm-connector: "false"` leaves its arguments alone, and
  `kvfetcher.io/kv-transfer-config` says whether the flag was added, and how or why not.
- Its readiness probe asks whether it serves its socket (`/servingz`), never the store's health:
  a sidecar's readiness is its pod's, and a store outage must not take the model out of its
  Service (the cache is an optimisation; the pool's StorageReady condition reports the store).
- It is Pod Security "restricted" compliant (non-root, no privilege escalation, no
  capabilities, RuntimeDefault seccomp), and the pod gets the sidecar's group as a
  supplemental group, so a non-root model can connect to the socket (mode 0660).

A pod that cannot be injected is let through unchanged but for an annotation saying why: a
missing or not-Ready pool, a pod already using the sidecar's volume names, mount path or port,
a PodLabel pool's pod without the tenant label, or one annotated with another model than the
pool's never blocks a pod, and the webhook never
adds anything the API server would reject.
"""
from __future__ import annotations

import copy
from typing import Any, NamedTuple

from kvfetcher import config as settings
from kvfetcher.config import Setting

from . import builders, conditions, vllm_args
from . import spec as specs

INJECT_LABEL = "kvfetcher.io/inject"
POOL_ANNOTATION = "kvfetcher.io/pool"
MODEL_ANNOTATION = "kvfetcher.io/model"  # the model fingerprint the sidecar serves (absent: any)
INJECTED_ANNOTATION = "kvfetcher.io/injected"
SKIPPED_ANNOTATION = "kvfetcher.io/injection-skipped"
GPU_ANNOTATION = "kvfetcher.io/gpu-access"
VLLM_ANNOTATION = "kvfetcher.io/vllm-connector"  # "false": do not add the connector to a vLLM container
ROPE_THETA_ANNOTATION = "kvfetcher.io/rope-theta"  # the model's RoPE base (absent: no pre-RoPE preset stored)
CONNECTOR_ANNOTATION = "kvfetcher.io/kv-transfer-config"  # whether the connector's flag was added, and how or why not
STORE_ANNOTATION = "kvfetcher.io/store-presets"  # what the sidecar stores, and why if less than the pool's
CONTAINER = "kvfetcher"
SOCKET_VOLUME = "kvfetcher-socket"
CA_VOLUME = "kvfetcher-s3-ca"
SOCKET_DIR = "/run/kvfetcher"
SOCKET = f"{SOCKET_DIR}/kvfetcher.sock"
CA_DIR = "/etc/kvfetcher/s3-ca"
SIDECAR_UID = 10001  # the sidecar image's user and group (Dockerfile.sidecar)
NO_GPU = "void"  # NVIDIA_VISIBLE_DEVICES value for "no device", overriding any image default
READINESS_PATH = "/servingz"  # the sidecar's readiness: its socket takes connections (kvfetcher.api.health)
DEFAULT_RESOURCES = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "8Gi"}}


class Stored(NamedTuple):
    """What one pod's sidecar stores: presets, the model's RoPE base (None: unknown), and the annotation saying so."""
    presets: list[str]
    rope_theta: float | None
    note: str


def _theta(text: str | None) -> float | None:
    try:
        theta = float(text or "")
    except ValueError:
        return None
    return theta if 1 < theta < float("inf") else None


def stored(pool_spec: dict[str, Any], annotations: dict[str, str], gpu: bool = True) -> Stored:
    """The pool's store presets for a pod: pre-RoPE ones only with the model's RoPE base from the
    pod's annotation (a sidecar refuses to start with them otherwise); where that leaves none,
    the q8 variant of the first one's back end (balanced-ans: q8-ans). A sidecar without a GPU
    (``gpu`` false) cannot code ``-ans`` (nvCOMP only): it stores the portable ``-zstd`` variant,
    the same layout and quantisation."""
    wanted = list(dict.fromkeys(specs.store_presets(pool_spec) if gpu else
                                [p.removesuffix("-ans") + "-zstd" if p.endswith("-ans") else p
                                 for p in specs.store_presets(pool_spec)]))
    text = annotations.get(ROPE_THETA_ANNOTATION)
    theta = _theta(text)
    dropped = [p for p in wanted if p in settings.PRE_ROPE_PRESETS]
    if theta is not None or not dropped:
        return Stored(wanted, theta, ",".join(wanted))
    kept = [p for p in wanted if p not in dropped] or ["q8" + wanted[0][len(wanted[0].split("-")[0]):]]
    why = f"{ROPE_THETA_ANNOTATION} {'is not a number above 1' if text else 'is not set'}"
    return Stored(kept, None, f"{','.join(kept)} ({','.join(dropped)} need the model's RoPE base: {why})")


class Decision(NamedTuple):
    """A merge patch for the pod (possibly empty), and what happened: injected, skipped or unchanged."""
    patch: dict[str, Any]
    outcome: str
    reason: str


def _skip(reason: str) -> Decision:
    return Decision({"metadata": {"annotations": {SKIPPED_ANNOTATION: reason}}}, "skipped", reason)


def _unavailable(namespace: str, pool_name: str, why: str) -> Decision:
    """A pool absent, disabled or not Ready: one answer for all three, so that a review (which anyone
    reaching the webhook port can send) cannot tell whether a pool exists; `why` goes to the log only."""
    decision = _skip(f"no Ready KVCachePool {namespace}/{pool_name} with injection enabled")
    return decision._replace(reason=f"{decision.reason} ({why})")


def _secret_env(setting: Setting, secret: str, key: str) -> dict[str, Any]:
    return {"name": setting.name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _value_env(setting: Setting, value: Any) -> dict[str, Any]:
    return {"name": setting.name, "value": str(value)}


def _model_container(containers: list[dict[str, Any]], wanted: str | None) -> dict[str, Any] | None:
    if wanted:
        return next((c for c in containers if c.get("name") == wanted), None)
    def has_gpu(c: dict[str, Any]) -> bool:
        limits = (c.get("resources") or {}).get("limits") or {}
        return any(k.endswith("/gpu") for k in limits) or bool((c.get("resources") or {}).get("claims"))
    return next((c for c in containers if has_gpu(c)), containers[0] if containers else None)


def storage_env(pool: dict[str, Any], keys: tuple[str, str] = ("accessKey", "secretKey")) -> list[dict[str, Any]]:
    """How a container of the pool reaches its store: endpoint, bucket and the pool's scoped
    credentials by Secret reference (managed: the MinIO user under `keys` in the pool's Secret);
    region and TLS settings as values (the CA file mounted at CA_DIR)."""
    spec = specs.with_defaults(pool["spec"])
    secret = builders.secret_name(pool["metadata"]["name"])
    storage = spec["storage"]
    if "managed" in storage:
        access, secret_key = (secret, keys[0]), (secret, keys[1])
    else:
        ref = storage["external"]["credentialsSecretRef"]
        access, secret_key = (ref["name"], ref["accessKeyKey"]), (ref["name"], ref["secretKeyKey"])
    env = [
        _secret_env(settings.S3_ENDPOINT, secret, "endpoint"),
        _secret_env(settings.S3_BUCKET, secret, "bucket"),
        _secret_env(settings.S3_ACCESS_KEY, *access),
        _secret_env(settings.S3_SECRET_KEY, *secret_key),
    ]
    external = storage.get("external") or {}
    if external.get("region"):
        env.append(_value_env(settings.S3_REGION, external["region"]))
    tls = external.get("tls") or {}
    if tls.get("caSecretRef"):
        env.append(_value_env(settings.S3_CA_FILE, f"{CA_DIR}/{tls['caSecretRef']['key']}"))
    if tls.get("insecureSkipVerify"):
        env.append(_value_env(settings.S3_INSECURE, "true"))
    return env


def ca_volume(pool: dict[str, Any]) -> dict[str, Any] | None:
    """The volume of an external store's CA bundle (mounted at CA_DIR), if the pool names one."""
    spec = specs.with_defaults(pool["spec"])
    ca = ((spec["storage"].get("external") or {}).get("tls") or {}).get("caSecretRef")
    if not ca:
        return None
    return {"name": CA_VOLUME, "secret": {"secretName": ca["name"], "items": [{"key": ca["key"], "path": ca["key"]}]}}


def sidecar_env(pool: dict[str, Any], store: Stored) -> list[dict[str, Any]]:
    """The sidecar's environment: everything secret by reference, the codec settings as values.
    Every variable is a setting of the sidecar's table in :mod:`kvfetcher.config` that is marked
    injected (and the NVIDIA runtime's)."""
    spec = specs.with_defaults(pool["spec"])
    secret = builders.secret_name(pool["metadata"]["name"])
    codec = spec["codec"]
    env = storage_env(pool) + [
        _secret_env(settings.AUTH_TOKEN, secret, "authToken"),
        _secret_env(settings.OBJECT_KEY, secret, "objectKey"),
        {"name": settings.ACCEPTED_OBJECT_KEYS.name,  # a key rotation's previous keys (docs/security.md); optional
         "valueFrom": {"secretKeyRef": {"name": secret, "key": "acceptedObjectKeys", "optional": True}}},
        _value_env(settings.MODEL, spec["model"]["name"]) if "model" in spec else
        {"name": settings.MODEL.name, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{MODEL_ANNOTATION}']"}}},
    ]
    tenancy = spec["tenancy"]
    if tenancy["saltFrom"] == "Pool":
        env.append(_secret_env(settings.TENANT, secret, "tenantSalt"))
    elif tenancy["saltFrom"] == "Secret":
        env.append(_secret_env(settings.TENANT, tenancy["secretRef"]["name"], tenancy["secretRef"]["key"]))
    else:
        label = tenancy["labelKey"]
        env.append({"name": settings.TENANT.name,
                    "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}})
    env += [
        _value_env(settings.POOL, pool["metadata"]["name"]),
        _value_env(settings.PRESET, ",".join(store.presets)),
        _value_env(settings.ALLOWED_PRESETS, ",".join(codec["allowedPresets"])),
        _value_env(settings.CHUNK_TOKENS, codec["chunkTokens"]),
    ]
    if store.rope_theta is not None:
        env.append(_value_env(settings.ROPE_THETA, store.rope_theta))
    if "decodeProcesses" in spec["sidecar"]:
        env.append(_value_env(settings.DECODE_PROCS, spec["sidecar"]["decodeProcesses"]))
    if "ttftBudgetSeconds" in spec["sidecar"]:
        env.append(_value_env(settings.TTFT_BUDGET_S, spec["sidecar"]["ttftBudgetSeconds"]))
    env.append({"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility,video"})
    return env


def gpu_access(model: dict[str, Any] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """How the sidecar reaches the model's GPU: (resource claims, env, what the pod's annotation says)."""
    claims = ((model or {}).get("resources") or {}).get("claims")
    if claims:
        return copy.deepcopy(claims), [], "shares the model container's resource claims"
    listed = next((e.get("value") for e in (model or {}).get("env") or []
                   if e.get("name") == "NVIDIA_VISIBLE_DEVICES" and "valueFrom" not in e), None)
    if listed and listed.strip().lower() not in ("all", "none", "void", ""):
        return [], [{"name": "NVIDIA_VISIBLE_DEVICES", "value": listed}], f"the model's devices {listed}"
    return [], [{"name": "NVIDIA_VISIBLE_DEVICES", "value": NO_GPU}], (
        "none: a device-plugin GPU cannot be shared; give the model a resource claim (DRA) "
        "or an NVIDIA_VISIBLE_DEVICES device list to decode on its GPU")


def _has_gpu(model: dict[str, Any] | None) -> bool:
    """Whether the sidecar gets a GPU (:func:`gpu_access`)."""
    return not any(e.get("value") == NO_GPU for e in gpu_access(model)[1])


SECURITY_CONTEXT = {
    "runAsNonRoot": True, "runAsUser": SIDECAR_UID, "runAsGroup": SIDECAR_UID,
    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def sidecar_container(pool: dict[str, Any], model: dict[str, Any] | None,
                      annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """The sidecar for a pod of `model` with `annotations` (the model's RoPE base among them)."""
    spec = specs.with_defaults(pool["spec"])
    side = spec["sidecar"]
    port = side["port"]
    resources = copy.deepcopy(side.get("resources") or DEFAULT_RESOURCES)
    for part in ("requests", "limits"):  # a GPU request here would allocate a second GPU
        if part in resources:
            resources[part] = {k: v for k, v in resources[part].items() if not k.endswith("/gpu")}
    claims, gpu_env, _ = gpu_access(model)
    env = sidecar_env(pool, stored(spec, annotations or {}, _has_gpu(model))) + gpu_env
    if claims:
        resources["claims"] = claims
    mounts = [{"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR}]
    if ca_volume(pool):
        mounts.append({"name": CA_VOLUME, "mountPath": CA_DIR, "readOnly": True})
    return {
        "name": CONTAINER,
        "image": side["image"],
        "imagePullPolicy": side["imagePullPolicy"],
        "restartPolicy": "Always",
        "args": ["serve", "--port", str(port), "--socket", SOCKET],
        "ports": [{"name": "kvfetcher", "containerPort": port, "protocol": "TCP"}],
        "env": env,
        "resources": resources,
        "volumeMounts": mounts,
        "startupProbe": {"httpGet": {"path": "/healthz", "port": port}, "periodSeconds": 2, "failureThreshold": 60},
        # the socket served, never the store's health: a store outage must not take the model out of its Service
        "readinessProbe": {"httpGet": {"path": READINESS_PATH, "port": port}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": port}, "periodSeconds": 10},
        "securityContext": copy.deepcopy(SECURITY_CONTEXT),
    }


def mutate(pod: dict[str, Any], pool: dict[str, Any] | None) -> Decision:
    """The merge patch that injects `pool`'s sidecar into `pod` (pool None: not found in the pod's namespace)."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    spec = pod.get("spec") or {}
    containers = spec.get("containers") or []
    inits = spec.get("initContainers") or []
    if any(c.get("name") == CONTAINER for c in containers + inits):
        return Decision({}, "unchanged", "already injected")
    if spec.get("hostNetwork") or (spec.get("os") or {}).get("name") == "windows":
        return _skip("a hostNetwork pod (the sidecar's port would be the node's) or a Windows pod is not injected")
    pool_name = annotations.get(POOL_ANNOTATION)
    if not pool_name:
        return _skip(f"no {POOL_ANNOTATION} annotation names a KVCachePool")
    namespace = meta.get("namespace") or "default"
    if pool is None:
        return _unavailable(namespace, pool_name, "not found")
    pool_spec = specs.with_defaults(pool.get("spec") or {})
    if not pool_spec["injection"]["enabled"]:
        return _unavailable(namespace, pool_name, "injection disabled")
    status = pool.get("status") or {}
    if not conditions.is_true(status.get("conditions"), conditions.READY):
        return _unavailable(namespace, pool_name, f"not Ready (phase {status.get('phase', 'Pending')})")
    if not conditions.is_current(status.get("conditions"), conditions.READY, (pool.get("metadata") or {}).get("generation")):
        return _unavailable(namespace, pool_name, "Ready for an older spec (the reconciler has not validated this one)")
    if (served := (pool_spec.get("model") or {}).get("name")) and annotations.get(MODEL_ANNOTATION, served) != served:
        return _skip(f"the pod's {MODEL_ANNOTATION} is not {served}, the model KVCachePool {namespace}/{pool_name} serves")
    model = _model_container(containers, pool_spec["injection"].get("modelContainer"))
    if model is None:
        wanted = pool_spec["injection"].get("modelContainer")
        return _skip(f"model container {wanted!r} not found in the pod")
    clash = collisions(spec, model, pool_spec["sidecar"]["port"])
    if clash:
        return _skip(f"the pod already uses the sidecar's {clash}")
    label = pool_spec["tenancy"].get("labelKey")
    if pool_spec["tenancy"]["saltFrom"] == "PodLabel" and not (meta.get("labels") or {}).get(label):
        return _skip(f"KVCachePool {namespace}/{pool_name} takes the tenant from the pod label {label}, "
                     f"which the pod lacks")
    connected = vllm_connection(model, annotations)
    patch = {
        "metadata": {"annotations": {INJECTED_ANNOTATION: pool_name, GPU_ANNOTATION: gpu_access(model)[2],
                                     STORE_ANNOTATION: stored(pool_spec, annotations, _has_gpu(model)).note,
                                     CONNECTOR_ANNOTATION: connected.note}},
        "spec": _spec_patch(spec, pool, annotations, model, connected),
    }
    if SKIPPED_ANNOTATION in annotations:  # a JSON patch may not remove what is absent
        patch["metadata"]["annotations"][SKIPPED_ANNOTATION] = None
    return Decision(patch, "injected", f"sidecar of KVCachePool {namespace}/{pool_name} injected")


def collisions(spec: dict[str, Any], model: dict[str, Any], port: int) -> str | None:
    """What of the sidecar's the pod already uses (volume name, mount path, port), or None."""
    ours = {SOCKET_VOLUME, CA_VOLUME}
    taken = sorted(ours & {v.get("name") for v in spec.get("volumes") or []})
    if taken:
        return f"volume name {taken[0]}"
    if any(m.get("mountPath", "").rstrip("/") == SOCKET_DIR for m in model.get("volumeMounts") or []):
        return f"mount path {SOCKET_DIR}"
    containers = (spec.get("containers") or []) + (spec.get("initContainers") or [])
    if any(p.get("containerPort") == port for c in containers for p in c.get("ports") or []):
        return f"port {port}"
    return None


def vllm_connection(model: dict[str, Any], annotations: dict[str, str]) -> vllm_args.Connected:
    """What the model container gets to use the kvfetcher connector (:mod:`.vllm_args`), unless
    the pod's annotation opts out; either way, the line for its annotation."""
    if annotations.get(VLLM_ANNOTATION, "").lower() == "false":
        return vllm_args.Connected({}, f"not added: the pod's {VLLM_ANNOTATION} is false")
    return vllm_args.connect(model, SOCKET)


def _spec_patch(spec: dict[str, Any], pool: dict[str, Any], annotations: dict[str, str],
                model: dict[str, Any], connected: vllm_args.Connected) -> dict[str, Any]:
    new_containers = copy.deepcopy(spec.get("containers") or [])
    for c in new_containers:
        if c.get("name") == model.get("name"):
            c.setdefault("volumeMounts", []).append({"name": SOCKET_VOLUME, "mountPath": SOCKET_DIR})
            c.setdefault("env", []).append(_value_env(settings.SOCKET, SOCKET))
            c.update(connected.changes)
    volumes = copy.deepcopy(spec.get("volumes") or [])
    volumes.append({"name": SOCKET_VOLUME, "emptyDir": {}})
    if ca_volume(pool):
        volumes.append(ca_volume(pool))
    groups = list((spec.get("securityContext") or {}).get("supplementalGroups") or [])
    return {
        "initContainers": [sidecar_container(pool, model, annotations)]
                          + copy.deepcopy(spec.get("initContainers") or []),
        "containers": new_containers,
        "volumes": volumes,
        "shareProcessNamespace": True,
        # The socket's group is the sidecar's: the model container joins it to connect.
        "securityContext": {"supplementalGroups": groups + [SIDECAR_UID] * (SIDECAR_UID not in groups)},
    }


def webhook_readiness(config: dict[str, Any] | None, name: str, path: str) -> tuple[bool, str, str]:
    """Whether the MutatingWebhookConfiguration `name` sends pods to this operator's `path` with a CA to trust."""
    if config is None:
        return False, "WebhookConfigurationMissing", f"MutatingWebhookConfiguration {name} not found"
    hooks = [h for h in config.get("webhooks") or []
             if ((h.get("clientConfig") or {}).get("service") or {}).get("path") == path]
    if not hooks:
        return False, "WebhookMisrouted", f"MutatingWebhookConfiguration {name} has no webhook for {path}"
    if not all((h.get("clientConfig") or {}).get("caBundle") for h in hooks):
        return False, "WebhookCANotInjected", f"MutatingWebhookConfiguration {name} has no caBundle yet"
    return True, "WebhookConfigured", (f"pods labelled {INJECT_LABEL}=true and annotated {POOL_ANNOTATION}=<pool> "
                                       f"are sent to the webhook by {name}")


def apply_merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386 merge patch (lists replaced, None deletes): what the API server makes of `mutate`'s patch."""
    out = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict):
            out[key] = apply_merge_patch(out.get(key) if isinstance(out.get(key), dict) else {}, value)
        else:
            out[key] = copy.deepcopy(value)
    return out
