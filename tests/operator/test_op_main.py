"""The console entry point as the container runs it: a separate process against the emulator,
with kopf's liveness probe, /metrics and the handlers registered; SIGTERM stops it cleanly."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from op_helpers import POOLS, Api, cond, external_pool, free_port, kubeconfig, probe


async def test_kvfetcher_operator_process(api: Api, kmock, tls: dict[str, Path], tmp_path: Path) -> None:
    live, metrics, hook = free_port(), free_port(), free_port()
    env = {**os.environ, "KUBECONFIG": str(kubeconfig(kmock, tmp_path)), "KVFETCHER_METRICS_PORT": str(metrics),
           "KVFETCHER_METRICS_ADDR": "127.0.0.1", "KVFETCHER_WEBHOOK_ADDR": "127.0.0.1",
           "KVFETCHER_WEBHOOK_PORT": str(hook), "KVFETCHER_WEBHOOK_CERT": str(tls["cert"]),
           "KVFETCHER_WEBHOOK_KEY": str(tls["key"]), "KVFETCHER_ENDPOINT_ALLOW": "127.0.0.1/32"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvfetcher_operator", "--standalone", "--verbose", f"--liveness=http://127.0.0.1:{live}/healthz",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output = b""
    try:
        for _ in range(200):
            if await probe(f"http://127.0.0.1:{live}/healthz") == 200:
                break
            await asyncio.sleep(0.1)
        assert await probe(f"http://127.0.0.1:{live}/healthz") == 200
        assert await probe(f"http://127.0.0.1:{metrics}/metrics") == 200
        await api.create(POOLS, external_pool("proc", "http://127.0.0.1:9", "proc"))
        pool = await api.wait_for(POOLS, "default", "proc",
                                  lambda o: cond(o, "StorageReady").get("reason") == "CredentialsMissing")
        assert pool["status"]["phase"] == "Provisioning"
    except AssertionError as e:
        proc.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(proc.communicate(), 30)
        raise AssertionError(f"{e}\n--- operator output ---\n{output.decode()[-4000:]}") from None
    proc.send_signal(signal.SIGTERM)
    output, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, output.decode()[-3000:]
