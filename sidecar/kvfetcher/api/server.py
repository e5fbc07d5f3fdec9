"""server: the sidecar's HTTP API (aiohttp), on TCP and/or a Unix socket.

The endpoints and their messages are defined once, in :mod:`kvfetcher.api.schemas` (rendered as
docs/api.md); each handler parses its request with the schema and answers with a schema message.

Authentication: ``/v1`` requests over TCP need ``Authorization: Bearer <token>`` (the scheme in
any case), the token coming from ``KVFETCHER_AUTH_TOKEN`` or the file named by
``KVFETCHER_AUTH_TOKEN_FILE`` (a mounted Secret, re-read when it changes: rotation needs no
restart). Without a token configured, TCP ``/v1`` requests are refused. Checking a header never
raises, whatever its bytes. Requests over the Unix socket are trusted: the socket file's
permissions (0660) are the authentication, and it is never connectable by anyone else, not
even between bind and chmod (:func:`bind_unix`). Probes and ``/metrics`` are open, as kubelet and
Prometheus expect; the readiness probe is ``/servingz`` (:mod:`kvfetcher.api.health`), never the
store's health; an unready ``/readyz`` (the store's health) names only the reason, never the store's endpoint,
bucket or error text (those are logged).

Buffers: ``POST /v1/buffers`` registers CUDA handles only. A host-memory buffer is a sealed
memfd whose fd is passed (``SCM_RIGHTS``) on the *buffer socket* beside the Unix socket
(:func:`kvfetcher.ipc.fd_socket`, same permissions), one connection per registration: the
client sends a ``RegisterRequest`` with the fd and gets a ``RegisterReply`` or ``ErrorReply``.
No request can name memory by a path or by a number.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import signal
import socket
import tempfile
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web

from kvfetcher import config, ipc
from kvfetcher.api import health, schemas
from kvfetcher.config import Config
from kvfetcher.errors import Reason, RequestError
from kvfetcher.service import Sidecar
from kvfetcher.store import from_env

log = logging.getLogger("kvfetcher.api.server")

class Token:
    """The bearer token: a fixed ``value``, or the contents of the file ``path``, read again
    whenever the file changes (its inode, size or modification time). A file that cannot be read
    keeps the last token read; "" means no token."""

    def __init__(self, value: str | None = None, path: str | None = None):
        self.path, self._value, self._seen = path, (value or "").strip(), None
        if path:
            self.current()

    def current(self) -> str:
        if self.path:
            try:
                st = os.stat(self.path)
                seen = (st.st_ino, st.st_size, st.st_mtime_ns)
                if seen != self._seen:
                    self._value, self._seen = Path(self.path).read_text().strip(), seen
            except (OSError, UnicodeDecodeError) as e:
                log.warning("cannot read the token file %s (%s): keeping the last token", self.path, e)
        return self._value


LISTENERS = web.AppKey("listeners", list)  # buffer-socket accept loops, ended at cleanup
RECEIVE_TIMEOUT_S = 10.0  # a client on the buffer socket that sends its whole registration slower is dropped
BUFFER_CONNECTIONS = 4  # registrations on the buffer socket served at once


def token_from_env(env: Mapping[str, str] | None = None) -> Token:
    token, path = config.AUTH_TOKEN.read(env), config.AUTH_TOKEN_FILE.read(env)
    return Token(token) if token else Token(path=path)


SIDECAR = web.AppKey("sidecar", Sidecar)
TOKEN = web.AppKey("token", Token)


def _bearer(header: str) -> bytes | None:
    """The credentials of an ``Authorization: Bearer ...`` header (any case), as bytes; None for another scheme."""
    scheme, _, credentials = header.strip().partition(" ")
    return credentials.strip().encode("utf-8", "surrogatepass") if scheme.lower() == "bearer" else None


def _over_unix_socket(request: web.Request) -> bool:
    return isinstance(request.transport.get_extra_info("sockname") if request.transport else None, str)


@web.middleware
async def auth(request: web.Request, handler):
    if not request.path.startswith("/v1/") or _over_unix_socket(request):
        return await handler(request)
    token = request.app[TOKEN].current()
    if not token:
        return _error(401, "unauthenticated", "no token is configured: use the Unix socket or set KVFETCHER_AUTH_TOKEN")
    given = _bearer(request.headers.get("Authorization", ""))
    if given is None or not hmac.compare_digest(given, token.encode()):
        return _error(401, "unauthenticated", "missing or wrong bearer token")
    return await handler(request)


def _error(status: int, reason: str, detail: str) -> web.Response:
    return web.json_response(schemas.to_json(schemas.ErrorReply(reason, detail)), status=status)


#: bytes of JSON per token (an int64 and a comma) and beside the tokens: a body's limit is tied to
#: the token cap; bodies above PARSE_INLINE_BYTES are parsed and checked off the event loop
BYTES_PER_TOKEN, BODY_OVERHEAD, PARSE_INLINE_BYTES = 21, 1 << 20, 64 << 10


def body_limit(max_request_tokens: int) -> int:
    """The largest request body read: ``max_request_tokens`` tokens and a fixed allowance."""
    return max_request_tokens * BYTES_PER_TOKEN + BODY_OVERHEAD


def _decode(raw: bytes, cls: type):
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError("body must be JSON") from None
    except RecursionError:
        raise RequestError(f"the body nests deeper than {schemas.MAX_DEPTH} levels") from None
    schemas.check_depth(body)
    return schemas.from_json(cls, body)


async def _parse(request: web.Request, cls: type):
    raw = await request.read()
    if len(raw) <= PARSE_INLINE_BYTES:
        return _decode(raw, cls)
    return await asyncio.get_running_loop().run_in_executor(None, _decode, raw, cls)


def _reply(msg, status: int = 200) -> web.Response:
    return web.json_response(schemas.to_json(msg), status=status)


@web.middleware
async def errors(request: web.Request, handler):
    try:
        return await handler(request)
    except (RequestError, ValueError, TypeError) as e:  # a malformed request, never a crash
        reason = e.reason if isinstance(e, RequestError) else Reason.BAD_REQUEST  # no_device: a CUDA handle it cannot open
        request.app[SIDECAR].metrics.errors.labels(reason).inc()
        return _error(400, reason.value, str(e))


async def register(request: web.Request) -> web.Response:
    r = await _parse(request, schemas.RegisterRequest)
    handle = r.buffer_handle()
    if any(h.get("kind") != "cuda" for h in r.handles or [r.handle]):  # a memfd handle names the holder's fd: only the buffer socket passes one
        raise RequestError("over HTTP only a CUDA handle registers (one per paged tensor); a host-memory buffer is a sealed memfd passed "
                           "on the sidecar's buffer socket (KVClient over the Unix socket does it)")
    if r.engine is not None:
        raise RequestError("an engine that decodes itself registers a host buffer: a memfd passed on the sidecar's buffer socket")
    return _reply(schemas.RegisterReply(request.app[SIDECAR].register(handle, r.model, r.tp_rank)))


async def _register_passed(sidecar: Sidecar, conn: socket.socket, pool: ThreadPoolExecutor) -> None:
    """One registration on the buffer socket: a ``RegisterRequest`` whose handle gives ``shape`` and
    ``dtype``, the memfd itself passed with it; answered with a ``RegisterReply`` or ``ErrorReply``.
    Or a ``LeaseRequest`` with the registering process' pidfd, answered ``Ok`` (:meth:`Sidecar.lease`)."""
    loop, fd = asyncio.get_running_loop(), None
    try:
        message, fd = await loop.run_in_executor(pool, ipc.receive_buffer, conn, RECEIVE_TIMEOUT_S)
        schemas.check_depth(message)
        if isinstance(message, dict) and "lease" in message:
            lease = schemas.from_json(schemas.LeaseRequest, message)
            if fd is None or not ipc.is_pidfd(fd):
                raise RequestError("a lease passes one pidfd: of the process that registered the buffer")
            passed, fd = fd, None  # Sidecar.lease owns it from here, refused or not
            sidecar.lease(lease.lease, passed)
            reply = schemas.Ok(True)
        else:
            r = schemas.from_json(schemas.RegisterRequest, message)
            if fd is None or r.paged is not None or r.handle is None or r.handle.get("kind") != "memfd":
                raise RequestError("pass exactly one memfd with a flat buffer's registration whose handle is of kind 'memfd' "
                                   "(paged buffers register CUDA handles over HTTP)")
            handle = ipc.memfd_handle(fd, r.handle.get("shape", []), r.handle.get("dtype"))
            reply = schemas.RegisterReply(sidecar.register(handle, r.model, r.tp_rank, r.engine))
    except (RequestError, ValueError, TypeError, OSError) as e:
        sidecar.metrics.errors.labels(Reason.BAD_REQUEST).inc()
        reply = schemas.ErrorReply(Reason.BAD_REQUEST.value, str(e))
    except Exception as e:  # never the accept loop's end
        log.exception("buffer registration failed")
        reply = schemas.ErrorReply(Reason.INTERNAL.value, f"{type(e).__name__}: {e}")
    finally:
        if fd is not None:
            os.close(fd)  # the sidecar holds its own (ipc.adopt)
    try:
        conn.settimeout(RECEIVE_TIMEOUT_S)
        await loop.run_in_executor(pool, conn.sendall, json.dumps(schemas.to_json(reply)).encode())
    except OSError:  # the client is gone: no one can name its registration any more
        if isinstance(reply, schemas.RegisterReply):
            sidecar.unregister(reply.buffer)
    finally:
        conn.close()


