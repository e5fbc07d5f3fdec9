"""health: what the injected probes ask, apart from what the store's health says.

A sidecar's readiness is its pod's: were the store's health its readiness, a store outage would
take every model that uses the pool out of its Service, though the cache is only an
optimisation (a fetch from a store that is down answers "recompute all"). So the pod's readiness
probe, :func:`serving`, answers 200 whenever the sidecar accepts connections on its Unix socket
(the model's way in), whatever the store does; the store's health goes to the gauge
``kvfetcher_store_up`` (checked every ``KVFETCHER_STORE_CHECK_S`` and on each ``/readyz``), the
log (on each change) and, from the operator's own check, the pool's ``StorageReady`` condition
and an Event.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from kvfetcher.errors import Reason
from kvfetcher.service import Sidecar

log = logging.getLogger("kvfetcher.api.health")

SOCKETS = web.AppKey("sockets", list)  # the Unix sockets the app serves (filled as they are bound)
CONNECT_TIMEOUT_S = 2.0


async def serving(request: web.Request) -> web.Response:
    """``GET /servingz``: 200 while the sidecar accepts connections on its Unix socket (or, without
    one, answers at all); 503 otherwise. Never asks the store."""
    for path in request.app[SOCKETS]:
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                _, writer = await asyncio.open_unix_connection(path)
            writer.close()
        except (OSError, TimeoutError) as e:
            log.warning("the Unix socket %s takes no connection: %s", path, e)
            return web.Response(status=503, text="socket not serving\n")
    return web.Response(text="serving\n")


async def check_store(sidecar: Sidecar) -> tuple[Reason | None, str]:
    """Ask the store once and set ``kvfetcher_store_up``: (None, "") when it answered, else its
    reason and the error's text (which may name the endpoint: for the log only, never a reply)."""
    try:
        await sidecar.ready()
    except Exception as e:
        sidecar.metrics.store_up.set(0)
        reason = getattr(e, "reason", Reason.DEADLINE if isinstance(e, TimeoutError) else Reason.INTERNAL)
        return reason, f"{type(e).__name__}: {e}"
    sidecar.metrics.store_up.set(1)
    return None, ""


async def watch_store(sidecar: Sidecar, every_s: float) -> None:
    """Check the store every ``every_s`` seconds until cancelled, logging each change of its
    health (``every_s`` <= 0: never; until the first check the gauge is NaN)."""
    last: Reason | None = None
    while every_s > 0:
        await asyncio.sleep(every_s)  # the first after one period: a start does not race its store's set-up
        reason, detail = await check_store(sidecar)
        if reason != last:
            if reason is None:
                log.info("the store answers again")
            else:
                log.warning("store not ready (%s): %s; the pod stays ready, fetches recompute", reason, detail)
        last = reason
