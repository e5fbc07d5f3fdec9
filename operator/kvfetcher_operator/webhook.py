"""kopf's HTTPS webhook server, plus the one thing the API server leaves out for pods.

For a pod that a controller creates (a Deployment's ReplicaSet, a Job), the API server sends
the AdmissionReview with `request.namespace` set but `object.metadata.namespace` empty, and
kopf hands handlers only the object. The pool is looked up in the pod's namespace, so the
namespace is copied into the object before kopf sees it (the JSON patch kopf computes
against that same object does not touch it).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import kopf


def with_request_namespace(review: dict[str, Any]) -> dict[str, Any]:
    request = review.get("request") or {}
    obj = request.get("object")
    if isinstance(obj, dict) and request.get("namespace"):
        meta = obj.setdefault("metadata", {})
        if not meta.get("namespace"):
            meta["namespace"] = request["namespace"]
    return review


class Server(kopf.WebhookServer):
    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        async def serve(review: dict[str, Any], **kwargs: Any) -> Any:
            return await fn(with_request_namespace(review), **kwargs)

        async for client_config in super().__call__(serve):
            yield client_config
