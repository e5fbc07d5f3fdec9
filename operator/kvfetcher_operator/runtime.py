"""What every role of the operator process shares: kopf's settings, the API login, the config and /metrics.

Importing this module registers its startup, login and cleanup handlers with kopf (kopf's
registry is global); `admission` and `handlers` import it, so each role gets them exactly once.
"""
from __future__ import annotations

import logging
from typing import Any

import kopf

from . import kube, metrics
from .config import Config


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """memo.cfg, memo.kube and memo.metrics_server are set before any other startup handler runs."""
    cfg = Config.from_env()
    # Progress and diff-base live in annotations: status holds only what the CRD declares.
    settings.persistence.finalizer = "kvfetcher.io/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvfetcher.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kvfetcher.io", key="last-handled-configuration")
    settings.posting.level = logging.INFO
    memo.cfg = cfg
    metrics.POOLS.by_pool.clear()  # phases are re-learnt as the pools are resumed
    memo.kube = kube.Kube.from_environment()
    memo.metrics_server = metrics.serve(cfg.metrics_port, cfg.metrics_addr)


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    return kube.Kube.from_environment().connection_info()


@kopf.on.cleanup()
def stop_metrics(memo: kopf.Memo, **_: Any) -> None:
    server = memo.get("metrics_server")
    if server is not None:
        server.shutdown()
        server.server_close()
