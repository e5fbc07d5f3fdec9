"""Kubernetes RBAC, evaluated over rendered manifests, for the tests that replay the chart's rights
on the API emulator (which authorises nothing itself)."""
from __future__ import annotations

from typing import Any

#: the emulator's action (kmock) -> the RBAC verb
VERBS = {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create", "DELETE": "delete"}


def _subject(binding: dict[str, Any], namespace: str, name: str) -> bool:
    return any(s.get("kind") == "ServiceAccount" and s.get("name") == name and s.get("namespace") == namespace
               for s in binding.get("subjects") or [])


def _rule_allows(rule: dict[str, Any], verb: str, group: str, resource: str, name: str | None) -> bool:
    return (any(g in ("*", group) for g in rule.get("apiGroups") or [])
            and any(r in ("*", resource) for r in rule.get("resources") or [])
            and any(v in ("*", verb) for v in rule.get("verbs") or [])
            and (not rule.get("resourceNames") or name in rule["resourceNames"]))


def rules_for(docs: list[dict[str, Any]], account: tuple[str, str],
              namespace: str | None) -> list[dict[str, Any]]:
    """The rules the service account ``account`` (namespace, name) holds in ``namespace`` (None:
    cluster-wide): its ClusterRoleBindings' ClusterRoles, and in a namespace its RoleBindings'."""
    roles = {(d["kind"], (d["metadata"].get("namespace")), d["metadata"]["name"]): d for d in docs
             if d["kind"] in ("Role", "ClusterRole")}
    out: list[dict[str, Any]] = []
    for b in docs:
        if b["kind"] == "ClusterRoleBinding" or (b["kind"] == "RoleBinding" and b["metadata"].get("namespace") == namespace
                                                  and namespace is not None):
            if not _subject(b, *account):
                continue
            ref = b["roleRef"]
            role_ns = None if ref["kind"] == "ClusterRole" else b["metadata"]["namespace"]
            out += (roles.get((ref["kind"], role_ns, ref["name"])) or {}).get("rules") or []
    return out


def allowed(docs: list[dict[str, Any]], account: tuple[str, str], verb: str, group: str, resource: str,
            namespace: str | None, name: str | None = None) -> bool:
    """Whether ``account`` may ``verb`` the ``resource`` (``plural`` or ``plural/subresource``) of
    API ``group`` ("" core) in ``namespace`` (None: cluster-scoped or across namespaces)."""
    return any(_rule_allows(rule, verb, group, resource, name) for rule in rules_for(docs, account, namespace))
