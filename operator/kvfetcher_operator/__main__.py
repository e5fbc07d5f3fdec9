"""`kvfetcher-operator`: run the kopf operator in one role, cluster-wide or in some namespaces.

Roles (kopf registers handlers at import, so a role is the set of modules imported):
- `webhook`: the read-only pool index and the admission webhook (`admission`); always without
  peering, since replicas share nothing and write nothing: run several behind one Service.
- `reconciler`: the pools' reconciliation (`handlers`); one replica, no webhook server.
- `all` (default): both in one process, for tests and small installs.
Liveness is kopf's own probe endpoint (it fails when the watch streams die); readiness
(`--readiness`, webhook and all) is served once the pool index is loaded; /metrics is served on
KVFETCHER_METRICS_PORT.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import logging

import kopf

from kvfetcher import config as settings

ROLES = {"webhook": ("admission",), "reconciler": ("handlers",), "all": ("admission", "handlers")}


def configure_logging(verbose: bool) -> None:
    """kopf's logging at KVFETCHER_LOG_LEVEL (DEBUG with --verbose), as text or JSON (KVFETCHER_LOG_FORMAT)."""
    as_json = settings.LOG_FORMAT.read() == "json"
    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.JSON if as_json else kopf.LogFormat.FULL)
    logging.getLogger().setLevel(logging.DEBUG if verbose else settings.LOG_LEVEL.read())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvfetcher-operator", description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=sorted(ROLES), default="all",
                        help="webhook (admission only), reconciler (no webhook server), or all (default)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8081/healthz", help="kopf's liveness endpoint URL")
    parser.add_argument("--readiness", default=None,
                        help="serve this readiness URL (http://0.0.0.0:8082/readyz): ready once the pool index is loaded")
    parser.add_argument("--standalone", action="store_true", help="no peering (a single replica)")
    parser.add_argument("--peering", default=None,
                        help="a ClusterKopfPeering name: makes peering mandatory (its CRD must exist)")
    parser.add_argument("--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable; default: every namespace)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.readiness and args.role == "reconciler":
        parser.error("--readiness probes the pool index, which only the webhook role keeps")
    standalone = args.standalone or args.role == "webhook"
    for module in ROLES[args.role]:
        importlib.import_module(f"{__package__}.{module}")
    configure_logging(args.verbose)
    asyncio.run(kopf.operator(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=standalone,
        peering_name=None if standalone else args.peering,
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(readiness_url=args.readiness, namespaces=args.namespace),
    ))


if __name__ == "__main__":
    main()
