"""A store outage never takes a model out of service: the injected sidecar's readiness probe keeps
answering 200 while its store is down, and the pool's StorageReady condition, an Event and the
metrics say why."""
from __future__ import annotations

import asyncio
import copy
import re
from pathlib import Path

import aiohttp
import yaml
from moto.server import ThreadedMotoServer
from op_helpers import POOLS, Api, cond, external_pool, is_ready, s3_secret

from kvfetcher_operator import injection

REPO = Path(__file__).resolve().parents[2]


def example_pod(pool: str) -> dict:
    """The pod of examples/model-deployment.yaml, in the default namespace, opted into ``pool``."""
    deployment = yaml.safe_load((REPO / "examples" / "model-deployment.yaml").read_text())
    template = copy.deepcopy(deployment["spec"]["template"])
    template["metadata"].update(namespace="default", name="llama-0")
    template["metadata"]["annotations"][injection.POOL_ANNOTATION] = pool
    return template


async def http_get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as r:
        return r.status, await r.text()


async def test_store_outage_keeps_the_pod_ready_and_the_pool_says_why(operator, api: Api, tmp_path: Path) -> None:
    from kvfetcher.api.server import Embedded
    from kvfetcher.config import Config
    from kvfetcher.service import Sidecar
    from kvfetcher.store.s3 import S3Store

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # this test's own store, to stop
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    stopped = False
    try:
        await api.create("v1/secrets", s3_secret())
        await api.create(POOLS, external_pool("outage", endpoint, "outage-bucket"))
        pool = await api.wait_for(POOLS, "default", "outage", is_ready)

        patch = injection.mutate(example_pod("outage"), pool).patch
        (side,) = patch["spec"]["initContainers"]
        probe_path = side["readinessProbe"]["httpGet"]["path"]
        store = S3Store(endpoint, "outage-bucket", "testing", "testing")
        sidecar = Sidecar(store, Config(chunk_tokens=64, presets=("raw",), decode_procs=0, warm_up=False))
        with Embedded(sidecar, "token", socket_path=str(tmp_path / "kvfetcher.sock")) as running:
            base = f"http://127.0.0.1:{running.where['port']}"
            assert (await http_get(base + probe_path))[0] == 200
            assert (await http_get(base + "/readyz"))[0] == 200

            server.stop()
            stopped = True
            # The pod stays Ready: its probe asks the socket, not the store...
            assert await http_get(base + probe_path) == (200, "serving\n")
            # ...while the store's health is there for whoever asks, and in the metrics.
            status, text = await http_get(base + "/readyz")
            assert status == 503 and text.startswith("store not ready: store_down")
            assert re.search(r"^kvfetcher_store_up 0\.0$", (await http_get(base + "/metrics"))[1], re.M)

        # The pool says why, in its condition, an Event and the operator's metrics.
        pool = await api.wait_for(POOLS, "default", "outage",
                                  lambda o: cond(o, "StorageReady").get("status") == "False", timeout=30)
        storage = cond(pool, "StorageReady")
        assert storage["reason"] == "BucketUnavailable" and endpoint in storage["message"]
        for _ in range(50):
            posted = [e for e in api.emulator if e.method == "POST" and e.resource is not None
                      and e.resource.plural == "events" and (e.data or {}).get("reason") == "BucketUnavailable"]
            if posted:
                break
            await asyncio.sleep(0.1)
        assert posted and posted[0].data["type"] == "Warning"
        _, exposition = await http_get(operator["metrics"] + "/metrics")
        assert ('kvfetcher_operator_pool_condition{condition="StorageReady",namespace="default",pool="outage"} 0.0'
                in exposition)
    finally:
        if not stopped:
            server.stop()


def test_the_injected_readiness_path_is_the_sidecars_serving_check() -> None:
    """The operator cannot import the data plane's API: the path it injects is checked here."""
    from kvfetcher.api import health, server
    from kvfetcher.config import Config
    from kvfetcher.service import Sidecar
    from kvfetcher.store.local import LocalStore

    app = server.make_app(Sidecar(LocalStore("/nonexistent-kvf"), Config(decode_procs=0, warm_up=False)), None)
    routes = {r.resource.canonical: r.handler for r in app.router.routes() if r.method == "GET"}
    assert routes[injection.READINESS_PATH] is health.serving