async def _serve_buffer_socket(sidecar: Sidecar, server: socket.socket) -> None:
    """Registrations on the buffer socket, in threads of their own (a slow client delays no other
    work of the sidecar); at most BUFFER_CONNECTIONS at a time, others wait to be accepted."""
    loop, pending = asyncio.get_running_loop(), set()
    pool = ThreadPoolExecutor(BUFFER_CONNECTIONS, thread_name_prefix="kvfetcher-buffers")
    try:
        while True:
            while len(pending) >= BUFFER_CONNECTIONS:
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            conn, _ = await loop.sock_accept(server)
            task = asyncio.ensure_future(_register_passed(sidecar, conn, pool))
            pending.add(task)
            task.add_done_callback(pending.discard)
    finally:
        server.close()
        pool.shutdown(wait=False, cancel_futures=True)


async def unregister(request: web.Request) -> web.Response:
    request.app[SIDECAR].unregister(request.match_info["id"])
    return _reply(schemas.Ok(True))


async def lookup(request: web.Request) -> web.Response:
    r = await _parse(request, schemas.LookupRequest)
    sc = request.app[SIDECAR]
    if r.buffer is not None:
        target = r.buffer
    elif r.model is not None and r.dtype is not None:
        target = sc.namespace(r.model, r.dtype, r.tp_rank, r.kv_shape)
    else:
        raise RequestError("give 'buffer', or 'model' and 'dtype' (and 'tp_rank')")
    plan = await sc.lookup(target, r.tokens, r.options)
    return _reply(schemas.LookupReply(plan.hit_tokens, plan.chunk_tokens, plan, plan.error, plan.detail if plan.error else None))


