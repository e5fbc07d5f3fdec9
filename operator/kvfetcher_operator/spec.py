"""Defaulting and validation of a KVCachePool spec, as pure functions.

The CRD's structural schema and CEL rules reject most bad specs at the API server. The
operator checks again because not every API server enforces them (CEL needs 1.25+, and a
pool may predate a schema change) and because a rejected pool must still say why in its
status (ConfigValid=False) rather than fail somewhere deeper. A test keeps DEFAULTS equal
to the CRD's own defaults.
"""
from __future__ import annotations

import copy
import re
from decimal import Decimal
from typing import Any

from kvfetcher import config as settings

GROUP = "kvfetcher.io"
VERSION = "v1alpha1"
PLURAL = "kvcachepools"
KIND = "KVCachePool"

PRESETS = settings.PRESET_NAMES
# codec.defaultPreset (deprecated for storePresets): one preset to store, or "auto" for the default
DEFAULT_PRESETS = ("auto", "raw", "exact", "q8")
# codec.storePresets when unset: the first of these that allowedPresets allows
STORE_DEFAULTS = ("balanced-ans", "q8")

DEFAULTS: dict[str, Any] = {
    "codec": {"allowedPresets": list(PRESETS), "chunkTokens": 256},
    "injection": {"enabled": True},
    "sidecar": {  # its image: the operator's KVFETCHER_SIDECAR_IMAGE (with_defaults), not the CRD's
        "imagePullPolicy": "IfNotPresent",
        "port": 8500,
    },
    "retention": {"ttlDays": 7, "evictIntervalSeconds": 60, "dataPolicy": "Retain"},
    "tenancy": {"saltFrom": "Pool"},
}
MANAGED_DEFAULTS: dict[str, Any] = {
    "replicas": 1,
    "size": "50Gi",  # its image: the operator's KVFETCHER_MINIO_IMAGE (with_defaults)
    "bucket": "kvcache",
}
SECRET_REF_DEFAULTS = {
    "credentialsSecretRef": {"accessKeyKey": "accessKey", "secretKeyKey": "secretKey"},
}

