"""Data-plane fixtures: a real S3 server on loopback, a rate-limited HTTP proxy in front of it,
embedded sidecars, and the real model's KV for a short prompt (one model per session)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import uuid
from contextlib import contextmanager

import pytest
import torch
from aiohttp import ClientSession, web

from kvfetcher import model
from kvfetcher.server import Embedded
from kvfetcher.service import Config, Sidecar
from kvfetcher.store.s3 import S3Store

logging.getLogger("werkzeug").setLevel(logging.WARNING)

TOKEN = "test-token-" + uuid.uuid4().hex
PROMPT_TOKENS = 300
CHUNK = 128
NEW = 8


@pytest.fixture(scope="session")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def new_bucket(endpoint: str, **kw) -> S3Store:
    return S3Store(endpoint, f"b-{uuid.uuid4().hex[:12]}", "testing", "testing", create_bucket=True, **kw)


@pytest.fixture
def s3(s3_endpoint) -> S3Store:
    return new_bucket(s3_endpoint)


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class SlowProxy:
    """A real HTTP reverse proxy in front of the S3 server: limits response bandwidth and can run
    a hook before forwarding a request (e.g. delete an object once its header has been read)."""

    def __init__(self, upstream: str, bytes_per_s: float = float("inf")):
        self.upstream, self.rate, self.hook = upstream, bytes_per_s, None
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def main():
            self.session = ClientSession(auto_decompress=False)
            app = web.Application(client_max_size=1 << 30)
            app.router.add_route("*", "/{tail:.*}", self.forward)
            self.runner = web.AppRunner(app, access_log=None)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            started.set()

        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(main(), self.loop)
        started.wait(10)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    async def forward(self, request: web.Request) -> web.StreamResponse:
        if self.hook:
            await asyncio.get_running_loop().run_in_executor(None, self.hook, request.method, request.path, request.headers.get("Range"))
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("connection", "transfer-encoding")}
        async with self.session.request(request.method, self.upstream + request.path_qs, headers=headers, data=body) as r:
            out = web.StreamResponse(status=r.status)
            for k, v in r.headers.items():
                if k.lower() not in ("connection", "transfer-encoding", "content-encoding", "date", "server"):
                    out.headers[k] = v
            await out.prepare(request)
            async for piece in r.content.iter_chunked(32 * 1024):
                await out.write(piece)
                if self.rate != float("inf"):
                    await asyncio.sleep(len(piece) / self.rate)
            await out.write_eof()
            return out

    def close(self):
        async def stop():
            await self.session.close()
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def slow_proxy(s3_endpoint):
    proxies = []

    def make(bytes_per_s=float("inf")):
        p = SlowProxy(s3_endpoint, bytes_per_s)
        proxies.append(p)
        return p

    yield make
    for p in proxies:
        p.close()


@contextmanager
def sidecar(store, **config):
    config.setdefault("chunk_tokens", CHUNK)
    config.setdefault("presets", ("raw",))
    with Embedded(Sidecar(store, Config(**config)), TOKEN) as e:
        yield e


@pytest.fixture(scope="session")
def prompt(lm):
    """A short real prompt, its model KV (fp16, as a server's cache holds it) and the reference
    continuation generated from a plain full prefill."""
    ids = model.tokenize(lm, model.sample_text("license.txt"), PROMPT_TOKENS)
    kv, _ = model.prefill(lm, ids)
    reference = model.greedy(lm, ids, kv, NEW)
    return ids, kv.to(torch.float16), reference
