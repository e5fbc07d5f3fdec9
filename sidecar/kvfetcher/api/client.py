"""client: the model side of the sidecar, in vLLM KV-connector terms.

* :meth:`KVClient.lookup` — the scheduler's question, "how many leading tokens of this prompt
  can you load?" (``get_num_new_matched_tokens``);
* :meth:`KVClient.load` — the worker's "load them into these slots of my KV buffers", which
  answers with how many were really loaded (the rest is recomputed);
* :meth:`KVClient.save` — "store this prefix", which returns at once.

Synchronous (model code is), one keep-alive connection per client, over TCP with a bearer
token or over the sidecar's Unix socket.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kvfetcher import config, ipc


class SidecarError(RuntimeError):
    def __init__(self, status: int, reason: str, detail: str):
        super().__init__(f"sidecar answered {status} {reason}: {detail}")
        self.status, self.reason, self.detail = status, reason, detail


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


@dataclass
class LoadResult:
    loaded_tokens: int  # leading tokens now in the buffer; recompute from here
    requested_tokens: int
    error: str | None = None  # why fewer than requested were loaded, if a failure
    reason: str | None = None  # e.g. "cost_model", "miss", "deadline", "corrupt"
    bytes_read: int = 0
    seconds: float = 0.0
    decision: dict = field(default_factory=dict)


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
        self.token = token if token is not None else config.AUTH_TOKEN.read()
        self._conn: http.client.HTTPConnection | None = None
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
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        with self._lock:
            for attempt in (0, 1):  # a kept-alive connection may have been closed by the server
                conn = self._conn = self._conn or self._connect()
                try:
                    conn.request(method, path, body=data, headers=headers)
                    resp = conn.getresponse()
                    payload = resp.read()
                    break
                except (ConnectionError, http.client.BadStatusLine, http.client.CannotSendRequest):
                    conn.close()
                    self._conn = None
                    if attempt:
                        raise
        try:
            reply = json.loads(payload) if payload else {}
        except json.JSONDecodeError:
            reply = {"error": "bad_reply", "detail": payload[:200].decode(errors="replace")}
        if resp.status >= 400:
            raise SidecarError(resp.status, reply.get("error", "error"), reply.get("detail", ""))
        return reply

    def close(self) -> None:
        with self._lock:
            if self._conn:
                self._conn.close()
                self._conn = None

    # --- the connector verbs -----------------------------------------------------------------

    def register(self, handle: dict, model: str, tp_rank: int = 0) -> str:
        """Register a KV buffer (see :mod:`kvfetcher.ipc`); returns its id for the other calls."""
        return self._request("POST", "/v1/buffers", {"handle": handle, "model": model, "tp_rank": tp_rank})["buffer"]

    def register_tensor(self, t: torch.Tensor, model: str, tp_rank: int = 0) -> str:
        """Register a CUDA tensor by IPC handle (CPU buffers must come from :func:`ipc.allocate`)."""
        return self.register(ipc.cuda_handle(t), model, tp_rank)

    def unregister(self, buffer: str) -> None:
        self._request("DELETE", f"/v1/buffers/{buffer}")

    def lookup(self, buffer: str | None, tokens: Sequence[int], *, model: str | None = None, dtype: str = "float16", tp_rank: int = 0) -> int:
        """How many leading tokens of ``tokens`` are stored (a multiple of the chunk size).

        Name the namespace by a registered ``buffer``, or (a scheduler with no buffers) by
        ``model``, ``dtype`` and ``tp_rank``.
        """
        ns = {"buffer": buffer} if buffer is not None else {"model": model, "dtype": dtype, "tp_rank": tp_rank}
        r = self._request("POST", "/v1/lookup", {**ns, "tokens": list(map(int, tokens))})
        self.chunk_tokens = r.get("chunk_tokens", self.chunk_tokens)
        return int(r["tokens"])

    def load(
        self,
        buffer: str,
        tokens: Sequence[int],
        *,
        offset: int = 0,
        slots: Sequence[int] | None = None,
        deadline_s: float | None = None,
        recompute_tokens_per_s: float | None = None,
        presets: Sequence[str] | None = None,
        ttft_budget_s: float | None = None,
    ) -> LoadResult:
        """Load the stored leading chunks of ``tokens`` into the buffer at ``offset`` (or ``slots``).

        When this returns, ``loaded_tokens`` leading tokens are in the buffer (on a GPU, with
        the sidecar's writes complete) and nothing else was touched; recompute from there.
        ``ttft_budget_s``: on a busy GPU, a fetch predicted within this many seconds is taken
        even where recomputing would be faster (it leaves the GPU to the running requests).
        """
        body: dict = {"buffer": buffer, "tokens": list(map(int, tokens)), "offset": offset}
        if slots is not None:
            body["slots"] = list(map(int, slots))
        if deadline_s is not None:
            body["deadline_s"] = deadline_s
        if recompute_tokens_per_s:
            body["recompute_tokens_per_s"] = recompute_tokens_per_s
        if presets:
            body["presets"] = list(presets)
        if ttft_budget_s is not None:
            body["ttft_budget_s"] = ttft_budget_s
        r = self._request("POST", "/v1/fetch", body)
        return LoadResult(
            r["loaded_tokens"], r["requested_tokens"], r.get("error"), r.get("reason"),
            r.get("bytes_read", 0), r.get("seconds", 0.0), r.get("decision", {}),
        )

    def save(self, buffer: str, tokens: Sequence[int], *, offset: int = 0, slots: Sequence[int] | None = None) -> dict:
        """Queue the prefix whose KV is in the buffer for storing; returns at once.

        The KV must be in the buffer when this is called (on a GPU: written and synchronized);
        the sidecar copies it before answering, so the buffer may be reused right after.
        """
        body: dict = {"buffer": buffer, "tokens": list(map(int, tokens)), "offset": offset}
        if slots is not None:
            body["slots"] = list(map(int, slots))
        return self._request("POST", "/v1/store", body)

    def flush(self) -> None:
        """Wait until the sidecar has written everything queued."""
        self._request("POST", "/v1/flush", {})

    def metrics(self) -> str:
        with self._lock:
            conn = self._connect()
        try:
            conn.request("GET", "/metrics")
            return conn.getresponse().read().decode()
        finally:
            conn.close()
