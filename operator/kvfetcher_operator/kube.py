"""A small generic Kubernetes REST client: get, create, patch and apply plain dict manifests.

The builders speak dicts, so this goes straight to the REST paths over urllib3 rather than
through the official client's typed models (whose calling conventions change between major
versions). The official client is used for what it is stable at: reading in-cluster or
kubeconfig credentials.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any
from urllib.parse import quote, urlencode

import kopf
import kubernetes
import urllib3

PLURALS = {"Secret": "secrets", "Service": "services", "StatefulSet": "statefulsets", "Deployment": "deployments",
           "PodDisruptionBudget": "poddisruptionbudgets", "NetworkPolicy": "networkpolicies", "Job": "jobs"}
MERGE = "application/merge-patch+json"
# Set on a child an owner let go of (data kept); only a new owner of the same kind and name takes it back.
RELEASED_ANNOTATION = "kvfetcher.io/released-from"


_OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _segment(name: str) -> str:
    """``name`` as one path segment, if it is an object name; else ``ValueError``."""
    if not isinstance(name, str) or len(name) > 253 or not _OBJECT_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a Kubernetes object name")
    return quote(name, safe="")


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status


class NameConflict(Exception):
    """An object of the wanted name exists and belongs to someone else: it is left alone."""


def controller(obj: dict[str, Any] | None) -> dict[str, Any] | None:
    """The controller ownerReference of an object, if any."""
    refs = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
    return next((r for r in refs if r.get("controller")), None)


def released_mark(owner: dict[str, Any]) -> str:
    return f"{owner['kind']}/{owner['name']}"


def may_take(current: dict[str, Any], owner: dict[str, Any]) -> bool:
    """Whether `owner` may bring `current` to its spec: it controls it, or it was released to its name."""
    held = controller(current)
    if held is not None:
        return held.get("uid") == owner["uid"]
    annotations = (current.get("metadata") or {}).get("annotations") or {}
    return annotations.get(RELEASED_ANNOTATION) == released_mark(owner)


class Kube:
    def __init__(self, configuration: kubernetes.client.Configuration) -> None:
        self.cfg = configuration
        self.http = urllib3.PoolManager(
            cert_reqs="CERT_REQUIRED" if configuration.verify_ssl else "CERT_NONE",
            ca_certs=configuration.ssl_ca_cert, cert_file=configuration.cert_file,
            key_file=configuration.key_file, timeout=urllib3.Timeout(connect=5.0, read=30.0),
            retries=urllib3.Retry(total=2, backoff_factor=0.2, allowed_methods=None, status_forcelist=()),
        )

    @classmethod
    def from_environment(cls) -> "Kube":
        configuration = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        except kubernetes.config.ConfigException:
            # The client reads $KUBECONFIG once, at import; read it now.
            kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"),
                                               client_configuration=configuration)
        return cls(configuration)

    def _authorization(self) -> str | None:
        # Calls the refresh hook first, so rotating in-cluster tokens are re-read.
        return self.cfg.get_api_key_with_prefix("authorization") or None

    def connection_info(self) -> kopf.ConnectionInfo:
        """The same credentials for kopf's own watches, so that both clients log in one way."""
        scheme, _, token = (self._authorization() or "").partition(" ")
        return kopf.ConnectionInfo(
            server=self.cfg.host, ca_path=self.cfg.ssl_ca_cert, insecure=not self.cfg.verify_ssl,
            scheme=scheme if token else None, token=token or None,
            certificate_path=self.cfg.cert_file, private_key_path=self.cfg.key_file,
        )

    @staticmethod
    def path(api_version: str, plural: str, namespace: str | None, name: str | None = None) -> str:
        """The REST path; namespace None for cluster-scoped resources. ``ValueError`` for a namespace
        or name that is not an object name (DNS-1123 subdomain): no name can change the path."""
        root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        scope = f"/namespaces/{_segment(namespace)}" if namespace else ""
        return f"{root}{scope}/{plural}" + (f"/{_segment(name)}" if name is not None else "")

    def _call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        auth = self._authorization()
        if auth:
            headers["Authorization"] = auth
        data = None if body is None else json.dumps(body).encode()
        response = self.http.request(method, self.cfg.host.rstrip("/") + path, body=data, headers=headers)
        text = response.data.decode()
        if response.status >= 300:
            raise ApiError(response.status, text)
        return json.loads(text) if text else None

    def get(self, api_version: str, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", self.path(api_version, plural, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list(self, api_version: str, plural: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        query = "?" + urlencode({"labelSelector": label_selector})
        return (self._call("GET", self.path(api_version, plural, namespace) + query) or {}).get("items") or []

    def patch(self, api_version: str, plural: str, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("PATCH", self.path(api_version, plural, namespace, name), body, MERGE)

    def apply(self, obj: dict[str, Any], mutable_spec: tuple[str, ...] | None = None) -> dict[str, Any]:
        """Create `obj`, or bring an existing one to it with a merge patch.

        Only an existing object that `obj`'s controller owns (or that was released to it) is
        patched; any other raises NameConflict and is left as it is. `mutable_spec` names the
        only spec fields an update may touch (a StatefulSet's volumeClaimTemplates, for one,
        are immutable).
        """
        meta = obj["metadata"]
        plural = PLURALS[obj["kind"]]
        try:
            return self._call("POST", self.path(obj["apiVersion"], plural, meta["namespace"]), obj)
        except ApiError as e:
            if e.status != 409:
                raise
        current = self.get(obj["apiVersion"], plural, meta["namespace"], meta["name"]) or {}
        owner = controller(obj)
        if owner is None or not may_take(current, owner):
            raise NameConflict(f"{obj['kind']} {meta['namespace']}/{meta['name']} exists and is not this "
                               f"{owner['kind'] if owner else 'owner'}'s: rename or remove it")
        update = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata", "spec")}
        update["metadata"] = {"labels": meta.get("labels"), "ownerReferences": meta.get("ownerReferences"),
                              "annotations": {RELEASED_ANNOTATION: None}}
        if "spec" in obj:
            update["spec"] = {k: v for k, v in obj["spec"].items() if mutable_spec is None or k in mutable_spec}
        return self.patch(obj["apiVersion"], plural, meta["namespace"], meta["name"], update)
