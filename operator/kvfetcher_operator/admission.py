"""The admission role: the read-only pool index, the mutating webhook that injects the sidecar, and
the readiness probe that waits for the index.

Nothing here writes to the API server: the index is fed by a watch of the pools (get, list,
watch) and injection reads only the index. So any number of webhook replicas can run side by
side without peering (each keeps its own index), unlike the reconciler, of which one runs.
Importing this module registers its handlers with kopf (and `runtime`'s shared ones).
"""
from __future__ import annotations

import copy
import logging
from typing import Any

import kopf

from . import injection, metrics, readiness, webhook
from . import runtime  # noqa: F401  (registers the shared startup, login and cleanup handlers)
from . import spec as specs
from .webhook import WEBHOOK_ID

POOL = (specs.GROUP, specs.VERSION, specs.PLURAL)


@kopf.on.startup()
async def serve_admission(settings: kopf.OperatorSettings, memo: kopf.Memo, pools: kopf.Index, **_: Any) -> None:
    """kopf's HTTPS server for the webhook; with a readiness URL (`--readiness`), the index's probe too."""
    cfg = memo.cfg
    # The chart owns the MutatingWebhookConfiguration (failurePolicy Ignore); kopf only serves.
    settings.admission.managed = None
    settings.admission.server = webhook.Server(
        addr=cfg.webhook_addr, port=cfg.webhook_port, certfile=cfg.webhook_cert, pkeyfile=cfg.webhook_key)
    url = memo.get("readiness_url")
    if url:
        memo.readiness_server = await readiness.Readiness(memo.kube, memo.get("namespaces") or (), pools).serve(url)


@kopf.on.cleanup()
async def stop_readiness(memo: kopf.Memo, **_: Any) -> None:
    server = memo.get("readiness_server")
    if server is not None:
        await server.cleanup()


@kopf.index(*POOL)
def pools(namespace: str, name: str, meta: Any, spec: Any, status: Any, **_: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """What the webhook needs of each pool, kept in memory so that admission makes no API call; the
    generation, so that only a spec the reconciler has validated is injected."""
    return {(namespace, name): {"metadata": {"name": name, "namespace": namespace, "generation": meta.get("generation")},
                                "spec": copy.deepcopy(dict(spec)), "status": copy.deepcopy(dict(status))}}


def _first(store: Any) -> Any:
    return next(iter(store), None) if store is not None else None


@kopf.on.mutate("pods", id=WEBHOOK_ID, operations=["CREATE"], labels={injection.INJECT_LABEL: "true"},
                ignore_failures=True)
def inject(body: kopf.Body, patch: kopf.Patch, pools: kopf.Index, logger: logging.Logger, **_: Any) -> None:
    pod = {"metadata": copy.deepcopy(dict(body.metadata)), "spec": copy.deepcopy(dict(body.spec))}
    try:
        namespace = pod["metadata"].get("namespace") or "default"
        pool_name = (pod["metadata"].get("annotations") or {}).get(injection.POOL_ANNOTATION, "")
        decision = injection.mutate(pod, _first(pools.get((namespace, pool_name))))
    except Exception as e:  # never block a pod on our own bug
        logger.exception("injection failed")
        decision = injection.Decision(
            {"metadata": {"annotations": {injection.SKIPPED_ANNOTATION: f"internal error: {e}"}}}, "error", str(e))
    patch.update(decision.patch)
    metrics.INJECTIONS.labels(decision.outcome).inc()
    logger.info(f"{decision.outcome}: {decision.reason}")
