"""The webhook is ready only once its pool index is loaded, so a replica that
is still listing pools is kept out of the webhook Service instead of admitting pods without the
sidecar. On the API emulator: the readiness endpoint by itself, then in the operator process."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from op_helpers import POOLS, Api, external_pool, free_port, kubeconfig, probe

from kvfetcher_operator import kube, readiness


async def test_not_ready_until_every_listed_pool_is_indexed(api: Api, kmock: Any, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(kmock, tmp_path)))
    await api.create(POOLS, external_pool("a", "https://s3.example.com", "a"))
    await api.create(POOLS, external_pool("b", "https://s3.example.com", "b", namespace="ml"))
    index: dict[tuple[str, str], Any] = {("default", "a"): {}}
    port = free_port()
    server = await readiness.Readiness(kube.Kube.from_environment(), (), index).serve(f"http://127.0.0.1:{port}/readyz")
    try:
        assert await probe(f"http://127.0.0.1:{port}/readyz") == 503  # ml/b not indexed yet
        index[("ml", "b")] = {}
        assert await probe(f"http://127.0.0.1:{port}/readyz") == 200
        del index[("ml", "b")]
        assert await probe(f"http://127.0.0.1:{port}/readyz") == 200  # once loaded, the watch keeps it current
    finally:
        await server.cleanup()


async def test_the_operator_process_becomes_ready_with_its_index(api: Api, kmock: Any, tls: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    await api.create(POOLS, external_pool("proc", "http://127.0.0.1:9", "proc"))
    live, ready, metrics, hook = free_port(), free_port(), free_port(), free_port()
    env = {**os.environ, "KUBECONFIG": str(kubeconfig(kmock, tmp_path)), "KVFETCHER_METRICS_PORT": str(metrics),
           "KVFETCHER_METRICS_ADDR": "127.0.0.1", "KVFETCHER_WEBHOOK_ADDR": "127.0.0.1",
           "KVFETCHER_WEBHOOK_PORT": str(hook), "KVFETCHER_WEBHOOK_CERT": str(tls["cert"]),
           "KVFETCHER_WEBHOOK_KEY": str(tls["key"])}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvfetcher_operator", "--standalone", f"--liveness=http://127.0.0.1:{live}/healthz",
        f"--readiness=http://127.0.0.1:{ready}/readyz", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        for _ in range(200):
            if await probe(f"http://127.0.0.1:{ready}/readyz") == 200:
                break
            await asyncio.sleep(0.1)
        assert await probe(f"http://127.0.0.1:{ready}/readyz") == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, output.decode()[-3000:]


def test_the_chart_probes_readiness_of_the_index() -> None:
    from test_op_chart import CHART, named, render
    import helm_python
    deployment = named(render(helm_python.Chart.load(str(CHART)), {}), "Deployment", "kvf-kvfetcher-webhook")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "--readiness=http://0.0.0.0:8082/readyz" in container["args"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "ready"}
