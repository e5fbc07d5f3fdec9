"""peers: the ``ttft`` phase's prompts through vLLM's own ``OffloadingConnector`` (CPU tier) and
LMCache's vLLM connector, each in an engine of its own (one phase each: a different
``kv_transfer_config``). LMCache ``naive`` serde: its S3 backend at the link server; ``cachegen``
serde: its ``lm://`` server (``lmcache.v1.server``) behind a paced TCP relay
(``benchmarks.lib.linkrelay``), as 0.5.6's S3 backend takes only full raw chunks (``peers.md``).

A cell stores a prompt with one request, clears vLLM's GPU prefix cache
(``llm.reset_prefix_cache()``) and times a second request of the same prompt: its load.
``native-cpu`` reads host memory, not the link: its TTFT is the local upper bound, the same at
every link. LMCache keeps no local CPU copy (``local_cpu: false``), so its second request reads
over the paced link, at each link in turn. A peer whose package is missing is reported as not
installed (no engine starts); ``peers.md`` pins the versions.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from benchmarks.vllm_ttft.engine import (CHUNK, GBIT, delivered_gbit, generate, kv_dtype, on_gpu, phase_left, shape_of, timing_model,
                                         ttft_prompts, watchdog)
from benchmarks.vllm_ttft.report import link_label

PEERS = ("native-cpu", "lmcache-raw", "lmcache-cachegen")  # phase peer-<name>
SERDE = {"lmcache-raw": "naive", "lmcache-cachegen": "cachegen"}  # LMCache's remote_serde per method
# LMCache's remote connector per method (0.5.6's S3 connector stores full raw chunks only: peers.md)
REMOTE = {"lmcache-raw": "s3", "lmcache-cachegen": "lm"}
LINK = {"s3": "LMCache's S3 connector to the link server", "lm": "LMCache's lm:// connector to its own server through a paced TCP relay"}
NUDGE = list(range(1000, 1000 + CHUNK + 7))  # a short request that steps the engine (one chunk of it is stored)
UPLOAD_QUIET_S = 1.0  # uploads have ended once the link received nothing for this long
CPU_UNSUPPORTED = ("vLLM's CPU offloading worker copies between CUDA/XPU blocks and pinned host memory only "
                   "(vllm/v1/kv_offload/cpu/gpu_worker.py asserts gpu_tensor.is_cuda or is_xpu): no CPU run")


def offloading_config(cpu_bytes: int, block_tokens: int = CHUNK) -> dict:
    """vLLM's ``OffloadingConnector`` with its CPU tier (``CPUOffloadingSpec``): ``cpu_bytes`` of
    host memory, offloaded in blocks of ``block_tokens`` (a multiple of vLLM's GPU block)."""
    if cpu_bytes <= 0 or block_tokens <= 0:
        raise ValueError(f"cpu_bytes and block_tokens must be positive, got {cpu_bytes}, {block_tokens}")
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": int(cpu_bytes), "block_size": int(block_tokens)}}


def lmcache_settings(method: str, link_url: str, chunk_tokens: int = CHUNK) -> dict:
    """LMCache's configuration (its YAML keys) for ``method``: chunks of ``chunk_tokens``, no local
    CPU tier, the method's serde, its remote (:data:`REMOTE`) at ``link_url``'s host: ``s3://``
    at the link server (which takes LMCache's bucketless paths: ``bucket=``), ``lm://`` at the
    relay in front of LMCache's server."""
    if method not in SERDE:
        raise ValueError(f"not an LMCache method: {method!r} (one of {', '.join(SERDE)})")
    host = urlsplit(link_url).netloc
    if not host:
        raise ValueError(f"the link's URL has no host: {link_url!r}")
    cfg = {"chunk_size": chunk_tokens, "local_cpu": False, "max_local_cpu_size": 8.0, "remote_url": f"{REMOTE[method]}://{host}",
           "remote_serde": SERDE[method], "save_unfull_chunk": False}
    if REMOTE[method] == "s3":
        cfg["extra_config"] = {"s3_region": "us-east-1", "disable_tls": True, "s3_prefer_http2": False,
                               "aws_access_key_id": "bench", "aws_secret_access_key": "bench"}
    return cfg


def lmcache_connector() -> dict:
    """vLLM's ``LMCacheConnectorV1``, which loads LMCache's own adapter (configured by the file in
    ``LMCACHE_CONFIG_FILE``)."""
    return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}


