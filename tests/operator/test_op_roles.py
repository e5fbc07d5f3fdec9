"""The webhook runs as its own replicas. A `--role webhook` process keeps the
read-only pool index and admits pods, and reconciles nothing (no finalizer, no status, no child
objects); a `--role reconciler` process reconciles and serves no webhook. Both run side by side
against the API emulator as the chart deploys them."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from op_helpers import POOLS, Api, external_pool, free_port, is_ready, kubeconfig, probe, s3_secret, wait_listening
from test_op_operator import admit, admit_until, model_pod, skipped

from kvfetcher_operator import __main__ as entry


@contextlib.asynccontextmanager
async def role(name: str, kmock: Any, tls: dict[str, Path], tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """`python -m kvfetcher_operator --role NAME` against the emulator; yields its ports; SIGTERM stops it cleanly."""
    ports = {key: free_port() for key in ("live", "ready", "metrics", "webhook")}
    env = {**os.environ, "KUBECONFIG": str(kubeconfig(kmock, tmp_path)), "KVFETCHER_METRICS_ADDR": "127.0.0.1",
           "KVFETCHER_METRICS_PORT": str(ports["metrics"]), "KVFETCHER_WEBHOOK_ADDR": "127.0.0.1",
           "KVFETCHER_WEBHOOK_PORT": str(ports["webhook"]), "KVFETCHER_WEBHOOK_CERT": str(tls["cert"]),
           "KVFETCHER_WEBHOOK_KEY": str(tls["key"]), "KVFETCHER_ENDPOINT_ALLOW": "127.0.0.1/32",
           "KVFETCHER_RETRY_SECONDS": "0.3"}
    args = [f"--role={name}", "--standalone", f"--liveness=http://127.0.0.1:{ports['live']}/healthz"]
    if name != "reconciler":
        args.append(f"--readiness=http://127.0.0.1:{ports['ready']}/readyz")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "kvfetcher_operator", *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        for _ in range(200):
            if await probe(f"http://127.0.0.1:{ports['live']}/healthz") == 200:
                break
            await asyncio.sleep(0.1)
        yield {**ports, "webhook": f"https://127.0.0.1:{ports['webhook']}", "webhook_port": ports["webhook"],
               "ca": tls["ca"]}
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, output.decode()[-3000:]


async def test_webhook_role_admits_and_reconciles_nothing(api: Api, kmock: Any, tls: dict[str, Path],
                                                         tmp_path: Path, s3: str) -> None:
    await api.create("v1/secrets", s3_secret())
    await api.create(POOLS, external_pool("hook", s3, "hook"))
    async with role("webhook", kmock, tls, tmp_path) as hook:
        await wait_listening(hook["webhook_port"])
        for _ in range(100):
            if await probe(f"http://127.0.0.1:{hook['ready']}/readyz") == 200:
                break
            await asyncio.sleep(0.1)
        assert await probe(f"http://127.0.0.1:{hook['ready']}/readyz") == 200  # the index holds the pool
        # The index has the pool, which nobody reconciles: the pod passes without the sidecar.
        _, pod = await admit_until(hook, model_pod("hook"), lambda p: "not Ready" in skipped(p))
        assert "initContainers" not in pod["spec"]
        await asyncio.sleep(1)
        pool = await api.get(POOLS, "default", "hook")
        assert not pool.get("status") and not pool["metadata"].get("finalizers")  # no reconciling here
        assert await api.get("v1/secrets", "default", "hook-kvfetcher") is None

        # The reconciler, in its own process, makes the pool Ready; the webhook's index follows.
        async with role("reconciler", kmock, tls, tmp_path) as reconciler:
            await api.wait_for(POOLS, "default", "hook", is_ready)
            response, pod = await admit_until(hook, model_pod("hook"), lambda p: "initContainers" in p["spec"])
            assert response["allowed"] is True and pod["spec"]["initContainers"][0]["name"] == "kvfetcher"
            with pytest.raises(OSError):  # the reconciler serves no webhook
                await asyncio.open_connection("127.0.0.1", reconciler["webhook_port"])


def test_only_the_webhook_role_probes_the_index() -> None:
    with pytest.raises(SystemExit):
        entry.main(["--role=reconciler", "--readiness=http://127.0.0.1:1/readyz"])
