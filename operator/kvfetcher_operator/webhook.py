"""kopf's HTTPS webhook server, plus the one thing the API server leaves out for pods, a request
size limit above aiohttp's 1 MiB default and a shape check of every review.

For a pod that a controller creates (a Deployment's ReplicaSet, a Job), the API server sends
the AdmissionReview with `request.namespace` set but `object.metadata.namespace` empty, and
kopf hands handlers only the object. The pool is looked up in the pod's namespace, so the
namespace is copied into the object before kopf sees it (the JSON patch kopf computes
against that same object does not touch it).

A pod spec can exceed 1 MiB (the API server admits objects up to about 3 MiB): such reviews
are read in full rather than answered 413. A review that is not a JSON object with a
`request` object carrying a resource and an object with object metadata is answered 400.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import kopf

MAX_REVIEW_BYTES = 3 * 2**20
WEBHOOK_ID = "inject-sidecar"  # the URL path of the webhook: /inject-sidecar


def shape_problem(review: Any) -> str | None:
    """Why `review` is not an AdmissionReview kopf can handle, or None."""
    if not isinstance(review, dict):
        return "the body is not a JSON object"
    request = review.get("request")
    if not isinstance(request, dict):
        return "request is missing or not an object"
    if not isinstance(request.get("uid"), str) or not isinstance(request.get("resource"), dict):
        return "request.uid or request.resource is missing"
    obj = request.get("object")
    if obj is not None and (not isinstance(obj, dict) or not isinstance(obj.get("metadata", {}), dict)):
        return "request.object or its metadata is not an object"
    return None


def with_request_namespace(review: dict[str, Any]) -> dict[str, Any]:
    request = review.get("request") or {}
    obj = request.get("object")
    if isinstance(obj, dict) and request.get("namespace"):
        meta = obj.setdefault("metadata", {})
        if not meta.get("namespace"):
            meta["namespace"] = request["namespace"]
    return review


class Server(kopf.WebhookServer):
    """kopf's server with this module's review reading (it replaces kopf's `_serve`, same contract)."""

    @staticmethod
    async def _serve(fn: Any, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if request.content_length is not None and request.content_length > MAX_REVIEW_BYTES:
            raise aiohttp.web.HTTPRequestEntityTooLarge(max_size=MAX_REVIEW_BYTES, actual_size=request.content_length)
        body = bytearray()
        while chunk := await request.content.read(2**16):
            body += chunk
            if len(body) > MAX_REVIEW_BYTES:
                raise aiohttp.web.HTTPRequestEntityTooLarge(max_size=MAX_REVIEW_BYTES, actual_size=len(body))
        try:
            review = json.loads(body)
        except ValueError as e:
            raise aiohttp.web.HTTPBadRequest(reason=f"not JSON: {e}") from e
        problem = shape_problem(review)
        if problem:
            raise aiohttp.web.HTTPBadRequest(reason=problem)
        sslpeer = request.transport.get_extra_info("peercert") if request.transport else None
        try:
            response = await fn(review, webhook=request.match_info.get("id"), sslpeer=sslpeer,
                                headers=dict(request.headers))
        except Exception as e:  # kopf refuses the review itself (unknown resource, missing data)
            raise aiohttp.web.HTTPBadRequest(reason=type(e).__name__) from e
        return aiohttp.web.json_response(response)

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        async def serve(review: dict[str, Any], **kwargs: Any) -> Any:
            return await fn(with_request_namespace(review), **kwargs)

        async for client_config in super().__call__(serve):
            yield client_config
