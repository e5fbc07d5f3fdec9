"""schemas: the HTTP API's messages — one definition that the server, the client and docs/api.md use.

Every message is a dataclass whose fields carry their doc (``metadata["doc"]``) and, for numbers,
an optional lower bound (``metadata["min"]``, with ``metadata["open"]``: exclusive). :func:`from_json`
checks a decoded JSON value against a message's field types and raises :class:`RequestError`
naming the offending field: integers must be JSON integers within int64 (never a float truncated),
numbers finite, lists lists (a string is not a list of names), values within their bound, and the
whole value at most :data:`MAX_DEPTH` deep (:func:`check_depth`). :func:`to_json` is its inverse. Requests refuse unknown fields;
replies (``strict=False``) ignore them, so that a newer sidecar may add some. :func:`render`
writes docs/api.md from :data:`ENDPOINTS`.
"""

from __future__ import annotations

import array
import base64
import dataclasses
import functools
import inspect
import json
import math
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any, Union

import numpy as np

from kvfetcher import ipc
from kvfetcher.errors import RequestError
from kvfetcher.fetch.plan import EngineDecode, EngineDecoded, FetchOptions, FetchPlan, FetchDecision, FetchReply, plain
from kvfetcher.fetch.prefill import PrefillModel
from kvfetcher.kvbuffer import PagedLayout


MAX_DEPTH = 16  # nesting of JSON arrays and objects a request may have
INT64 = (-(2**63), 2**63 - 1)


def doc(text: str, default: Any = MISSING, *, min: float | None = None, open: bool = False) -> Any:
    """A documented field; ``min``: every number in it must be >= ``min`` (> with ``open``)."""
    return field(default=default, metadata={"doc": text, "min": min, "open": open})


def positive(text: str, default: Any = MISSING) -> Any:
    return doc(text, default, min=0, open=True)


def natural(text: str, default: Any = MISSING) -> Any:
    return doc(text, default, min=0)


# --- requests and the replies not defined by the service ---------------------------------------

BLOCK_IDS = ("a paged buffer (instead of `offset`/`slots`): the prompt's blocks in order, distinct; token `i` is at position "
             "`i % block_size` of block `block_ids[i // block_size]`")


@dataclass(kw_only=True)
class RegisterRequest:
    handle: dict | None = doc("the buffer's IPC handle (`kvfetcher.ipc`): over HTTP a CUDA IPC handle; a host-memory buffer's `memfd` "
                              "handle (`kind`, `shape`, `dtype`) goes to the buffer socket with its fd. A paged buffer of one tensor "
                              "(`L` in `paged.dims`): that tensor's CUDA IPC handle", None)
    handles: list[dict] | None = doc("a paged buffer of one tensor per layer: their CUDA IPC handles, in layer order (instead of `handle`)", None)
    model: str = doc("model fingerprint")
    tp_rank: int = natural("tensor-parallel rank", 0)
    paged: PagedLayout | None = doc("absent: a flat buffer `[layers, 2, kv_heads, capacity, head_dim]`; present: the registered tensors "
                                    "hold KV in blocks, laid out as this says (fetches and stores then name `block_ids`)", None)
    engine: EngineDecode | None = doc("a flat host buffer (memfd) of an engine that decodes stored objects itself (engine-decode mode: "
                                      "a GPU this sidecar cannot open): fetches into it write verified stored objects, not KV "
                                      "(`objects` in the reply), and plans use the engine's formats and decode rates", None)

    def buffer_handle(self) -> dict:
        """The one handle (:mod:`kvfetcher.ipc`) this registers: ``handle``, or for a paged buffer the
        paged handle of ``handles`` (or of its one ``handle``). :class:`RequestError` for neither or both."""
        if (self.handle is None) == (self.handles is None):
            raise RequestError("give 'handle', or for a paged buffer of one tensor per layer 'handles'")
        if self.paged is None:
            if self.handles is not None:
                raise RequestError("'handles' registers a paged buffer: give 'paged' (its dims and block_size)")
            return self.handle
        return ipc.paged_handle(self.handles if self.handles is not None else [self.handle], self.paged)


