"""`kvfetcher-operator`: run the kopf operator with this package's handlers, cluster-wide or in some namespaces.

Liveness is kopf's own probe endpoint (it fails when the watch streams die); readiness
(`--readiness`) is served once the webhook's pool index is loaded; /metrics is served by the
handlers' startup on KVFETCHER_METRICS_PORT.
"""
from __future__ import annotations

import argparse
import asyncio
import logging

import kopf

from . import handlers  # noqa: F401  (registers the handlers)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvfetcher-operator", description=__doc__.splitlines()[0])
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
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(kopf.operator(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(readiness_url=args.readiness, namespaces=args.namespace),
    ))


if __name__ == "__main__":
    main()
