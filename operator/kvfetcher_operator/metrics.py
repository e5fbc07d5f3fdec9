"""The operator's own Prometheus metrics: pools by phase, their conditions, reconcile errors, webhook decisions."""
from __future__ import annotations

from collections.abc import Iterator

import platform
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import CollectorRegistry, Counter, Info, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

PHASES = ("Pending", "Provisioning", "Ready", "Failed", "Terminating")
REGISTRY = CollectorRegistry()

BUILD = Info("kvfetcher_operator_build", "The operator's version and Python.", registry=REGISTRY)
try:
    BUILD.info({"version": version("kvfetcher"), "python": platform.python_version()})
except PackageNotFoundError:
    BUILD.info({"version": "unknown", "python": platform.python_version()})
RECONCILE_ERRORS = Counter(
    "kvfetcher_operator_reconcile_errors_total", "Reconciles of a pool that ended in an error, by reason.",
    ["reason"], registry=REGISTRY)
INJECTIONS = Counter(
    "kvfetcher_operator_injections_total", "Admission decisions on opted-in pods, by outcome.",
    ["outcome"], registry=REGISTRY)


class Phases(Collector):
    """The last phase written for each pool, exported as a count per phase (zeros included)."""

    def __init__(self) -> None:
        self.by_pool: dict[tuple[str, str], str] = {}

    def set(self, namespace: str, name: str, phase: str) -> None:
        self.by_pool[(namespace, name)] = phase

    def forget(self, namespace: str, name: str) -> None:
        self.by_pool.pop((namespace, name), None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("kvfetcher_operator_pools", "KVCachePools by phase.", labels=["phase"])
        for phase in PHASES:
            family.add_metric([phase], sum(1 for p in self.by_pool.values() if p == phase))
        yield family


class Conditions(Collector):
    """The last conditions written for each pool: 1 where True, 0 where False or Unknown (a store
    outage shows as StorageReady 0, for alerts, while the pods' readiness ignores it)."""

    def __init__(self) -> None:
        self.by_pool: dict[tuple[str, str], dict[str, bool]] = {}

    def set(self, namespace: str, name: str, conditions: list[dict]) -> None:
        self.by_pool[(namespace, name)] = {c["type"]: c.get("status") == "True" for c in conditions}

    def forget(self, namespace: str, name: str) -> None:
        self.by_pool.pop((namespace, name), None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("kvfetcher_operator_pool_condition", "A pool's status conditions: 1 True, 0 not.",
                                   labels=["namespace", "pool", "condition"])
        for (namespace, name), conds in sorted(self.by_pool.items()):
            for type_, true in conds.items():
                family.add_metric([namespace, name, type_], 1.0 if true else 0.0)
        yield family


POOLS = Phases()
REGISTRY.register(POOLS)
CONDITIONS = Conditions()
REGISTRY.register(CONDITIONS)


def serve(port: int, addr: str = "0.0.0.0"):
    """Serve /metrics on its own thread; returns the server so that it can be shut down."""
    server, _thread = start_http_server(port, addr=addr, registry=REGISTRY)
    return server
