"""A bounded fuzz test (hypothesis) of the two parsers a stranger can feed — the stored
object container and the HTTP request schemas, the latter through the real aiohttp app.

Invariants: a stored object either decodes to exactly the tensor that was stored or raises a
:class:`ContainerError` (never another exception); a request is answered (no hang) and never with
a 5xx. Bounded: a fixed number of examples each, no example database, well under two minutes.
"""

from __future__ import annotations

import http.client
import json
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfetcher import ipc
from kvfetcher.api.server import Embedded
from kvfetcher.chunk import decode_chunk, encode_chunk
from kvfetcher.config import Config
from kvfetcher.errors import ContainerError
from kvfetcher.format import container
from kvfetcher.service import Sidecar
from kvfetcher.store.local import LocalStore
from kvtest import synthetic_kv

FP = "fuzz/fp16"
BOUNDED = settings(max_examples=300, deadline=None, database=None, derandomize=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

OBJECTS = {p: encode_chunk(synthetic_kv(layers=2, heads=2, tokens=32, head_dim=16), p, FP) for p in ("raw", "q8")}
CLEAN = {p: decode_chunk(o, FP) for p, o in OBJECTS.items()}


def decodes_right_or_refuses(obj: bytes, preset: str) -> None:
    try:
        out = decode_chunk(obj, FP)
    except ContainerError:
        return
    assert torch.equal(out.view(torch.uint8), CLEAN[preset].view(torch.uint8)), "a damaged object decoded to other KV"


@BOUNDED
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_are_refused(data):
    with pytest.raises(ContainerError):
        decode_chunk(data, FP)


@st.composite
def damaged(draw):
    """A valid object with bytes flipped, cut, or inserted."""
    preset = draw(st.sampled_from(sorted(OBJECTS)))
    b = bytearray(OBJECTS[preset])
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(b) - 1))
        kind = draw(st.sampled_from(["flip", "cut", "insert"]))
        if kind == "flip":
            b[at] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            del b[at : at + draw(st.integers(1, 64))]
        else:
            b[at:at] = draw(st.binary(min_size=1, max_size=16))
        if not b:
            break
    return bytes(b), preset


@BOUNDED
@given(damaged())
def test_damaged_objects_decode_right_or_are_refused(case):
    decodes_right_or_refuses(*case)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)


def _walk(d, path):
    for k in path[:-1]:
        d = d[k]
    return d


@st.composite
def reheadered(draw):
    """A valid object whose header (checksum fixed up) has one value replaced by arbitrary JSON."""
    preset = draw(st.sampled_from(sorted(OBJECTS)))
    obj = OBJECTS[preset]
    h = container.parse_header(obj)
    d = json.loads(obj[container.PREFIX_SIZE : h.header_size])
    paths, todo = [], [((), d)]
    while todo:
        path, v = todo.pop()
        children = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, c in children:
            paths.append(path + (k,))
            todo.append((path + (k,), c))
    path = draw(st.sampled_from(sorted(paths, key=str)))
    _walk(d, path)[path[-1]] = draw(JSON)
    hb = json.dumps(d).encode()
    tag = bytes(container.TAG_SIZE)  # an untagged object: what a writer without the key stores
    prefix = container.PREFIX.pack(container.MAGIC, container.FORMAT_VERSION, 0, len(hb), zlib.crc32(tag + hb), tag)
    return prefix + hb + obj[h.header_size :], preset


@BOUNDED
@given(reheadered())
def test_checksummed_but_edited_headers_raise_only_container_errors(case):
    """Only the exception type is asserted: an edited, re-checksummed header that still decodes to
    other KV is the object-authentication question (a keyed MAC), not the parser's."""
    obj, _ = case
    try:
        decode_chunk(obj, FP)
    except ContainerError:
        pass


# --- the HTTP schemas through the real app -------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    store = LocalStore(tmp_path_factory.mktemp("store"))
    buf = ipc.allocate((2, 2, 2, 256, 16), torch.float16)
    sc = Sidecar(store, Config(chunk_tokens=32, presets=("raw",), decode_procs=0, warm_up=False, deadline_s=2.0))
    with Embedded(sc, "t") as e:
        bid = sc.register(buf.handle, FP)
        yield e.where["port"], bid
    buf.close()


def post(port, path, data: bytes, token="t"):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)  # a hang fails the test
    try:
        conn.request("POST", path, body=data, headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


FIELDS = ["buffer", "tokens", "model", "dtype", "tp_rank", "kv_shape", "recompute_tokens_per_s", "prefill_model", "presets", "ttft_budget_s",
          "deadline_s", "may_skip_listing", "plan", "offset", "slots", "handle"]
TOKENS = st.lists(st.integers(-(2**64), 2**64), max_size=200) | st.lists(st.integers(0, 50), min_size=32, max_size=160)


@st.composite
def bodies(draw, bid):
    body = {}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True)):
        body[name] = draw(JSON)
    if draw(st.booleans()):
        body["buffer"] = bid
    if draw(st.booleans()):
        body["tokens"] = draw(TOKENS)
    return json.dumps(body, allow_nan=True).encode()


@BOUNDED
@given(data=st.data())
def test_no_request_body_gets_a_5xx(served, data):
    port, bid = served
    path = data.draw(st.sampled_from(["/v1/lookup", "/v1/fetch", "/v1/store", "/v1/buffers"]))
    body = data.draw(bodies(bid) | st.binary(max_size=256))
    status, reply = post(port, path, body)
    assert status < 500, (path, body[:200], reply[:300])


@settings(max_examples=100, deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=64))
def test_no_authorization_header_gets_a_5xx(served, header):
    port, bid = served
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.putrequest("POST", "/v1/flush")
        conn.putheader("Authorization", header.replace(b"\r", b"").replace(b"\n", b""))
        conn.putheader("Content-Length", "0")
        conn.endheaders()
        assert conn.getresponse().status in (200, 400, 401)
    finally:
        conn.close()
