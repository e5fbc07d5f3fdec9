"""Which external S3 endpoints the operator may send signed requests to.

An external pool names its endpoint, so without a check any namespace admin could point the
operator at loopback, the node's metadata service or in-cluster services. Every address the
endpoint's host resolves to must be outside the deny list (loopback, link-local, unspecified,
the Kubernetes API server's own addresses, and whatever the cluster admin adds) unless it is
in the allow list; when allowed hosts are given, the host must be one of them.
"""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
ALWAYS_DENIED = ("127.0.0.0/8", "::1/128", "169.254.0.0/16", "fe80::/10", "0.0.0.0/8", "::/128",
                 "::ffff:127.0.0.0/104", "::ffff:169.254.0.0/112")


def networks(text: str | Iterable[str]) -> tuple[Network, ...]:
    """CIDRs from a comma-separated string or a list; bare addresses are single-host networks."""
    items = text.split(",") if isinstance(text, str) else text
    return tuple(ipaddress.ip_network(item.strip(), strict=False) for item in items if item.strip())


@dataclass(frozen=True)
class Policy:
    deny: tuple[Network, ...] = networks(ALWAYS_DENIED)
    allow: tuple[Network, ...] = ()
    hosts: tuple[str, ...] = ()  # if given, the only endpoint hosts allowed

    def extended(self, deny: Iterable[str] = (), allow: Iterable[str] = (), hosts: Iterable[str] = ()) -> "Policy":
        return Policy(self.deny + networks(list(deny)), self.allow + networks(list(allow)),
                      self.hosts + tuple(h.strip().lower() for h in hosts if h.strip()))


def _addresses(host: str) -> set[str]:
    return {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}


def problem(endpoint: str, policy: Policy) -> str | None:
    """Why the operator must not call `endpoint`, or None when it may."""
    host = (urlsplit(endpoint).hostname or "").lower()
    if policy.hosts and host not in policy.hosts:
        return f"endpoint host {host} is not in the operator's allowed endpoint hosts"
    try:
        addresses = _addresses(host)
    except OSError:
        return f"endpoint host {host} does not resolve"
    for text in sorted(addresses):
        address = ipaddress.ip_address(text.split("%")[0])
        if any(address in n for n in policy.deny) and not any(address in n for n in policy.allow):
            return f"endpoint host {host} resolves to {address}, which the operator may not call"
    return None
