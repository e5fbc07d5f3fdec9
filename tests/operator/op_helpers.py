"""Helpers shared by the operator tests (a module, not fixtures, so tests can import them)."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import aiohttp
import kmock as kmocklib

from kvfetcher_operator import conditions

POOLS = "kvfetcher.io/v1alpha1/kvcachepools"


def declare_resources(kmock: kmocklib.KubernetesEmulator) -> None:
    kmock.resources[POOLS] = kmocklib.ResourceInfo(
        kind="KVCachePool", singular="kvcachepool", namespaced=True, shortnames={"kvp"},
        verbs={"list", "watch", "get", "create", "patch", "update", "delete"}, subresources={"status"})
    for res, kind in [("v1/pods", "Pod"), ("v1/secrets", "Secret"), ("v1/services", "Service"),
                      ("v1/events", "Event"), ("apps/v1/statefulsets", "StatefulSet"),
                      ("apps/v1/deployments", "Deployment"),
                      ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget"),
                      ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy"), ("batch/v1/jobs", "Job"),
                      ("v1/persistentvolumeclaims", "PersistentVolumeClaim")]:
        kmock.resources[res] = kmocklib.ResourceInfo(
            kind=kind, namespaced=True, verbs={"list", "watch", "get", "create", "patch", "update", "delete"})
    kmock.resources["admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"] = kmocklib.ResourceInfo(
        kind="MutatingWebhookConfiguration", namespaced=False, verbs={"get", "create", "patch", "list"})
    # kopf's observers wait for these two before they start any watch, even cluster-wide.
    kmock.resources["v1/namespaces"] = kmocklib.ResourceInfo(kind="Namespace", namespaced=False,
                                                             verbs={"list", "watch", "get"})
    kmock.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmocklib.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs={"list", "watch", "get"})


class Api:
    """A plain HTTP client for the emulator, as kubectl would talk to a cluster."""

    def __init__(self, session: aiohttp.ClientSession, emulator: kmocklib.KubernetesEmulator) -> None:
        self.session = session
        self.emulator = emulator

    @staticmethod
    def url(resource: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        group_version, plural = resource.rsplit("/", 1)
        root = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        return f"{root}/namespaces/{namespace}/{plural}" + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")

    async def create(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(self.url(resource, obj["metadata"]["namespace"]), json=obj) as r:
            assert r.status < 300, await r.text()
            return await r.json()

    async def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        async with self.session.get(self.url(resource, namespace, name)) as r:
            return None if r.status == 404 else await r.json()

    async def patch(self, resource: str, namespace: str, name: str, body: dict[str, Any],
                    sub: str | None = None) -> dict[str, Any]:
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self.session.patch(self.url(resource, namespace, name, sub), json=body, headers=headers) as r:
            assert r.status < 300, await r.text()
            return await r.json()

    async def delete(self, resource: str, namespace: str, name: str) -> None:
        async with self.session.delete(self.url(resource, namespace, name)) as r:
            assert r.status < 300, await r.text()

    async def wait_for(self, resource: str, namespace: str, name: str, check: Any, timeout: float = 20) -> dict:
        """Poll until `check(obj)` holds (obj may be None once deleted); fail with the last state."""
        deadline = asyncio.get_running_loop().time() + timeout
        obj = None
        while asyncio.get_running_loop().time() < deadline:
            obj = await self.get(resource, namespace, name)
            if check(obj):
                return obj
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out waiting on {resource} {namespace}/{name}; last state: {obj}")


def external_pool(name: str, endpoint: str, bucket: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvfetcher.io/v1alpha1", "kind": "KVCachePool",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "generation": 1,
                     "resourceVersion": "1"},
        "spec": {"storage": {"external": {"endpoint": endpoint, "bucket": bucket,
                                          "credentialsSecretRef": {"name": "s3-creds"}}}, **spec},
    }


def s3_secret(namespace: str = "default") -> dict[str, Any]:
    enc = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds", "namespace": namespace},
            "data": {"accessKey": enc("testing"), "secretKey": enc("testing")}}


def cond(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    return conditions.find(((obj or {}).get("status") or {}).get("conditions"), type_) or {}


def is_ready(obj: dict[str, Any] | None) -> bool:
    return cond(obj, "Ready").get("status") == "True"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def run_operator(request: pytest.FixtureRequest, **env: str) -> AsyncIterator[dict[str, Any]]:
    """The operator, cluster-wide, against the emulator; yields where its webhook and metrics listen.

    The S3 server is on loopback, which the operator refuses by default: the tests allow
    127.0.0.1 only (`env` overrides any setting).
    """
    import kopf

    from kvfetcher_operator import admission, handlers  # noqa: F401  (registers the handlers: role all)

    kmock = request.getfixturevalue("kmock")
    tls: dict[str, Path] = request.getfixturevalue("tls")
    tmp_path: Path = request.getfixturevalue("tmp_path")
    monkeypatch: pytest.MonkeyPatch = request.getfixturevalue("monkeypatch")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
        "users": [{"name": "kmock", "user": {"token": "test"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
    }))
    ports = {"webhook": free_port(), "metrics": free_port()}
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setenv("KVFETCHER_WEBHOOK_ADDR", "127.0.0.1")
    monkeypatch.setenv("KVFETCHER_WEBHOOK_PORT", str(ports["webhook"]))
    monkeypatch.setenv("KVFETCHER_WEBHOOK_CERT", str(tls["cert"]))
    monkeypatch.setenv("KVFETCHER_WEBHOOK_KEY", str(tls["key"]))
    monkeypatch.setenv("KVFETCHER_METRICS_ADDR", "127.0.0.1")
    monkeypatch.setenv("KVFETCHER_METRICS_PORT", str(ports["metrics"]))
    monkeypatch.setenv("KVFETCHER_RETRY_SECONDS", "0.3")
    monkeypatch.setenv("KVFETCHER_ENDPOINT_ALLOW", "127.0.0.1/32")
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    # kopf owns its event loop (it cancels every task left in it when it stops): give it a thread.
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=asyncio.run, daemon=True, args=(
        kopf.operator(clusterwide=True, standalone=True, stop_flag=stop, ready_flag=ready),))
    thread.start()
    try:
        assert await asyncio.to_thread(ready.wait, 20), "the operator did not start"
        await wait_listening(ports["webhook"])
        yield {"webhook": f"https://127.0.0.1:{ports['webhook']}",
               "metrics": f"http://127.0.0.1:{ports['metrics']}", "ca": tls["ca"]}
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 20)
    assert not thread.is_alive(), "the operator did not stop"


async def wait_listening(port: int, timeout: float = 15) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


def kubeconfig(kmock: Any, tmp_path: Path) -> Path:
    """A kubeconfig file pointing at the API emulator, for an operator run as its own process."""
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "k",
        "clusters": [{"name": "k", "cluster": {"server": str(kmock.url).rstrip("/")}}],
        "users": [{"name": "k", "user": {"token": "t"}}],
        "contexts": [{"name": "k", "context": {"cluster": "k", "user": "k"}}]}))
    return path


async def probe(url: str) -> int | None:
    """The HTTP status of a GET of ``url``, or None when nothing answers."""
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as r:
            await r.read()
            return r.status
    except aiohttp.ClientError:
        return None
