"""Operator settings from the environment (the chart sets them; tests point them at loopback).

The variables, their defaults and docs are declared in :mod:`kvfetcher.config`'s operator table.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvfetcher import config as settings
from kvfetcher.config import env_field


@dataclass(frozen=True)
class Config:
    webhook_addr: str = env_field(settings.WEBHOOK_ADDR)
    webhook_port: int = env_field(settings.WEBHOOK_PORT)
    webhook_cert: str = env_field(settings.WEBHOOK_CERT)
    webhook_key: str = env_field(settings.WEBHOOK_KEY)
    metrics_addr: str = env_field(settings.METRICS_ADDR)
    metrics_port: int = env_field(settings.METRICS_PORT)
    retry_seconds: float = env_field(settings.RETRY_SECONDS)
    # The MutatingWebhookConfiguration that routes pods here (the chart sets it); None: not checked.
    webhook_configuration: str | None = env_field(settings.WEBHOOK_CONFIGURATION)
    # External endpoints: CIDRs denied on top of the built-in list, CIDRs allowed despite it,
    # and (when set) the only hosts allowed; comma-separated.
    endpoint_deny: str = env_field(settings.ENDPOINT_DENY)
    endpoint_allow: str = env_field(settings.ENDPOINT_ALLOW)
    endpoint_hosts: str = env_field(settings.ENDPOINT_HOSTS)
    # The operator's own namespace (the chart sets it): MinIO's NetworkPolicy lets it in.
    namespace: str | None = env_field(settings.NAMESPACE)

    @classmethod
    def from_env(cls) -> Config:
        return settings.read_fields(cls)


# Read at import: kopf fixes a timer's interval when the handler is registered.
RESYNC_SECONDS: float = settings.RESYNC_SECONDS.read()
