"""The README's quick start, replayed on the API emulator under the chart's rendered RBAC: its
`helm install` line's values, its examples applied as `kubectl apply -f` would, until the pool is
Ready (with the chart's defaults alone a pool in the examples' namespace stops at
StorageReady=False, Forbidden).

The emulator authorises nothing: the test answers the operator's requests that the rendered
Roles and bindings would not allow with a 403, as an API server would (tests/operator/rbac.py);
kubectl's requests (the test's own) are an admin's.
"""
from __future__ import annotations

import base64
import copy
import re
import shlex
from pathlib import Path
from typing import Any

import helm_python
import kmock as kmocklib
import yaml
from op_helpers import POOLS, Api, cond, is_ready, run_operator
from rbac import VERBS, allowed

REPO = Path(__file__).resolve().parents[2]
# The operator's two clients, told from kubectl's (the test's aiohttp session) by their agents: the
# emulator sends no credentials over plain HTTP.
OPERATOR_AGENTS = ("kopf/", "python-urllib3/")

RESOURCES = {"Secret": "v1/secrets", "KVCachePool": POOLS}


def merge(into: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    for key, value in more.items():
        into[key] = merge(into.get(key) or {}, value) if isinstance(value, dict) else value
    return into


def readme_install() -> tuple[str, str, dict[str, Any]]:
    """The release name, namespace and `--set` values of the README's `helm install` line."""
    line = next(x for x in (REPO / "README.md").read_text().splitlines() if x.startswith("helm install "))
    words = shlex.split(line)
    assert words[3] == "charts/kvfetcher", line
    values: dict[str, Any] = {}
    for flag, value in zip(words, words[1:]):
        if flag == "--set":
            merge(values, helm_python.parse_set_string(value))
    return words[2], words[words.index("-n") + 1], values


def render(values: dict[str, Any], release: str, namespace: str) -> tuple[list[dict[str, Any]], str]:
    out = helm_python.Chart.load(str(REPO / "charts" / "kvfetcher")).render(
        values, name=release, namespace=namespace, is_install=True)
    notes = next(text for path, text in out.items() if path.endswith("NOTES.txt"))
    return [d for path, text in out.items() if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d], notes


def accounts(docs: list[dict[str, Any]], namespace: str) -> list[tuple[str, str]]:
    """The service accounts of the release's Deployments (the reconciler and the webhook; the
    test runs both roles in one process)."""
    return [(namespace, d["spec"]["template"]["spec"]["serviceAccountName"]) for d in docs if d["kind"] == "Deployment"]


def enforce(kmock: kmocklib.KubernetesEmulator, granted: dict[str, Any]) -> list[str]:
    """Answer the operator's requests that ``granted["docs"]``'s RBAC refuses with a 403; returns
    the list of refusals (``verb group/resource namespace``), appended as they happen."""
    refused: list[str] = []

    def forbidden(request: kmocklib.Request) -> bool:
        if not request.headers.get("User-Agent", "").startswith(OPERATOR_AGENTS) or not getattr(request.resource, "plural", None):
            return False  # kubectl's (an admin's), or discovery (open to every authenticated user)
        action = request.action.value if request.action else ""
        verb = VERBS.get(action) or ("patch" if request.method.value == "PATCH" else "update")
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        group = request.resource.group or ""
        if any(allowed(granted["docs"], sa, verb, group, resource, request.namespace, request.name)
               for sa in accounts(granted["docs"], granted["namespace"])):
            return False
        refused.append(f"{verb} {group}/{resource} {request.namespace}")
        return True

    kmock[forbidden] << 403 << {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
                                "code": 403, "message": "forbidden by the chart's RBAC"}
    return refused


async def kubectl_apply(api: Api, path: Path, **edits: Any) -> list[dict[str, Any]]:
    """`kubectl apply -f path` of the repo's example (each document passed through ``edits[kind]``
    if given), with what the API server adds: a Secret's stringData as data, uid, generation."""
    created = []
    for doc in yaml.safe_load_all(path.read_text()):
        doc = edits.get(doc["kind"], lambda d: d)(copy.deepcopy(doc))
        if "stringData" in doc:
            doc["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in doc.pop("stringData").items()}
        meta = doc["metadata"]  # what an API server sets and the emulator does not
        meta.update(uid=f"uid-{meta['name']}", generation=1, resourceVersion="1")
        created.append(await api.create(RESOURCES[doc["kind"]], doc))
    return created


async def test_readme_quick_start_reaches_ready_under_the_charts_rbac(api: Api, kmock: Any, request: Any,
                                                                      s3: str) -> None:
    release, namespace, values = readme_install()
    defaults, notes = render({}, release, namespace)
    granted = {"docs": defaults, "namespace": namespace}
    refused = enforce(kmock, granted)
    # The chart alone binds no pool namespace, and its notes say the one flag the README gives.
    assert "poolNamespaces is empty" in notes and "--set 'poolNamespaces={default}'" in notes
    assert "--set 'poolNamespaces={default}'" in (REPO / "README.md").read_text()

    def external(doc: dict[str, Any]) -> dict[str, Any]:  # the reader's endpoint and credentials
        if doc["kind"] == "Secret":
            doc["stringData"] = {k: "testing" for k in doc["stringData"]}
        else:
            doc["spec"]["storage"]["external"]["endpoint"] = s3
        return doc

    async with run_operator(request):
        applied = await kubectl_apply(api, REPO / "examples" / "pool-external-s3.yaml", Secret=external,
                                      KVCachePool=external)
        (pool,) = [p for p in applied if p["kind"] == "KVCachePool"]
        name, pool_ns = pool["metadata"]["name"], pool["metadata"]["namespace"]
        stuck = await api.wait_for(POOLS, pool_ns, name, lambda o: cond(o, "StorageReady").get("reason") == "Forbidden")
        assert "docs/security.md" in cond(stuck, "StorageReady")["message"] and refused

        # The README's install line, as `helm upgrade`: the pool goes on to Ready.
        granted["docs"], notes = render(values, release, namespace)
        assert "WARNING" not in notes and pool_ns in notes
        refused.clear()
        ready = await api.wait_for(POOLS, pool_ns, name, is_ready, timeout=30)
        assert ready["status"]["phase"] == "Ready"

        # The managed example gets as far as the emulator can take it: everything built, MinIO
        # awaited (no StatefulSet controller runs here), nothing refused.
        (managed,) = await kubectl_apply(api, REPO / "examples" / "pool-managed-minio.yaml")
        mname = managed["metadata"]["name"]
        waiting = await api.wait_for(POOLS, pool_ns, mname,
                                     lambda o: cond(o, "StorageReady").get("reason") == "MinIOStarting")
        assert re.match(r"0/4 MinIO replicas ready", cond(waiting, "StorageReady")["message"])
        assert await api.get("apps/v1/statefulsets", pool_ns, f"{mname}-minio") is not None
        assert refused == [], refused
