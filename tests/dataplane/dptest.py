"""Helpers shared by the data-plane tests (import as ``from dptest import ...``); fixtures are in conftest."""

from __future__ import annotations

import asyncio
import http.client
import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from aiohttp import ClientSession, web

from kvfetcher.fetch import executor
from kvfetcher.kvbuffer import ChunkRef
from kvfetcher.chunk import encode_chunk
from kvfetcher.api.server import Embedded
from kvfetcher.config import Config
from kvfetcher.service import Sidecar
from kvtest import free_port as closed_port  # noqa: F401  (a port nothing listens on, for the tests)

logging.getLogger("werkzeug").setLevel(logging.WARNING)

SENTINEL = 1234.0  # what a destination holds before a fetch, to see what was written
TOKEN = "test-token-" + uuid.uuid4().hex
PROMPT_TOKENS = 300
CHUNK = 128
NEW = 8


def new_bucket(endpoint: str, **kw):
    from kvfetcher.store.s3 import S3Store  # lazily: the GPU image has no minio

    return S3Store(endpoint, f"b-{uuid.uuid4().hex[:12]}", "testing", "testing", create_bucket=True, **kw)


def raw_request(port, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse()
    return r.status, r.read()


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
            await web.TCPSite(self.runner, "127.0.0.1", 0).start()
            self.port = self.runner.addresses[0][1]
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


@contextmanager
def sidecar(store, **config):
    config.setdefault("chunk_tokens", CHUNK)
    config.setdefault("presets", ("raw",))
    with Embedded(Sidecar(store, Config(**config)), TOKEN) as e:
        yield e


def put_chunks(store, kv, chunk, preset="raw", fingerprint="fp"):
    refs = []
    for i in range(kv.shape[3] // chunk):
        obj = encode_chunk(kv[:, :, :, i * chunk : (i + 1) * chunk].contiguous(), preset, fingerprint)
        name = f"kv/{i:04d}/{preset}.kvfc"
        store.put(name, obj)
        refs.append(ChunkRef(name, len(obj), i * chunk, chunk))
    return refs


async def fetch(store, refs, dest, **kw):
    with ThreadPoolExecutor(8) as io, ThreadPoolExecutor(2) as dec:
        return await executor.fetch(store, refs, dest, fingerprint=kw.pop("fingerprint", "fp"), io_pool=io, decode_pool=dec, **kw)