# Kubernetes' quantity grammar (resource.Quantity): a signed decimal, then a binary or decimal SI
# suffix or a decimal exponent; the CRD carries the same patterns.
QUANTITY_PATTERN = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
# A label key: an optional DNS-subdomain prefix and a name of up to 63 characters.
LABEL_KEY_PATTERN = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
# S3 bucket naming rules: 3-63 of [a-z0-9.-], alphanumeric ends, no "..", ".-" or "-.", not an
# IPv4 address, none of the reserved prefixes and suffixes.
BUCKET_PATTERN = r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"
BUCKET_FORBIDDEN = r"(\.\.|\.-|-\.|^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$|^xn--|^sthree-|^amzn-s3-demo-|-s3alias$|--ol-s3$|--x-s3$)"
# http(s)://host[:port][/]: no user info, path, query or fragment.
ENDPOINT_PATTERN = r"^https?://([A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?/?$"
# What a Service name (a DNS-1035 label) allows: a managed pool's MinIO Services derive from the pool's name.
DNS_LABEL_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# A Secret's or a claim's name (a DNS-1123 subdomain, up to 253 characters) and a Secret's key
# (no leading dot, so never `.` or `..`): names from the spec go into API paths and keys into file
# paths, so nothing else may pass (no `/`, no `..`). The CRD carries the same patterns.
OBJECT_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY_PATTERN = r"^[-_a-zA-Z0-9][-._a-zA-Z0-9]*$"
# Where the spec names an object of the pool's namespace: (path, name field, Secret key fields)
REFERENCES = (
    ("storage.external.credentialsSecretRef", "name", ("accessKeyKey", "secretKeyKey")),
    ("storage.external.tls.caSecretRef", "name", ("key",)),
    ("tenancy.secretRef", "name", ("key",)),
    ("model.calibration.source.persistentVolumeClaim", "claimName", ()),
)
RESOURCE_PARTS = ("requests", "limits")
# What a container may request: the standard resources, huge pages of a size, or an extended
# resource named with a domain (not kubernetes.io's).
RESOURCE_NAME_PATTERN = (r"^(cpu|memory|ephemeral-storage|hugepages-[0-9]+[KMGTPE]i?|"
                         r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$")
# A model fingerprint as the sidecar serves it: its tag (up to the first `/`, no `/` in it: the
# store files calibrations under it), then anything a model name carries.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][-A-Za-z0-9_.:]*(/[-A-Za-z0-9_.:/]*)?$"
# A path inside a volume: relative, no `..` step.
VOLUME_PATH_PATTERN = r"^[^/]"
VOLUME_PATH_ESCAPE = r"(^|/)\.\.(/|$)"
MODEL_SOURCES = ("persistentVolumeClaim", "image")

_QUANTITY = re.compile(QUANTITY_PATTERN)
_BUCKET, _BUCKET_FORBIDDEN = re.compile(BUCKET_PATTERN), re.compile(BUCKET_FORBIDDEN)
_ENDPOINT = re.compile(ENDPOINT_PATTERN)
_LABEL_KEY = re.compile(LABEL_KEY_PATTERN)
_MODEL_NAME = re.compile(MODEL_NAME_PATTERN)
_OBJECT_NAME, _SECRET_KEY = re.compile(OBJECT_NAME_PATTERN), re.compile(SECRET_KEY_PATTERN)
_RESOURCE_NAME = re.compile(RESOURCE_NAME_PATTERN)
_UNITS = {"": 1, "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": 10**3, "M": 10**6,
          "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def _merge(defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(defaults)
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def with_defaults(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec with every default the CRD declares filled in, and the images the operator is
    configured with (KVFETCHER_SIDECAR_IMAGE, KVFETCHER_MINIO_IMAGE: the chart's, a registry
    mirror's) where it names none (the input is not changed)."""
    out = _merge(DEFAULTS, spec or {})
    if isinstance(out.get("sidecar"), dict):
        out["sidecar"].setdefault("image", settings.SIDECAR_IMAGE.read())
    storage = out.setdefault("storage", {})
    if isinstance(storage.get("managed"), dict):
        storage["managed"] = _merge(MANAGED_DEFAULTS, storage["managed"])
        storage["managed"].setdefault("image", settings.MINIO_IMAGE.read())
    if isinstance(storage.get("external"), dict):
        external = _merge(SECRET_REF_DEFAULTS, storage["external"])
        tls = external.get("tls")
        if isinstance(tls, dict):
            tls.setdefault("insecureSkipVerify", False)
            if isinstance(tls.get("caSecretRef"), dict):
                tls["caSecretRef"].setdefault("key", "ca.crt")
        storage["external"] = external
    tenancy = out["tenancy"]
    if isinstance(tenancy.get("secretRef"), dict):
        tenancy["secretRef"].setdefault("key", "salt")
    return out


def store_presets(spec: dict[str, Any]) -> list[str]:
    """What every new prefix is stored in: codec.storePresets; unset, the deprecated defaultPreset
    when it names one, else the first of STORE_DEFAULTS that allowedPresets allows (empty: none is)."""
    codec = with_defaults(spec)["codec"]
    if "storePresets" in codec:
        return list(codec["storePresets"])
    if codec.get("defaultPreset", "auto") != "auto":
        return [codec["defaultPreset"]]
    return [p for p in STORE_DEFAULTS if p in codec["allowedPresets"]][:1]


def _codec_problems(spec: dict[str, Any]) -> list[str]:
    codec, out = spec["codec"], []
    allowed = codec["allowedPresets"]
    if not isinstance(allowed, list) or not allowed or any(p not in PRESETS for p in allowed):
        return [f"codec.allowedPresets: must be a non-empty subset of {list(PRESETS)}"]
    given = codec.get("storePresets")
    if given is not None:
        if not isinstance(given, list) or not given or len(set(map(str, given))) < len(given):
            out.append("codec.storePresets: must be a non-empty list of distinct presets")
        elif any(p not in PRESETS for p in given):
            out.append(f"codec.storePresets: {[p for p in given if p not in PRESETS]} are not presets; "
                       f"known: {list(PRESETS)}")
        elif any(p not in allowed for p in given):
            out.append(f"codec.storePresets: {[p for p in given if p not in allowed]} are not in "
                       f"codec.allowedPresets (what no fetch may choose is not worth storing)")
    preset = codec.get("defaultPreset", "auto")
    if preset not in DEFAULT_PRESETS:
        out.append(f"codec.defaultPreset: {preset!r} is not one of {list(DEFAULT_PRESETS)}")
    elif preset != "auto" and preset not in allowed:
        out.append("codec.defaultPreset must be auto or one of codec.allowedPresets")
    elif not out and not store_presets(spec):
        out.append(f"set codec.storePresets: its defaults, {' and '.join(STORE_DEFAULTS)}, are not in "
                   f"codec.allowedPresets")
    chunk = codec["chunkTokens"]
    if not isinstance(chunk, int) or not 16 <= chunk <= 8192 or chunk % 16:
        out.append("codec.chunkTokens: must be a multiple of 16 between 16 and 8192")
    return out


def quantity_value(text: str) -> Decimal:
    """A Kubernetes quantity such as '50Gi', '1e3' or '500m' as a number."""
    match = _QUANTITY.match(str(text))
    if not match:
        raise ValueError(f"not a quantity: {text!r}")
    suffix = match.group(3) or ""
    number = Decimal(str(text)[: len(str(text)) - len(suffix)])
    if suffix in _UNITS:
        return number * _UNITS[suffix]
    return number * Decimal(10) ** int(suffix[1:])  # a decimal exponent such as e3


def quantity_bytes(text: str) -> int:
    """A Kubernetes quantity in whole bytes (rounded up, as Kubernetes rounds a byte quantity)."""
    value = quantity_value(text)
    return int(value.to_integral_value(rounding="ROUND_CEILING"))


def _size_problem(path: str, value: Any) -> list[str]:
    try:
        ok = quantity_bytes(str(value)) >= 1
    except ValueError:
        ok = False
    return [] if ok else [f"{path}: {value!r} is not a size above zero such as 50Gi"]


def bucket_problem(path: str, name: Any) -> list[str]:
    ok = isinstance(name, str) and _BUCKET.match(name) and not _BUCKET_FORBIDDEN.search(name)
    return [] if ok else [f"{path}: {name!r} is not a valid S3 bucket name"]


def resources_problems(path: str, resources: Any) -> list[str]:
    """A container's resources as a pod spec takes them: requests and limits of valid quantities,
    of resource names a container may request (RESOURCE_NAME_PATTERN), no request above its limit."""
    if resources is None:
        return []
    if not isinstance(resources, dict) or set(resources) - set(RESOURCE_PARTS):
        return [f"{path}: only requests and limits may be set"]
    out = []
    for part in RESOURCE_PARTS:
        given = resources.get(part) or {}
        if not isinstance(given, dict):
            out.append(f"{path}.{part}: must map resource names to quantities")
            continue
        for name, value in given.items():
            if isinstance(value, bool) or not _QUANTITY.fullmatch(str(value)) or str(value).startswith("-"):
                out.append(f"{path}.{part}.{name}: {value!r} is not a quantity")
            elif not _RESOURCE_NAME.fullmatch(str(name)) or str(name).split("/")[0].endswith("kubernetes.io"):
                out.append(f"{path}.{part}.{name}: not a resource a container may request (cpu, memory, "
                           f"ephemeral-storage, hugepages-<size>, or a domain-qualified extended resource)")
    return out or _requests_within_limits(path, resources)


def _requests_within_limits(path: str, resources: dict[str, Any]) -> list[str]:
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    return [f"{path}.requests.{name}: {value} is above its limit {limits[name]}" for name, value in requests.items()
            if name in limits and quantity_value(str(value)) > quantity_value(str(limits[name]))]


def object_name_problem(path: str, name: Any) -> list[str]:
    ok = isinstance(name, str) and len(name) <= 253 and _OBJECT_NAME.fullmatch(name)
    return [] if ok else [f"{path}: {name!r} is not an object name (lowercase letters, digits, '-' and '.', "
                          f"up to 253 characters)"]


def _at(spec: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        spec = spec.get(part) if isinstance(spec, dict) else None
    return spec


def reference_problems(spec: dict[str, Any]) -> list[str]:
    """Every object name and Secret key the (defaulted) spec names that is not one (REFERENCES)."""
    out = []
    for path, name_field, key_fields in REFERENCES:
        ref = _at(spec, path)
        if not isinstance(ref, dict):
            continue
        if name_field in ref:
            out += object_name_problem(f"{path}.{name_field}", ref[name_field])
        for field in key_fields:
            key = ref.get(field)
            if not (isinstance(key, str) and len(key) <= 253 and _SECRET_KEY.fullmatch(key)):
                out.append(f"{path}.{field}: {key!r} is not a Secret key (letters, digits, '-', '_' and '.', "
                           f"not first)")
    return out


def _model_problems(model: Any) -> list[str]:
    if not isinstance(model, dict) or not _MODEL_NAME.match(str(model.get("name", ""))) or len(model["name"]) > 253:
        return ["model.name: a model fingerprint (up to 253 characters; its tag, up to the first '/', "
                "of letters, digits and -_.:) is required"]
    calibration = model.get("calibration")
    if calibration is None:
        return []
    source = (calibration or {}).get("source") or {}
    given = [k for k in MODEL_SOURCES if k in source]
    if len(given) != 1:
        return ["model.calibration.source: set exactly one of persistentVolumeClaim or image"]
    volume, out = source[given[0]] or {}, []
    if not volume.get("claimName" if given[0] == "persistentVolumeClaim" else "reference"):
        out.append(f"model.calibration.source.{given[0]}: name the "
                   f"{'claim (claimName)' if given[0] == 'persistentVolumeClaim' else 'image (reference)'}")
    path = str(volume.get("path", ""))
    if not re.match(VOLUME_PATH_PATTERN, path) or re.search(VOLUME_PATH_ESCAPE, path):
        out.append(f"model.calibration.source.{given[0]}.path: the model's path inside the volume "
                   f"(relative, no '..'), not {path!r}")
    return out + resources_problems("model.calibration.job.resources", (calibration.get("job") or {}).get("resources"))


def problems(spec: dict[str, Any]) -> list[str]:
    """Every reason the (defaulted) spec is unusable; empty when it is valid."""
    spec = with_defaults(spec)
    out: list[str] = []
    storage = spec.get("storage") or {}
    managed, external = storage.get("managed"), storage.get("external")
    if (managed is None) == (external is None):
        out.append("set exactly one of storage.managed or storage.external")
    if isinstance(managed, dict):
        replicas = managed["replicas"]
        if not isinstance(replicas, int) or not (replicas == 1 or 4 <= replicas <= 32):
            out.append("storage.managed.replicas: MinIO runs standalone (1) or distributed (4 to 32)")
        out += _size_problem("storage.managed.size", managed["size"])
        out += bucket_problem("storage.managed.bucket", managed["bucket"])
        out += resources_problems("storage.managed.resources", managed.get("resources"))
    if isinstance(external, dict):
        if not _ENDPOINT.match(str(external.get("endpoint", ""))):
            out.append("storage.external.endpoint: must be an http(s)://host[:port] URL (no user, path or query)")
        out += bucket_problem("storage.external.bucket", external.get("bucket"))
        if not (external.get("credentialsSecretRef") or {}).get("name"):
            out.append("storage.external.credentialsSecretRef.name is required")
        tls = external.get("tls")
        if tls is not None:
            if not str(external.get("endpoint", "")).startswith("https://"):
                out.append("storage.external.tls needs an https:// endpoint")
            if tls.get("caSecretRef") and tls.get("insecureSkipVerify"):
                out.append("storage.external.tls: caSecretRef and insecureSkipVerify exclude each other")

    out += reference_problems(spec)
    out += _codec_problems(spec)

    port = spec["sidecar"]["port"]
    if not isinstance(port, int) or not 1024 <= port <= 65535:
        out.append("sidecar.port: must be between 1024 and 65535")
    procs = spec["sidecar"].get("decodeProcesses", 0)
    if not isinstance(procs, int) or not 0 <= procs <= 32:
        out.append("sidecar.decodeProcesses: must be between 0 and 32")
    budget = spec["sidecar"].get("ttftBudgetSeconds", 1)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 600:
        out.append("sidecar.ttftBudgetSeconds: must be a number of seconds above 0 and at most 600")

    out += resources_problems("sidecar.resources", spec["sidecar"].get("resources"))
    if "model" in spec:
        out += _model_problems(spec["model"])

    retention = spec["retention"]
    if not isinstance(retention["ttlDays"], int) or not 1 <= retention["ttlDays"] <= 3650:
        out.append("retention.ttlDays: must be between 1 and 3650")
    interval = retention["evictIntervalSeconds"]
    if isinstance(interval, bool) or not isinstance(interval, int) or not 10 <= interval <= 86400:
        out.append("retention.evictIntervalSeconds: must be between 10 and 86400")
    if "maxSize" in retention:
        out += _size_problem("retention.maxSize", retention["maxSize"])
    if retention["dataPolicy"] not in ("Retain", "Delete"):
        out.append("retention.dataPolicy: must be Retain or Delete")

    tenancy = spec["tenancy"]
    if tenancy["saltFrom"] not in ("Pool", "PodLabel", "Secret"):
        out.append("tenancy.saltFrom: must be Pool, PodLabel or Secret")
    if tenancy["saltFrom"] == "PodLabel" and not tenancy.get("labelKey"):
        out.append("tenancy.labelKey is required when saltFrom is PodLabel")
    if "labelKey" in tenancy and not _LABEL_KEY.match(str(tenancy["labelKey"])):
        out.append(f"tenancy.labelKey: {tenancy['labelKey']!r} is not a label key")
    if tenancy["saltFrom"] == "Secret" and not tenancy.get("secretRef"):
        out.append("tenancy.secretRef is required when saltFrom is Secret")
    return out