@dataclass
class RegisterReply:
    buffer: str = doc("the buffer's id, for the other calls")


class TokenIds:
    """Prompt token ids on the wire: a JSON array of integers, or a string, the base64 of their
    little-endian uint32 bytes (what :class:`~kvfetcher.api.client.KVClient` sends: a 128K-token
    prompt packs and parses in about a millisecond, against tens as an array). Parsed into an int64
    numpy array."""

    @staticmethod
    def pack(tokens) -> str:
        try:  # a list packs fastest through array (which checks each id's range)
            ids = np.asarray(tokens, "<u4") if isinstance(tokens, np.ndarray) and tokens.ndim == 1 else array.array("I", tokens)
            if isinstance(tokens, np.ndarray) and tokens.size and (tokens.dtype.kind not in "iu" or tokens.min() < 0 or tokens.max() > 0xFFFFFFFF):
                raise OverflowError
        except (OverflowError, TypeError):
            raise ValueError("token ids must be a flat sequence of integers in [0, 2**32)") from None
        if sys.byteorder != "little" and isinstance(ids, array.array):
            ids.byteswap()
        return base64.b64encode(ids).decode()

    @staticmethod
    def parse(value: Any, where: str) -> np.ndarray:
        if isinstance(value, str):
            try:
                raw = base64.b64decode(value, validate=True)
            except ValueError:
                _fail(where, "base64 of little-endian uint32 token ids", value)
            if len(raw) % 4:
                _fail(where, "a whole number of uint32 token ids", value)
            return np.frombuffer(raw, "<u4").astype(np.int64)
        if not isinstance(value, list):
            _fail(where, "an array of integers or a base64 string", value)
        ids = np.asarray(value) if value else np.zeros(0, np.int64)
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.dtype == np.uint64 or any(isinstance(v, bool) for v in value):
            _fail(where, "an array of int64 integers", value)
        return ids.astype(np.int64)


TOKENS = "prompt token ids: an array, or base64 of little-endian uint32 (see TokenIds)"
WINDOW = ("negative for a window of a prompt longer than a flat buffer: only tokens from `first_token` on need slots "
          "(`offset = -first_token` puts token `first_token` in slot 0)")


@dataclass
class LookupRequest:
    tokens: TokenIds = doc(TOKENS)
    buffer: str | None = doc("a registered buffer's id; or name the namespace by `model` and `dtype`", None)
    model: str | None = doc("model fingerprint (without `buffer`)", None)
    dtype: str | None = doc("KV dtype, e.g. `float16` (without `buffer`)", None)
    tp_rank: int = natural("tensor-parallel rank (without `buffer`)", 0)
    kv_shape: tuple[int, int, int] | None = positive("KV geometry `[layers, kv_heads, head_dim]` (without `buffer`; default: that of "
                                                     "the registered buffer of `model`, `dtype` and `tp_rank`)", None)
    options: FetchOptions | None = doc("how the fetch is chosen (default: the sidecar's settings)", None)


@dataclass
class LookupReply:
    tokens: int = doc("leading tokens found stored (the plan's `hit_tokens`)")
    chunk_tokens: int = doc("tokens per chunk")
    plan: FetchPlan = doc("what a fetch would do: pass it back to `/v1/fetch` unchanged")
    error: str | None = doc("why the store could not be listed, if it could not", None)
    detail: str | None = doc("a human-readable detail of `error`", None)