async def fetch(request: web.Request) -> web.Response:
    r = await _parse(request, schemas.FetchRequest)
    reply = await request.app[SIDECAR].fetch(r.buffer, r.tokens, r.plan, slots=r.slots, offset=r.offset, block_ids=r.block_ids,
                                             first_token=r.first_token, options=r.options, decoded=r.decoded or ())
    return _reply(reply)


async def store(request: web.Request) -> web.Response:
    r = await _parse(request, schemas.StoreRequest)
    reply = await request.app[SIDECAR].store(r.buffer, r.tokens, slots=r.slots, offset=r.offset, block_ids=r.block_ids,
                                             first_token=r.first_token)
    return _reply(schemas.StoreReply(**reply), status=202)


async def flush(request: web.Request) -> web.Response:
    await request.app[SIDECAR].flush()
    return _reply(schemas.Ok(True))


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    """The store's health, for people and dashboards: no probe asks it (:mod:`kvfetcher.api.health`)."""
    reason, detail = await health.check_store(request.app[SIDECAR])
    if reason is not None:  # the detail (endpoint, bucket, error text) goes to the log, not to an unauthenticated caller
        log.warning("not ready (%s): %s", reason, detail)
        return web.Response(status=503, text=f"store not ready: {reason}\n")
    return web.Response(text="ready\n")


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[SIDECAR].metrics.exposition(), content_type="text/plain", charset="utf-8")


def make_app(sidecar: Sidecar, token: str | Token | None) -> web.Application:
    app = web.Application(middlewares=[auth, errors], client_max_size=body_limit(sidecar.config.max_request_tokens))
    app[SIDECAR] = sidecar
    app[TOKEN] = token if isinstance(token, Token) else Token(token)
    app[LISTENERS] = []
    app[health.SOCKETS] = []

    async def lifecycle(app: web.Application):
        await sidecar.start()
        watch = asyncio.ensure_future(health.watch_store(sidecar, config.STORE_CHECK_S.read()))
        yield
        watch.cancel()
        for task in app[LISTENERS]:
            task.cancel()
        await sidecar.close()

    app.cleanup_ctx.append(lifecycle)
    handlers = {schemas.REGISTER: register, schemas.UNREGISTER: unregister, schemas.LOOKUP: lookup, schemas.FETCH: fetch,
                schemas.STORE: store, schemas.FLUSH: flush}
    app.add_routes(
        [web.route(e.method, e.path, handlers[e]) for e in schemas.ENDPOINTS]
        + [
            web.get("/healthz", healthz),
            web.get("/readyz", readyz),
            web.get("/servingz", health.serving),
            web.get("/metrics", metrics),
        ]
    )
    return app


