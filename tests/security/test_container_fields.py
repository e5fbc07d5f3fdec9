"""A header whose checksum is right but whose fields are not (a short
``frames`` list, a wrong type, an impossible value) is a corrupt object — a ContainerError, never
an IndexError or another exception that would be reported as ``internal`` — so a fetch names it
as a bad object, the sidecar deletes it and the prefix heals at the next store."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvtest import synthetic_kv
from kvfetcher.chunk import decode_chunk, encode_chunk
from kvfetcher.fetch import executor
from kvfetcher.format import container
from kvfetcher.kvbuffer import ChunkRef, Destination
from kvfetcher.store.local import LocalStore

FP = "fp"


@pytest.fixture(scope="module", params=["q8", "raw"])
def obj(request):
    return encode_chunk(synthetic_kv(layers=2, heads=2, tokens=32, head_dim=32), request.param, FP)


def rewrite(obj: bytes, edit, nest: int = 0) -> bytes:
    """``obj`` with its header JSON edited (and a string ``"@"`` in it replaced by ``nest`` nested
    lists) and every checksum of the prefix made right again."""
    h = container.parse_header(obj)
    d = json.loads(obj[container.PREFIX_SIZE : h.header_size])
    edit(d)
    hb = json.dumps(d).replace('"@"', "[" * nest + "]" * nest).encode()
    tag = bytes(container.TAG_SIZE)
    return container.PREFIX.pack(container.MAGIC, container.FORMAT_VERSION, 0, len(hb), container.crc32(tag + hb), tag) \
        + hb + obj[h.header_size :]


def put(d, path, value):
    *parents, last = path
    for p in parents:
        d = d[p]
    d[last] = value


FIELDS = [("segments", 0, "frames"), ("segments", 0, "offset"), ("segments", 0, "length"), ("segments", 0, "crc32"),
          ("segments", 0), ("segments",), ("shape",), ("frame_shape",), ("start",), ("dtype",), ("layout",),
          ("codec",), ("layout_version",), ("side",), ("meta",), ("fingerprint",)]
VALUES = [[0], [], [0, 1, 2], None, "7", 1.5, True, -1, 2**70, float("inf"), {"a": 1}, [[[[]]]], [-3, 5, 2, 1, 1]]


def test_a_short_frames_list_is_a_corrupt_object(obj):
    bad = rewrite(obj, lambda d: d["segments"][0].update(frames=[0]))
    with pytest.raises(container.CorruptError):
        container.parse_header(bad)


@pytest.mark.parametrize("path", FIELDS, ids=lambda p: ".".join(map(str, p)))
def test_any_wrong_header_field_is_a_container_error_or_harmless(obj, path):
    """Every field set to every kind of wrong value: parsing and decoding either refuse the object
    with a ContainerError or (for a harmless change, e.g. ``meta``) restore exactly the chunk."""
    want = decode_chunk(obj, FP)
    for value in VALUES:
        if path == ("side",) and value is None and container.parse_header(obj).side is None:
            continue
        bad = rewrite(obj, lambda d: put(d, path, value))
        out = torch.full_like(want, -7.0)
        try:
            decode_chunk(bad, FP, out=out)
        except container.ContainerError:
            assert bool((out == -7.0).all()), (path, value)
        else:
            assert torch.equal(out, want), (path, value)


def test_deep_nesting_in_the_header_is_corrupt(obj):
    with pytest.raises(container.CorruptError):
        container.parse_header(rewrite(obj, lambda d: d.update(meta="@"), nest=100_000))


async def test_a_fetch_names_an_inconsistent_header_as_a_bad_object(tmp_path, obj):
    store = LocalStore(tmp_path)
    bad = rewrite(obj, lambda d: d["segments"][0].update(frames=[0]))
    store.put("kv/00/x/p.kvfc", bad)
    dest = torch.zeros(2, 2, 2, 32, 32, dtype=torch.float16)
    with ThreadPoolExecutor(2) as io, ThreadPoolExecutor(1) as dec:
        out = await executor.fetch(store, [ChunkRef("kv/00/x/p.kvfc", len(bad), 0, 32)], Destination(dest, tokens=32),
                                   fingerprint=FP, io_pool=io, decode_pool=dec)
    assert out.error == "corrupt" and out.bad_object == "kv/00/x/p.kvfc", out.detail
    assert bool((dest == 0).all())