@dataclass
class FetchRequest:
    buffer: str = doc("a registered buffer's id")
    tokens: TokenIds = doc(TOKENS + "; whole chunks of them are fetched")
    plan: FetchPlan | None = doc("a plan from `/v1/lookup` for this buffer's namespace and these tokens; without one the sidecar looks up "
                                 "(listing what its index does not know)", None)
    offset: int = doc("token `i` goes to slot `offset + i` of the buffer's token axis; " + WINDOW, 0)
    slots: list[int] | None = natural("token `i` goes to slot `slots[i]` (instead of `offset`)", None)
    options: FetchOptions | None = doc("without a plan: as in `/v1/lookup`; with one, only `deadline_s` (of the fetch)", None)
    block_ids: list[int] | None = natural(BLOCK_IDS + "; fewer than the prompt's: only the whole chunks they hold are fetched (vLLM "
                                          "gives a load the blocks of the tokens it asked to load)", None)
    first_token: int = natural("tokens before it are the caller's (a serving engine's own prefix-cache hit, whose blocks other requests "
                               "may share): never written, and chunks wholly before it are not fetched; a chunk straddling it writes "
                               "only its tail. A paged buffer needs whole blocks. `loaded_tokens` still counts from token 0", 0)
    decoded: list[EngineDecoded] | None = doc("an engine-decode buffer's engine: its own decodes since its last fetch (they teach the "
                                              "cost model its decode rates)", None)


@dataclass
class StoreRequest:
    buffer: str = doc("a registered buffer's id")
    tokens: TokenIds = doc(TOKENS + ", whose KV is in the buffer; whole chunks of them are stored")
    offset: int = doc("token `i` is in slot `offset + i`; " + WINDOW, 0)
    slots: list[int] | None = natural("token `i` is in slot `slots[i]` (instead of `offset`)", None)
    block_ids: list[int] | None = natural(BLOCK_IDS, None)
    first_token: int = natural("whole chunks: the chunks before it are the caller's (e.g. stored by an earlier window of a prompt "
                               "longer than the buffer): not read, not stored, counted in `skipped_chunks`", 0)


@dataclass
class StoreReply:
    queued_chunks: int = doc("chunks queued for storing (those after the skipped ones that fit the queue)")
    dropped: bool = doc("true: some chunks did not fit the store queue and were dropped (counted in the metrics)")
    skipped_chunks: int = doc("leading chunks already stored in every preset this sidecar writes, or before `first_token`", 0)
    dropped_chunks: int = doc("chunks dropped because the queue was full", 0)


@dataclass
class Ok:
    ok: bool = doc("always true")


@dataclass
class LeaseRequest:
    """Ties a registration to the process that made it: sent on the buffer socket (not HTTP) with a
    pidfd of that process (``SCM_RIGHTS``), answered with `Ok` or an `ErrorReply`. When the process
    exits the sidecar releases the buffer, as if it had been unregistered: a crashed or restarted
    engine's KV memory (a GPU's, by CUDA IPC) is not kept mapped for its next start to find taken.
    `KVClient.register` leases every registration it makes over the Unix socket; without a lease a
    dead client's buffer is released only past the sidecar's bound on registrations."""

    lease: str = doc("the buffer id a registration returned")


@dataclass
class ErrorReply:
    """The reply of a refused request (4xx)."""

    error: str = doc("`bad_request` (400), `no_device` (400: a CUDA handle this sidecar cannot open, having no CUDA device or not "
                     "the buffer's; register host memory instead) or `unauthenticated` (401)")
    detail: str = doc("what was wrong")


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    request: type | None
    reply: type
    doc: str
    status: int = 200


REGISTER = Endpoint("POST", "/v1/buffers", RegisterRequest, RegisterReply,
                    "Register a KV buffer `[layers, 2, kv_heads, capacity, head_dim]`, or a serving engine's paged KV tensors (`paged`).")
UNREGISTER = Endpoint("DELETE", "/v1/buffers/{id}", None, Ok, "Forget a registered buffer.")
LOOKUP = Endpoint("POST", "/v1/lookup", LookupRequest, LookupReply,
                  "Plan a fetch: the prefix's stored run from the sidecar's index of the store, then the cost model. Touches no buffer and, "
                  "unless `options.refresh`, waits on no store request: chunks the index does not know are listed in the background.")
FETCH = Endpoint("POST", "/v1/fetch", FetchRequest, FetchReply,
                 "Fetch the leading chunks into the buffer; with a plan, the store is not listed again. A storage or data failure "
                 "is not an HTTP error: the reply says how many tokens were loaded and why not more.")
