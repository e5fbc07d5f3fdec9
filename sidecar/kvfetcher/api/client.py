"""client: the model side of the sidecar: lookup, fetch and store, as the HTTP API says.

* :meth:`KVClient.lookup` — the scheduler's question, "what of this prompt would you fetch, and how
  long would it take?" (vLLM's ``get_num_new_matched_tokens``), answered with a plan;
  :meth:`KVClient.hit_tokens` is only its hit count;
* :meth:`KVClient.fetch` — the worker's "fetch them into these slots (or blocks) of my KV buffers",
  given the plan (the store is then not listed again) or not; it answers with how many tokens were
  really loaded (the rest is recomputed);
* :meth:`KVClient.store` — "store this prefix", which returns at once.

Messages are those of :mod:`kvfetcher.api.schemas`. Synchronous (model code is), one keep-alive
connection per client, over TCP with a bearer token or over the sidecar's Unix socket.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
from collections.abc import Mapping, Sequence

import torch

from kvfetcher import config, ipc
from kvfetcher.api import schemas
from kvfetcher.fetch.plan import EngineDecode, EngineDecoded, FetchOptions, FetchPlan, FetchReply
from kvfetcher.kvbuffer import PagedLayout


def _ints(xs: Sequence[int] | None) -> list[int] | None:
    return None if xs is None else [int(x) for x in xs]


class SidecarError(RuntimeError):
    def __init__(self, status: int, reason: str, detail: str):
        super().__init__(f"sidecar answered {status} {reason}: {detail}")
        self.status, self.reason, self.detail = status, reason, detail

    @property
    def no_device(self) -> bool:
        """A CUDA handle refused because the sidecar cannot open it (no CUDA device, or not the
        buffer's): register host memory instead. Older sidecars say so only in the detail."""
        return self.reason == "no_device" or "needs a sidecar with CUDA" in self.detail


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


class KVClient:
    def __init__(
        self,
        url: str | None = None,
        *,
        socket_path: str | None = None,
        token: str | None = None,
        timeout_s: float = 60.0,
    ):
        if not url and not socket_path:
            raise ValueError("give the sidecar's url or its Unix socket path")
        if url:
            u = http.client.urlsplit(url)
            self._connect = lambda: http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout_s)
        else:
            self._connect = lambda: _UnixConnection(socket_path, timeout_s)
        self._socket_path, self._timeout_s = (None if url else socket_path), timeout_s
        self.token = token if token is not None else config.AUTH_TOKEN.read()
        self._local = threading.local()  # each thread its own kept-alive connection: requests never queue
        self._conns: list[http.client.HTTPConnection] = []  # every thread's, to close
        self._lock = threading.Lock()
        self.chunk_tokens: int | None = None  # learnt from the sidecar's replies

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "KVClient":
        """The sidecar the environment names: ``KVFETCHER_SOCKET`` (what the operator injects into
        the model container), else ``KVFETCHER_URL`` with ``KVFETCHER_AUTH_TOKEN``."""
        if config.SOCKET.read(env):
            return cls(socket_path=config.SOCKET.read(env), token=config.AUTH_TOKEN.read(env))
        return cls(config.URL.read(env), token=config.AUTH_TOKEN.read(env))

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = _json_body(body) if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        for attempt in (0, 1):  # a kept-alive connection may have been closed by the server
            conn = self._connection()
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                payload = resp.read()
                break
            except (ConnectionError, http.client.BadStatusLine, http.client.CannotSendRequest):
                self._drop(conn)
                if attempt:
                    raise
        try:
            reply = json.loads(payload) if payload else {}
        except json.JSONDecodeError:
            reply = {"error": "bad_reply", "detail": payload[:200].decode(errors="replace")}
        if resp.status >= 400:
            raise SidecarError(resp.status, reply.get("error", "error"), reply.get("detail", ""))
        return reply

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        with self._lock:
            if conn is None or conn not in self._conns:  # none yet, or closed by close()
                conn = self._local.conn = self._connect()
                self._conns.append(conn)
        return conn

    def _drop(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        self._local.conn = None
        with self._lock:
            if conn in self._conns:
                self._conns.remove(conn)

    def close(self) -> None:
        """Close every thread's connection (a thread's next request opens a new one)."""
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()

    def _call(self, endpoint: schemas.Endpoint, request=None, path: str | None = None):
        """One request of ``endpoint`` (fields left at None are not sent); its reply message."""
        body = {k: v for k, v in schemas.to_json(request).items() if v is not None} if request is not None else {}
        reply = schemas.from_json(endpoint.reply, self._request(endpoint.method, path or endpoint.path, body), strict=False)
        self.chunk_tokens = getattr(reply, "chunk_tokens", None) or self.chunk_tokens
        return reply

    # --- the API's verbs ---------------------------------------------------------------------

    def register(self, handle: dict, model: str, tp_rank: int = 0, engine: EngineDecode | None = None) -> str:
        """Register a KV buffer (see :mod:`kvfetcher.ipc`); returns its id for the other calls.
        With ``engine`` (a host buffer) this process decodes stored objects itself: fetches write
        them into the buffer (``FetchReply.objects``) instead of KV.

        The id is the registration's capability: whoever holds it may fetch into, store from and
        unregister the buffer, so keep it in this process: over the Unix socket the registration
        is leased to this process (:meth:`_lease`) and released when it exits. A host-memory buffer
        (a memfd handle from :func:`ipc.allocate`) is registered only over the Unix socket: its fd is
        passed on the sidecar's buffer socket, never named. A CUDA handle goes over either transport."""
        request = schemas.RegisterRequest(handle=handle, model=model, tp_rank=tp_rank, engine=engine)
        if handle.get("kind") != "memfd":
            bid = self._call(schemas.REGISTER, request).buffer
        elif self._socket_path is None:
            raise ValueError("a host-memory buffer is registered over the sidecar's Unix socket (its fd is passed), not TCP")
        else:
            described = {k: v for k, v in schemas.to_json(request).items() if v is not None}
            described["handle"] = {k: handle[k] for k in ("kind", "shape", "dtype")}
            reply = ipc.pass_buffer(ipc.fd_socket(self._socket_path), described, handle, self._timeout_s)
            if "error" in reply:
                raise SidecarError(400, reply["error"], reply.get("detail", ""))
            bid = schemas.from_json(schemas.RegisterReply, reply, strict=False).buffer
        self._lease(bid)
        return bid

    def _lease(self, bid: str) -> None:
        """Tie registration ``bid`` to this process (:class:`schemas.LeaseRequest`): the sidecar
        releases it when the process exits. Over the Unix socket only, where the kernel has pidfds;
        a lease refused or not sent leaves the registration as it is (it works without one)."""
        if self._socket_path is None or (fd := ipc.lease_fd()) is None:
            return
        try:
            ipc.pass_fd(ipc.fd_socket(self._socket_path), schemas.to_json(schemas.LeaseRequest(bid)), fd, self._timeout_s)
        except (OSError, ValueError):
            pass
        finally:
            os.close(fd)

    def register_tensor(self, t: torch.Tensor, model: str, tp_rank: int = 0) -> str:
        """Register a CUDA tensor by IPC handle (CPU buffers must come from :func:`ipc.allocate`)."""
        return self.register(ipc.cuda_handle(t), model, tp_rank)

    def register_paged(self, tensors: torch.Tensor | Sequence[torch.Tensor], layout: PagedLayout, model: str, tp_rank: int = 0) -> str:
        """Register a serving engine's paged KV on the GPU by CUDA IPC: one tensor holding every layer
        (``L`` in ``layout.dims``) or one per layer, in layer order (:class:`kvfetcher.kvbuffer.PagedLayout`);
        fetches and stores then name ``block_ids``. The sidecar restores straight into the blocks.
        On a CPU no process can map another's tensors: register a flat buffer (:meth:`register`)
        and copy with :func:`kvfetcher.kvbuffer.write_blocks` / ``read_blocks``."""
        handles = [ipc.cuda_handle(t) for t in ([tensors] if isinstance(tensors, torch.Tensor) else tensors)]
        one = "L" in layout.dims
        request = schemas.RegisterRequest(handle=handles[0] if one else None, handles=None if one else handles, model=model,
                                          tp_rank=tp_rank, paged=layout)
        return self._call(schemas.REGISTER, request).buffer

    def unregister(self, buffer: str) -> None:
        self._call(schemas.UNREGISTER, path=f"/v1/buffers/{buffer}")

    def lookup(self, buffer: str | None, tokens: Sequence[int], options: FetchOptions | None = None, *, model: str | None = None,
               dtype: str = "float16", tp_rank: int = 0, kv_shape: Sequence[int] | None = None) -> FetchPlan:
        """What a fetch of ``tokens`` would do, chosen as ``options`` say: pass it to :meth:`fetch` unchanged.

        Name the namespace by a registered ``buffer``, or (a scheduler with no buffers) by
        ``model``, ``dtype``, ``tp_rank`` and ``kv_shape`` (layers, kv_heads, head_dim; default: that
        of the sidecar's registered buffer of the model, dtype and rank). The sidecar answers from
        its index of the store without waiting on it (chunks it does not know are listed in the
        background), unless ``options.refresh``."""
        return self._lookup(buffer, tokens, options, model, dtype, tp_rank, kv_shape).plan

    def hit_tokens(self, buffer: str | None, tokens: Sequence[int], *, model: str | None = None, dtype: str = "float16", tp_rank: int = 0,
                   kv_shape: Sequence[int] | None = None, refresh: bool = True) -> int:
        """How many leading tokens of ``tokens`` are stored (a multiple of the chunk size), as the
        store says (``refresh``) or as the sidecar's index knows now: a :meth:`lookup`'s
        ``hit_tokens``."""
        return self._lookup(buffer, tokens, FetchOptions(refresh=refresh), model, dtype, tp_rank, kv_shape).tokens

    def _lookup(self, buffer, tokens, options, model, dtype, tp_rank, kv_shape) -> schemas.LookupReply:
        ns = dict(buffer=buffer) if buffer is not None else dict(model=model, dtype=dtype, tp_rank=tp_rank,
                                                                 kv_shape=tuple(map(int, kv_shape)) if kv_shape else None)
        return self._call(schemas.LOOKUP, schemas.LookupRequest(schemas.TokenIds.pack(tokens), **ns, options=options))

    def fetch(self, buffer: str, tokens: Sequence[int], plan: FetchPlan | None = None, *, options: FetchOptions | None = None,
              offset: int = 0, slots: Sequence[int] | None = None, block_ids: Sequence[int] | None = None, first_token: int = 0,
              decoded: Sequence[EngineDecoded] | None = None) -> FetchReply:
        """Fetch the stored leading chunks of ``tokens`` into the buffer at ``offset`` (or ``slots``;
        a paged buffer: into ``block_ids``, the prompt's blocks in order).

        With a ``plan`` from :meth:`lookup` (for this buffer's namespace and these tokens), the
        sidecar fetches what it says without looking up again; ``options`` may then give only
        ``deadline_s`` (unless the plan chose no preset: made for a namespace without a registered
        buffer, it is only a hit count, and the sidecar looks up again). When this returns,
        ``loaded_tokens`` leading tokens are in the buffer (on a GPU, with the sidecar's writes
        complete) and nothing else was touched; recompute from there. Nothing before
        ``first_token`` is fetched or written (it is the caller's); a negative ``offset`` gives
        only the tokens from ``first_token`` on slots of a flat buffer (a window of a longer prompt).
        Into an engine-decode buffer the reply's ``objects`` say where the stored objects are
        (:mod:`kvfetcher.integrations.staged` decodes them); ``decoded`` reports that engine's decodes.
        """
        return self._call(schemas.FETCH, schemas.FetchRequest(
            buffer, schemas.TokenIds.pack(tokens), plan, offset, _ints(slots), options, _ints(block_ids), first_token,
            list(decoded) if decoded else None))

    def store(self, buffer: str, tokens: Sequence[int], *, offset: int = 0, slots: Sequence[int] | None = None,
              block_ids: Sequence[int] | None = None, first_token: int = 0) -> schemas.StoreReply:
        """Queue the prefix whose KV is in the buffer (at ``offset``, ``slots`` or ``block_ids``, as
        in :meth:`fetch`) for storing; returns at once. The chunks before ``first_token`` (whole
        chunks) are the caller's: not read.

        The KV must be in the buffer when this is called (on a GPU: written and synchronized);
        the sidecar copies it before answering, so the buffer may be reused right after.
        """
        return self._call(schemas.STORE, schemas.StoreRequest(buffer, schemas.TokenIds.pack(tokens), offset, _ints(slots), _ints(block_ids),
                                                              first_token))

    def flush(self) -> None:
        """Wait until the sidecar has written everything queued."""
        self._call(schemas.FLUSH)

    def metrics(self) -> str:
        with self._lock:
            conn = self._connect()
        try:
            conn.request("GET", "/metrics")
            return conn.getresponse().read().decode()
        finally:
            conn.close()


def _json_body(body: dict) -> bytes:
    """A request body's JSON. A prompt's tokens as :meth:`schemas.TokenIds.pack` gives them (base64:
    no character JSON escapes) are appended as they are, not scanned by the encoder (a long
    prompt's string is most of the body)."""
    tokens = body.get("tokens")
    if not isinstance(tokens, str) or not tokens.isascii() or '"' in tokens or "\\" in tokens:  # (C scans: cheaper than encoding)
        return json.dumps(body).encode()
    rest = json.dumps({k: v for k, v in body.items() if k != "tokens"})
    return "".join((rest[:-1], ", " if len(rest) > 2 else "", '"tokens": "', tokens, '"}')).encode()

