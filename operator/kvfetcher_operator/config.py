"""Operator settings from the environment (the chart sets them; tests point them at loopback)."""
from __future__ import annotations

import os
from dataclasses import dataclass


def _float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


@dataclass(frozen=True)
class Config:
    webhook_addr: str = "0.0.0.0"
    webhook_port: int = 9443
    webhook_cert: str = "/etc/kvfetcher/webhook/tls.crt"
    webhook_key: str = "/etc/kvfetcher/webhook/tls.key"
    metrics_addr: str = "0.0.0.0"
    metrics_port: int = 8080
    retry_seconds: float = 10.0
    # The MutatingWebhookConfiguration that routes pods here (the chart sets it); unset: not checked.
    webhook_configuration: str | None = None
    # External endpoints: CIDRs denied on top of the built-in list, CIDRs allowed despite it,
    # and (when set) the only hosts allowed; comma-separated.
    endpoint_deny: str = ""
    endpoint_allow: str = ""
    endpoint_hosts: str = ""
    # The operator's own namespace (the chart sets it): MinIO's NetworkPolicy lets it in.
    namespace: str | None = None

    @classmethod
    def from_env(cls) -> "Config":
        env = os.environ.get
        return cls(
            webhook_addr=env("KVFETCHER_WEBHOOK_ADDR", cls.webhook_addr),
            webhook_port=int(env("KVFETCHER_WEBHOOK_PORT", cls.webhook_port)),
            webhook_cert=env("KVFETCHER_WEBHOOK_CERT", cls.webhook_cert),
            webhook_key=env("KVFETCHER_WEBHOOK_KEY", cls.webhook_key),
            metrics_addr=env("KVFETCHER_METRICS_ADDR", cls.metrics_addr),
            metrics_port=int(env("KVFETCHER_METRICS_PORT", cls.metrics_port)),
            retry_seconds=_float("KVFETCHER_RETRY_SECONDS", cls.retry_seconds),
            webhook_configuration=env("KVFETCHER_WEBHOOK_CONFIGURATION") or None,
            endpoint_deny=env("KVFETCHER_ENDPOINT_DENY", ""),
            endpoint_allow=env("KVFETCHER_ENDPOINT_ALLOW", ""),
            endpoint_hosts=env("KVFETCHER_ENDPOINT_HOSTS", ""),
            namespace=env("KVFETCHER_NAMESPACE") or None,
        )


# Read at import: kopf fixes a timer's interval when the handler is registered.
RESYNC_SECONDS = _float("KVFETCHER_RESYNC_SECONDS", 60.0)