STORE = Endpoint("POST", "/v1/store", StoreRequest, StoreReply,
                 "Queue the prefix for storing; the KV is copied before the reply, so the buffer may be reused at once.", 202)
FLUSH = Endpoint("POST", "/v1/flush", None, Ok, "Wait until every queued store is written (tests, demo, shutdown).")
ENDPOINTS = (REGISTER, UNREGISTER, LOOKUP, FETCH, STORE, FLUSH)
MESSAGES = (FetchOptions, FetchPlan, FetchDecision, PrefillModel, PagedLayout, EngineDecode, EngineDecoded, LeaseRequest, ErrorReply)  # nested or shared, documented once each


# --- checking and rendering ------------------------------------------------------------------


_SCALARS = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool) and INT64[0] <= v <= INT64[1],
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    str: lambda v: isinstance(v, str),
    dict: lambda v: isinstance(v, dict),
}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _form(tp: Any) -> tuple[Any, tuple]:
    """A type's origin and arguments (asked once per element of every array: cached)."""
    return typing.get_origin(tp), typing.get_args(tp)


@functools.cache
def _plain(tp: Any, bound: tuple | None = None) -> Callable[[Any], bool] | None:
    """A test of a JSON value for ``tp`` where ``tp`` is an integer (within ``bound``, as
    :func:`_check` takes it), string or boolean, or a fixed tuple of them without a bound (what an
    array of such is checked with in one pass; None for any other type)."""
    if tp in (int, str, bool):
        test = _SCALARS[tp]
        if bound is None or tp is not int:
            return test
        lo, strict = bound
        return (lambda v: test(v) and v > lo) if strict else (lambda v: test(v) and v >= lo)
    origin, args = _form(tp)
    if bound is None and origin is tuple and args and Ellipsis not in args and all(a in (int, str, bool) for a in args):
        tests = [_SCALARS[a] for a in args]
        return lambda v: isinstance(v, list) and len(v) == len(tests) and all(t(x) for t, x in zip(tests, v))
    return None


def _fail(where: str, want: Any, value: Any) -> typing.NoReturn:
    """``want``: what it must be, in words or as a type (named here)."""
    raise RequestError(f"'{where}' must be {want if isinstance(want, str) else type_name(want)}, not {type(value).__name__} {str(value)[:40]}")


def _check(tp: Any, value: Any, where: str, strict: bool, want: Any = None, bound: tuple | None = None) -> Any:
    """``value`` as a ``tp``; ``want``: the type named when it is not one (an optional's; named only
    then, as naming costs more than checking); ``bound``: ``(min, open)`` for every number in it."""
    origin, args = _form(tp)
    want = want or tp
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(inner, value, where, strict, want, bound)
    if dataclasses.is_dataclass(tp):
        return from_json(tp, value, strict, where)
    if tp is TokenIds:
        return TokenIds.parse(value, where)
    if tp in _SCALARS:
        if not _SCALARS[tp](value):
            _fail(where, want, value)
        if bound is not None and tp in (int, float) and (value < bound[0] or (bound[1] and value == bound[0])):
            _fail(where, f"{'>' if bound[1] else '>='} {bound[0]}", value)
        return float(value) if tp is float else value
    if origin in (list, tuple, dict) and not isinstance(value, dict if origin is dict else list):
        _fail(where, want, value)
    if origin is dict:
        return {k: _check(args[1], v, f"{where}.{k}", strict, bound=bound) for k, v in value.items()}
    if origin is list or (origin is tuple and args[-1] is Ellipsis):
        if (ok := _plain(args[0], bound)) is not None and all(map(ok, value)):  # one pass; an element that fails is named below
            return origin(map(tuple, value) if _form(args[0])[0] is tuple else value)
        return origin(_check(args[0], v, f"{where}[{i}]", strict, bound=bound) for i, v in enumerate(value))
    if origin is tuple:
        if len(value) != len(args):
            _fail(where, want, value)
        return tuple(_check(a, v, f"{where}[{i}]", strict, bound=bound) for i, (a, v) in enumerate(zip(args, value)))
    raise TypeError(f"no JSON form for {tp!r}")


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    """Raise :class:`RequestError` if ``value`` nests arrays and objects deeper than ``limit``."""
    level, depth = [value], 0
    while level:
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x if isinstance(x, list) else ())
                 if isinstance(v, (dict, list))]
        depth += 1
        if depth > limit:
            raise RequestError(f"the body nests deeper than {limit} levels")


