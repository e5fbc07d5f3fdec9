"""The operator's own Prometheus metrics: pools by phase, reconcile errors, webhook decisions."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

PHASES = ("Pending", "Provisioning", "Ready", "Failed", "Terminating")
REGISTRY = CollectorRegistry()

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


POOLS = Phases()
REGISTRY.register(POOLS)


def serve(port: int, addr: str = "0.0.0.0"):
    """Serve /metrics on its own thread; returns the server so that it can be shut down."""
    server, _thread = start_http_server(port, addr=addr, registry=REGISTRY)
    return server