def start_lm_server(log: Path, timeout_s: float) -> tuple[subprocess.Popen, int]:
    """LMCache's own remote server (``python -m lmcache.v1.server HOST PORT cpu``: objects in its
    memory, with their length, format and shape) on a loopback port: (process, port), once it
    accepts connections."""
    from benchmarks.lib.linkserver import free_port

    port = free_port()
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"], stdout=f, stderr=subprocess.STDOUT)
    deadline = time.time() + timeout_s
    while proc.poll() is None and time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"LMCache's server did not start (exit {proc.poll()}): {log}")


class HttpLink:
    """The link server's control (``/_link``) as a link object: ``set_rate``, ``stats``, ``url``."""

    def __init__(self, url: str):
        self.url = url

    def set_rate(self, rate: float) -> None:
        from benchmarks.lib import linkserver

        linkserver.set_rate(self.url, rate)

    def stats(self) -> dict:
        from benchmarks.lib import linkserver

        return linkserver.stats(self.url)


def missing(method: str) -> str | None:
    """Why ``method`` cannot run here, or None."""
    if method not in PEERS:
        raise ValueError(f"not a peer method: {method!r} (one of {', '.join(PEERS)})")
    if method in SERDE and importlib.util.find_spec("lmcache") is None:
        return "not installed: lmcache (benchmarks/vllm_ttft/peers.md)"
    if method == "native-cpu" and not on_gpu():
        return CPU_UNSUPPORTED
    return None