def from_json(cls: type, obj: Any, strict: bool = True, where: str = "body") -> Any:
    """An instance of message ``cls`` from decoded JSON; :class:`RequestError` when it does not fit."""
    if not isinstance(obj, dict):
        _fail(where, "an object", obj)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(obj) - set(fields))
    if strict and unknown:
        raise RequestError(f"unknown field(s) {unknown} in {where}; known: {sorted(fields)}")
    kw = {}
    for name, f in fields.items():
        if name in obj:
            lo = f.metadata.get("min")
            kw[name] = _check(_hints(cls)[name], obj[name], name if where == "body" else f"{where}.{name}", strict,
                              bound=None if lo is None else (lo, f.metadata.get("open", False)))
        elif f.default is MISSING:
            raise RequestError(f"'{name}' is required in {where}")
    try:
        return cls(**kw)
    except ValueError as e:  # the message's own checks (a PagedLayout's dims)
        raise RequestError(f"'{where}': {e}") from None


def to_json(msg: Any) -> dict:
    """The JSON object of a message (tuples as lists)."""
    return plain(msg)


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if dataclasses.is_dataclass(tp):
        return f"[{tp.__name__}](#{tp.__name__.lower()})"
    if tp is TokenIds:
        return "[integer, ...] or string"
    if origin is dict:
        return f"{{string: {type_name(args[1])}}}"
    if origin is list or (origin is tuple and args[-1] is Ellipsis):
        return f"[{type_name(args[0])}, ...]"
    if origin is tuple:
        return "[" + ", ".join(type_name(a) for a in args) + "]"
    return {int: "integer", float: "number", str: "string", bool: "boolean", dict: "object", type(None): "null"}[tp]


def _table(cls: type) -> list[str]:
    rows = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        default = "required" if f.default is MISSING else f"`{json.dumps(f.default)}`"
        rows.append(f"| `{f.name}` | {type_name(_hints(cls)[f.name])} | {default} | {f.metadata.get('doc', '')} |")
    return rows


def render() -> str:
    """docs/api.md: every endpoint with its request and reply, then the shared messages."""
    out = [
        "# HTTP API",
        "",
        "Generated from `sidecar/kvfetcher/api/schemas.py` by `python -m kvfetcher.api.schemas > docs/api.md`;",
        "a test checks that this file matches. Bodies are JSON. `/v1/*` over TCP needs",
        "`Authorization: Bearer <token>`; over the Unix socket the socket's permissions are the",
        "authentication (the scheme is case-insensitive). A malformed request (wrong types, integers beyond",
        f"int64, non-finite numbers, nesting deeper than {MAX_DEPTH}) is a 400 with an [ErrorReply](#errorreply).",
        "`GET /healthz`, `GET /servingz` (the Unix socket takes connections: the pod's readiness probe),",
        "`GET /readyz` (the store is reachable and takes writes; a 503 names only the reason; no probe",
        "asks it) and `GET /metrics` (Prometheus) are open.",
    ]
    for e in ENDPOINTS:
        out += ["", f"## `{e.method} {e.path}`", "", e.doc, ""]
        if e.request is not None:
            out += [f"Request `{e.request.__name__}`:", "", *_table(e.request), ""]
        out += [f"Reply ({e.status}) `{e.reply.__name__}`:", "", *_table(e.reply)]
    for m in MESSAGES:
        out += ["", f"## {m.__name__}", "", inspect.cleandoc(m.__doc__ or ""), "", *_table(m)]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