async def start(
    app: web.Application, host: str | None = "127.0.0.1", port: int | None = 0, socket_path: str | None = None
) -> tuple[web.AppRunner, dict]:
    """Start serving; returns the runner and where it listens ({"port": n, "socket": path})."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    where: dict = {}
    if port is not None:
        await web.TCPSite(runner, host, port).start()
        where["port"] = runner.addresses[0][1]
    if socket_path:
        await web.SockSite(runner, bind_unix(socket_path)).start()
        runner.app[health.SOCKETS].append(socket_path)
        buffers = bind_unix(ipc.fd_socket(socket_path))
        runner.app[LISTENERS].append(asyncio.ensure_future(_serve_buffer_socket(runner.app[SIDECAR], buffers)))
        where["socket"] = socket_path
    return runner, where


def bind_unix(path: str, mode: int = 0o660) -> socket.socket:
    """A listening Unix socket at ``path`` that no one outside ``mode`` can connect to at any instant:
    bound in a fresh 0700 directory beside ``path``, given ``mode``, then renamed into place (over
    whatever was there, never through it)."""
    parent = Path(path).parent
    parent.mkdir(parents=True, exist_ok=True)
    private = tempfile.mkdtemp(prefix=".kvfetcher-", dir=parent)  # 0700 under any umask
    bound = os.path.join(private, "s")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(bound)
        os.chmod(bound, mode)
        os.rename(bound, path)
        sock.listen()
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    finally:
        Path(bound).unlink(missing_ok=True)
        os.rmdir(private)
    return sock


async def serve_forever(host: str, port: int | None, socket_path: str | None) -> None:
    """``kvfetcher serve``: configuration from the environment the operator injects."""
    sidecar = Sidecar(from_env(record_access=True), Config.from_env())
    token = token_from_env()
    if port is not None and not token.current():
        log.warning("no KVFETCHER_AUTH_TOKEN: the TCP API refuses /v1 requests; use the Unix socket")
    runner, where = await start(make_app(sidecar, token), host, port, socket_path)
    log.info("kvfetcher sidecar listening on %s (store %s)", where, sidecar.objects.endpoint)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def register_cli(sub) -> None:
    p = sub.add_parser("serve", help="run the sidecar (store from KVFETCHER_S3_* or KVFETCHER_STORE_DIR)")
    p.add_argument("--host", default="0.0.0.0", help="TCP address (probes and Prometheus need the pod IP)")
    p.add_argument("--port", type=int, default=8500, help="TCP port; -1 for none")
    p.add_argument("--socket", default=None, help="Unix socket path, e.g. /run/kvfetcher/kvfetcher.sock")

    def run(args) -> int:
        asyncio.run(serve_forever(args.host, None if args.port < 0 else args.port, args.socket))
        return 0

    p.set_defaults(func=run)


class Embedded:
    """A sidecar serving on loopback from a background thread (the demo; tests with sync clients).
    Without ``socket_path`` its Unix socket is in a private temporary directory: ``socket`` names
    it (host-memory buffers register over it)."""

    def __init__(self, sidecar: Sidecar, token: str | None = None, socket_path: str | None = None, port: int | None = 0):
        self.sidecar, self.token = sidecar, token
        self._tmp = None if socket_path else tempfile.TemporaryDirectory(prefix="kvfetcher-")
        self.socket = socket_path = socket_path or os.path.join(self._tmp.name, "kvfetcher.sock")
        self.loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        started = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            self._stop = asyncio.Event()
            try:
                runner, self.where = await start(make_app(sidecar, token), "127.0.0.1", port, socket_path)
            except BaseException as e:
                failure.append(e)
                started.set()
                return
            started.set()
            await self._stop.wait()
            await runner.cleanup()

        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),), daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            raise failure[0]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.where['port']}"

    def close(self) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)
        self.loop.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> "Embedded":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