def kv_bytes_per_token(shape, dtype: str) -> int:
    """The KV of one token across all layers, uncompressed (what a CPU tier holds)."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * (2 if dtype in ("bfloat16", "float16") else 4)


def start_peer_llm(model_dir: Path, kv_transfer_config: dict, *, max_model_len: int, timeout_s: float, **kw):
    """``vllm.LLM`` with a peer's connector, vLLM's prefix cache on (a peer hashes blocks as vLLM
    does); bf16 on a GPU, fp32 on a CPU."""
    from vllm import LLM

    opts = dict(dtype="bfloat16", gpu_memory_utilization=0.85) if on_gpu() else dict(dtype="float32")
    with watchdog(timeout_s, "engine start"):
        return LLM(model=str(model_dir), enforce_eager=True, max_model_len=max_model_len, enable_prefix_caching=True,
                   kv_transfer_config=kv_transfer_config, **opts, **kw)


def clear_gpu_cache(llm, timeout_s: float, nudge: list[int]) -> None:
    """Empty vLLM's GPU prefix cache; a peer's pending store holds blocks until it ends, so short
    requests (``nudge``) step the engine until the reset succeeds."""
    deadline = time.time() + timeout_s
    while not llm.reset_prefix_cache():
        if time.time() > deadline:
            raise RuntimeError("vLLM's prefix cache could not be reset (a store never finished)")
        generate(llm, [nudge], 1, {}, timeout_s)


def phase_peer(a, work: Path) -> dict:
    """One peer (``a.phase`` = ``peer-<method>``) on the ``ttft`` prompts: per context, store once,
    then per link clear the GPU cache and time the same prompt again."""
    method = a.phase.removeprefix("peer-")
    res = {"method": method, "chunk_tokens": CHUNK, "rows": []}
    if why := missing(method):
        print(f"{method}: {why}", flush=True)
        return dict(res, unavailable=why)
    model_dir, opts = timing_model(a.tiny, work)
    shape, contexts = shape_of(model_dir), [int(x) for x in a.contexts.split(",")]
    prompts = ttft_prompts(contexts, shape.vocab)
    links = [float(x) for x in a.links.split(",")]
    res.update(model=model_dir.name, kv_dtype=kv_dtype())
    if method == "native-cpu":
        cpu_bytes = int(1.5 * sum(len(p) for p in prompts.values()) * kv_bytes_per_token(shape, kv_dtype()))
        llm = start_peer_llm(model_dir, offloading_config(cpu_bytes), max_model_len=max(contexts) + 256, timeout_s=a.start_timeout_s, **opts)
        res["cpu_bytes_to_use"] = cpu_bytes
        res["rows"] = cells(a, llm, prompts, links, None, kv_bytes_per_token(shape, kv_dtype()))
        return res
    with lmcache_remote(method, a, work) as link:
        res["link"] = LINK[REMOTE[method]]
        llm = start_peer_llm(model_dir, lmcache_connector(), max_model_len=max(contexts) + 256, timeout_s=a.start_timeout_s, **opts)
        res["rows"] = cells(a, llm, prompts, links, link, None)
    return res


@contextlib.contextmanager
def lmcache_remote(method: str, a, work: Path):
    """LMCache's remote for ``method`` behind the paced link (the link server for S3; LMCache's own
    server behind a relay for ``lm://``), and ``LMCACHE_CONFIG_FILE`` naming its settings for the
    engine started inside; yields the link (``set_rate``, ``stats``, ``url``); stops both after."""
    from benchmarks.lib import linkrelay, linkserver

    stops = []
    try:
        if REMOTE[method] == "s3":
            url, server = linkserver.start_process(work / f"{a.phase}-s3", procs=a.link_procs or linkserver.default_procs(), bucket="lmcache")
            stops.append(server.terminate)
            link = HttpLink(url)
        else:
            lm, port = start_lm_server(work / f"{a.phase}-lmserver.log", a.start_timeout_s)
            stops.append(lambda: (lm.kill(), lm.wait(10)))
            link = linkrelay.Relay(("127.0.0.1", port))
            stops.append(link.terminate)
        cfg = work / f"{a.phase}.yaml"
        cfg.write_text(json.dumps(lmcache_settings(method, link.url)))  # JSON is YAML
        os.environ["LMCACHE_CONFIG_FILE"] = str(cfg)
        yield link
    finally:
        for stop in reversed(stops):
            stop()


def cells(a, llm, prompts: dict[int, list[int]], links: list[float], link, bytes_per_token: int | None) -> list[dict]:
    """Per context: the storing request, then per link the second request's TTFT. ``link``
    (``set_rate``, ``stats``; None: not over a link, one row per link all the same): stores
    unpaced, bytes stored per token from its uploads (counted from a snapshot taken once the
    previous uploads have stopped), ``delivered_gbit`` its bytes sent during the load over the
    load's TTFT (a lower bound: the link is idle for part of it). Without a link, bytes stored
    are ``bytes_per_token`` a stored token (the CPU tier's uncompressed copy)."""
    rows, nudge = [], NUDGE
    generate(llm, [[t + 1 for t in prompts[min(prompts)]]], 1, {}, a.call_timeout_s)  # warm-up (kernels, a first store), no prompt's prefix
    generate(llm, [nudge], 1, {}, a.call_timeout_s)  # the nudge's chunk stored now, not inside a context's count
    for n, prompt in prompts.items():
        if phase_left() < 60 + a.cap_s:
            rows += [dict(link_gbit=g, context=n, skipped="not run: the phase's time ran out") for g in links]
            continue
        if link:
            link.set_rate(0)  # stores go at full speed: only loads are paced
        before = wait_uploads(link, a.call_timeout_s) if link else {}  # the warm-up's or the last context's store still uploads
        clear_gpu_cache(llm, a.call_timeout_s, nudge)
        store_s, [(_, first_cached)] = generate(llm, [prompt], 1, {}, a.call_timeout_s)
        clear_gpu_cache(llm, a.call_timeout_s, nudge)  # also waits for the store to finish
        if link:
            stored = wait_uploads(link, a.call_timeout_s)["bytes_received"] - before["bytes_received"]
        else:
            stored = bytes_per_token * ((n - 1) // CHUNK * CHUNK)
        for gbit in links:
            if link:
                link.set_rate(gbit * GBIT)
            sent0 = link.stats()["bytes_sent"] if link else 0
            s, [(_, cached)] = generate(llm, [prompt], 1, {}, a.call_timeout_s)
            sent = (link.stats()["bytes_sent"] - sent0) if link else 0
            clear_gpu_cache(llm, a.call_timeout_s, nudge)
            rows.append(dict(link_gbit=gbit, context=n, ttft_s=round(s, 4), loaded_tokens=cached, store_request_s=round(store_s, 4),
                             first_request_cached=first_cached, stored_bytes_per_token=round(stored / n, 1), link_bytes_sent=sent,
                             delivered_gbit=delivered_gbit(sent, s) if link else None, over_link=link is not None))
            print(f"{link_label(gbit):>12} {n:>6} tokens {a.phase}: {s:7.3f} s, loaded {cached}, stored {stored / n:.0f} B/token, "
                  f"delivered >= {rows[-1]['delivered_gbit'] or 0:.2f} Gbit/s", flush=True)
    return rows


def wait_uploads(link, timeout_s: float, quiet_s: float | None = None) -> dict:
    """``link``'s stats once its uploads have stopped for ``quiet_s`` (default
    :data:`UPLOAD_QUIET_S`; a store ends in the background)."""
    quiet_s = UPLOAD_QUIET_S if quiet_s is None else quiet_s
    deadline, last = time.time() + timeout_s, link.stats()
    while time.time() < deadline:
        time.sleep(quiet_s)
        now = link.stats()
        if now["bytes_received"] == last["bytes_received"]:
            return now
        last = now
    return last
