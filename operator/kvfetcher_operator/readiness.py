"""The webhook's readiness: ready only once its pool index holds every pool the API server lists.

kopf serves admission requests as soon as its resources are discovered, before the pool index
is filled; a pod admitted then would find no pool and start without the sidecar. The readiness
probe keeps such a replica out of the webhook Service until the index has caught up: each probe
lists the pools (read-only) and compares the keys with the index. Once ready, it stays ready
(the watch keeps the index current; a dead watch fails kopf's liveness probe instead).
"""
from __future__ import annotations

import asyncio
from collections.abc import Collection, Container
from urllib.parse import urlsplit

import aiohttp.web

from . import spec as specs
from .kube import Kube


class Readiness:
    def __init__(self, k: Kube, namespaces: Collection[str], index: Container[tuple[str, str]]) -> None:
        self.k, self.namespaces, self.index = k, list(namespaces) or [None], index
        self.loaded = False

    def missing(self) -> list[tuple[str, str]]:
        """The pools the API server lists that the index lacks (blocking: one LIST per namespace)."""
        listed = [(p["metadata"]["namespace"], p["metadata"]["name"]) for ns in self.namespaces
                  for p in self.k.list(f"{specs.GROUP}/{specs.VERSION}", specs.PLURAL, ns, "")]
        return [key for key in listed if key not in self.index]

    async def ready(self) -> tuple[bool, str]:
        if not self.loaded:
            try:
                missing = await asyncio.to_thread(self.missing)
            except Exception as e:
                return False, f"pools not listed: {type(e).__name__}"
            if missing:
                return False, f"{len(missing)} pool(s) not indexed yet"
            self.loaded = True
        return True, "the pool index is loaded"

    async def serve(self, url: str) -> aiohttp.web.AppRunner:
        """Serve GET <path of url> (200 ready, 503 not yet) on url's host and port; cleanup() stops it."""
        parts = urlsplit(url)

        async def probe(_: aiohttp.web.Request) -> aiohttp.web.Response:
            ok, text = await self.ready()
            return aiohttp.web.Response(status=200 if ok else 503, text=text)

        app = aiohttp.web.Application()
        app.add_routes([aiohttp.web.get(parts.path or "/readyz", probe)])
        runner = aiohttp.web.AppRunner(app, handle_signals=False)
        await runner.setup()
        await aiohttp.web.TCPSite(runner, parts.hostname, parts.port).start()
        return runner
