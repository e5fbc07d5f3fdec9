"""Stored objects are authenticated (a keyed tag bound to the object's name),
non-finite values never reach a KV buffer, and the model fingerprint is the deployment's.

Every path a chunk takes into a buffer is covered: a whole object (``decode_chunk``), the fetch
executor's own threads, the decode worker processes and the direct raw path."""

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from kvtest import synthetic_kv
from kvfetcher import ipc, keys
from kvfetcher.chunk import decode_chunk, encode_chunk
from kvfetcher.config import Config
from kvfetcher.errors import RequestError
from kvfetcher.fetch import executor
from kvfetcher.format import container, mac, presets
from kvfetcher.format.mac import ObjectMAC
from kvfetcher.kvbuffer import ChunkRef, Destination
from kvfetcher.service import Sidecar
from kvfetcher.store.local import LocalStore

FP, SECRET = "fp", "a pool's object key, 32+ chars"
KEY = mac.key_from(SECRET)
SENTINEL = -7.0
CHUNK = 32


def name(i: int, preset: str) -> str:
    return keys.object_name(f"{i:064x}", preset)


def put_chunks(store, kv, preset, key=KEY):
    """Each chunk of ``kv`` stored at its name, tagged under ``key`` (None: untagged)."""
    refs = []
    for i in range(kv.shape[3] // CHUNK):
        n = name(i, preset)
        obj = encode_chunk(kv[:, :, :, i * CHUNK : (i + 1) * CHUNK].contiguous(), preset, FP, start=i * CHUNK,
                           auth=ObjectMAC(key, n) if key else None)
        store.put(n, obj)
        refs.append(ChunkRef(n, len(obj), i * CHUNK, CHUNK))
    return refs


def crc_preserving_flip(data: bytes, at: int) -> bytes:
    """``data`` with byte ``at`` changed and 4 other bytes adjusted so that its CRC-32 is unchanged
    (CRC-32 is affine over GF(2): what a writer without a key can do to any part)."""
    base, crc = bytearray(data), container.crc32(data)
    base[at] ^= 0x5A
    fix = len(data) - 4 if at < len(data) - 4 else 0
    cols = []  # effect on the CRC of flipping each of the 32 bits at ``fix``
    for bit in range(32):
        d = bytearray(base)
        d[fix + bit // 8] ^= 1 << (bit % 8)
        cols.append(container.crc32(bytes(d)) ^ container.crc32(bytes(base)))
    want = container.crc32(bytes(base)) ^ crc
    rows = [(c, 1 << i) for i, c in enumerate(cols)]  # Gaussian elimination over GF(2)
    solution, basis = 0, []
    for c, m in rows:
        for bc, bm in basis:
            if c ^ bc < c:
                c, m = c ^ bc, m ^ bm
        if c:
            basis.append((c, m))
    basis.sort(reverse=True)
    for bc, bm in basis:
        if want ^ bc < want:
            want, solution = want ^ bc, solution ^ bm
    assert want == 0
    for bit in range(32):
        if solution >> bit & 1:
            base[fix + bit // 8] ^= 1 << (bit % 8)
    assert container.crc32(bytes(base)) == crc and bytes(base) != data
    return bytes(base)


def forge_part(obj: bytes, part: int = -1) -> bytes:
    """``obj`` with one part's bytes changed but its CRC-32 (and so the header) unchanged."""
    h = container.parse_header(obj)
    seg = h.segments[part]
    a = h.header_size + seg.offset
    return obj[:a] + crc_preserving_flip(obj[a : a + seg.length], seg.length // 2) + obj[a + seg.length :]


def rewrite_header(obj: bytes, edit) -> bytes:
    """``obj`` with its header edited and its CRC-32 fixed up (the tag, needing the key, is kept)."""
    h = container.parse_header(obj)
    d = json.loads(obj[container.PREFIX_SIZE : h.header_size])
    edit(d)
    hb = json.dumps(d).encode()
    magic, version, flags, _, _, tag = container.PREFIX.unpack_from(obj)
    return container.PREFIX.pack(magic, version, flags, len(hb), container.crc32(tag + hb), tag) + hb + obj[h.header_size :]


# --- the container ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kv():
    return synthetic_kv(layers=2, heads=2, tokens=CHUNK, head_dim=32)


@pytest.mark.parametrize("preset", ["q8", "raw"])
def test_a_tagged_object_reads_with_its_name_and_without_a_key(kv, preset):
    obj = encode_chunk(kv, preset, FP, auth=ObjectMAC(KEY, name(0, preset)))
    h = container.parse_header(obj)
    assert h.authenticated and all(s.mac is not None for s in h.segments)
    same = decode_chunk(obj, FP, auth=ObjectMAC(KEY, name(0, preset)))
    assert torch.equal(same, decode_chunk(obj, FP))  # a reader without a key checks CRCs only


@pytest.mark.parametrize("auth, why, error", [
    (ObjectMAC(KEY, name(1, "q8")), "another chunk key (another prefix or tenant)", container.UnauthenticatedError),
    (ObjectMAC(KEY, name(0, "lean")), "another preset", container.UnauthenticatedError),
    # its header names a key id this reader does not hold: refused, and a miss rather than deleted
    (ObjectMAC(mac.key_from("another pool's key, 32+ chars"), name(0, "q8")), "another key", container.OtherKeyError),
])
def test_a_tagged_object_is_refused_under_another_name_or_key(kv, auth, why, error):
    obj = encode_chunk(kv, "q8", FP, auth=ObjectMAC(KEY, name(0, "q8")))
    with pytest.raises(error):
        decode_chunk(obj, FP, auth=auth)


def test_an_object_written_without_the_key_is_refused_by_a_reader_with_it(kv):
    with pytest.raises(container.UnauthenticatedError):
        decode_chunk(encode_chunk(kv, "q8", FP), FP, auth=ObjectMAC(KEY, name(0, "q8")))


@pytest.mark.parametrize("preset", ["q8", "raw"])
def test_a_part_rewritten_with_its_crc_kept_is_caught_by_its_tag(kv, preset):
    auth = ObjectMAC(KEY, name(0, preset))
    forged = forge_part(encode_chunk(kv, preset, FP, auth=auth))
    out = torch.full_like(kv, SENTINEL)
    with pytest.raises(container.UnauthenticatedError, match="tag of the part"):
        decode_chunk(forged, FP, out=out, auth=auth)
    assert bool((out == SENTINEL).all())
    if preset == "raw":  # the threat: CRC-32 alone lets the forgery through, as different KV
        assert not torch.equal(decode_chunk(forged, FP), kv)


@pytest.mark.parametrize("edit", [
    lambda d: d.update(fingerprint="another-model"),
    lambda d: d["segments"][0].update(crc32=d["segments"][0]["crc32"] ^ 1),
    lambda d: [s.pop("mac") for s in d["segments"] + [d["side"]]],
])
def test_a_header_rewritten_with_its_crc_fixed_is_caught_by_the_header_tag(kv, edit):
    auth = ObjectMAC(KEY, name(0, "q8"))
    with pytest.raises(container.UnauthenticatedError, match="header tag"):
        container.parse_header(rewrite_header(encode_chunk(kv, "q8", FP, auth=auth), edit), auth)


def test_stripping_the_tags_does_not_make_an_object_pass_as_untagged(kv):
    auth = ObjectMAC(KEY, name(0, "q8"))
    obj = encode_chunk(kv, "q8", FP, auth=auth)
    flags_off = obj[:6] + b"\0\0" + obj[8:]  # the tag covers the flags; tagged parts contradict them
    with pytest.raises(container.ContainerError):
        container.parse_header(flags_off, auth)
    with pytest.raises(container.CorruptError):
        container.parse_header(flags_off)


@pytest.mark.parametrize("version", [1, 2])  # 1: no tags; 2: part tags of HMAC-SHA256
def test_objects_of_an_older_format_are_refused_as_foreign(kv, version):
    obj = encode_chunk(kv, "q8", FP)
    with pytest.raises(container.ForeignObjectError, match="predates"):
        container.parse_header(obj[:4] + version.to_bytes(2, "little") + obj[6:])


def test_a_part_tag_is_bound_to_its_name_offset_and_bytes_and_never_reuses_a_nonce():
    auth, data = ObjectMAC(KEY, name(0, "q8")), bytes(range(256)) * 64
    a, b = auth.part(48, data), auth.part(48, memoryview(data))
    assert len(a) == len(b) == mac.PART_TAG_SIZE and a[:mac.PART_NONCE_SIZE] != b[:mac.PART_NONCE_SIZE]
    assert auth.verify_part(48, data, a) and auth.verify_part(48, memoryview(data), b)
    other_key = mac.key_from("another pool's key, 32+ chars")
    assert ObjectMAC(other_key, auth.name, accepted=(KEY,)).verify_part(48, data, a)  # a rotation's old key
    refused = {
        "another name": (ObjectMAC(KEY, name(1, "q8")), 48, data, a),
        "another key": (ObjectMAC(other_key, auth.name), 48, data, a),
        "another offset": (auth, 49, data, a),
        "another byte": (auth, 48, data[:-1] + b"\x01", a),
        "another nonce": (auth, 48, data, bytes([a[0] ^ 1]) + a[1:]),
        "a short tag": (auth, 48, data, a[:-1]),
        "no tag": (auth, 48, data, None),
    }
    assert [why for why, (m, offset, d, tag) in refused.items() if m.verify_part(offset, d, tag)] == []


# --- non-finite values -----------------------------------------------------------------------

def poisoned(kv, preset, value=float("nan")):
    """An object of ``preset`` whose restore would yield ``value`` (well-formed, checksums right)."""
    if preset in ("raw", "exact"):  # the payload is the values
        bad = kv.clone()
        bad[1, 0, 1, 5, 7] = value
        return encode_chunk(bad, preset, FP)
    obj = encode_chunk(kv, preset, FP)  # quantised: the side information's ranges
    h = container.parse_header(obj)
    side = container.side_tensor(h, container.slice_segment(obj, h, h.side)).clone()
    side[3] = value
    return container.build(h.fields(), container.side_bytes(side), [(s.frames, container.slice_segment(obj, h, s)) for s in h.segments])


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("preset", ["raw", "exact", "q8"])
def test_non_finite_values_are_refused_before_the_buffer(kv, preset, value):
    out = torch.full_like(kv, SENTINEL)
    with pytest.raises(container.CorruptError, match="non-finite"):
        decode_chunk(poisoned(kv, preset, value), FP, out=out)
    assert bool((out == SENTINEL).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_finiteness_check_knows_each_dtype(dtype):
    t = torch.tensor([0.0, -1.5, torch.finfo(dtype).max, torch.finfo(dtype).tiny / 2], dtype=dtype)
    container.check_finite(t, dtype)
    container.check_finite(t.view(torch.uint8).numpy().tobytes(), dtype)
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(container.CorruptError):
            container.check_finite(torch.cat([t, torch.tensor([bad], dtype=dtype)]), dtype)


# --- every fetch path ------------------------------------------------------------------------

async def fetch(store, refs, dest, key, workers=None):
    with ThreadPoolExecutor(4) as io, ThreadPoolExecutor(2) as dec:
        return await executor.fetch(store, refs, dest, fingerprint=FP, io_pool=io, decode_pool=dec, workers=workers,
                                    object_key=key)


def overwrite(store, ref: ChunkRef, obj: bytes) -> ChunkRef:
    """What someone with write access to the store (and no key) can do: put ``obj`` at ``ref``'s name."""
    store.delete(ref.name)
    store.put(ref.name, obj)
    return replace(ref, size=len(obj))


def copy_over(store, src: ChunkRef, dst: ChunkRef) -> ChunkRef:
    """A valid object of another chunk copied to ``dst``'s name."""
    return overwrite(store, dst, store.get(src.name))


@pytest.fixture(params=["threads", "workers", "direct"])
def path(request):
    """(preset, workers) of each way into a buffer: raw chunks always take the direct path."""
    if request.param == "direct":
        return "raw", None
    return "q8", request.getfixturevalue("workers") if request.param == "workers" else None


@pytest.mark.parametrize("attack", ["copied", "forged", "untagged"])
async def test_every_fetch_path_refuses_an_unauthenticated_chunk_before_writing(tmp_path, path, attack):
    preset, w = path
    kv = synthetic_kv(layers=2, heads=2, tokens=3 * CHUNK, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, preset)
    if attack == "copied":
        refs[1] = copy_over(store, refs[2], refs[1])
    elif attack == "forged":
        refs[1] = overwrite(store, refs[1], forge_part(store.get(refs[1].name)))
    else:
        refs[1] = overwrite(store, refs[1], encode_chunk(torch.zeros_like(kv[:, :, :, :CHUNK]), preset, FP, start=CHUNK))
    buf = ipc.allocate(tuple(kv.shape), kv.dtype)
    try:
        buf.tensor.fill_(SENTINEL)
        out = await fetch(store, refs, Destination(buf.tensor, tokens=3 * CHUNK, handle=buf.handle), KEY, w)
        assert out.error == "unauthenticated", out.detail
        assert out.bad_object == refs[1].name  # the sidecar deletes it: the next store heals the prefix
        assert out.loaded_tokens == CHUNK and bool((buf.tensor[:, :, :, CHUNK : 2 * CHUNK] == SENTINEL).all())
    finally:
        buf.close()


async def test_a_fetch_without_the_key_takes_a_copied_chunk(tmp_path):
    """The threat the key removes: CRC-32 alone accepts another chunk's object under this name."""
    kv = synthetic_kv(layers=2, heads=2, tokens=3 * CHUNK, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, "raw")
    refs[1] = copy_over(store, refs[2], refs[1])
    dest = torch.full_like(kv, SENTINEL)
    out = await fetch(store, refs, Destination(dest, tokens=3 * CHUNK), None)
    assert out.error is None and torch.equal(dest[:, :, :, CHUNK : 2 * CHUNK], kv[:, :, :, 2 * CHUNK :])


async def test_the_direct_path_refuses_non_finite_values(tmp_path):
    kv = synthetic_kv(layers=2, heads=2, tokens=2 * CHUNK, head_dim=32)
    kv[1, 1, 0, CHUNK + 3, 2] = float("inf")
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, "raw", key=None)
    dest = torch.full_like(kv, SENTINEL)
    out = await fetch(store, refs, Destination(dest, tokens=2 * CHUNK), None)
    assert out.error == "corrupt" and "non-finite" in out.detail and out.direct_chunks == 1
    assert out.loaded_tokens == CHUNK and bool((dest[:, :, :, CHUNK:] == SENTINEL).all())


# --- the sidecar -----------------------------------------------------------------------------

async def test_a_sidecar_with_the_key_tags_what_it_stores_and_drops_what_it_cannot_verify(tmp_path):
    kv = synthetic_kv(layers=2, heads=2, tokens=2 * CHUNK, head_dim=32)
    tokens = list(range(100, 100 + 2 * CHUNK))
    buf = ipc.allocate(tuple(kv.shape), kv.dtype)
    store = LocalStore(tmp_path)
    sc = Sidecar(store, Config(chunk_tokens=CHUNK, presets=("raw",), object_key=SECRET, decode_procs=0, warm_up=False))
    try:
        await sc.start()
        buf.tensor.copy_(kv)
        bid = sc.register(buf.handle, FP)
        await sc.store(bid, tokens)
        await sc.flush()
        names = [keys.object_name(k, "raw") for k in keys.chunk_keys(sc.buffers[bid].ns, tokens, CHUNK)]
        for n in names:  # written with tags bound to the name
            decode_chunk(store.get(n), FP, auth=ObjectMAC(KEY, n))
        store.delete(names[1])  # a writer without the key puts its own KV there
        store.put(names[1], encode_chunk(torch.zeros_like(kv[:, :, :, :CHUNK]), "raw", FP, start=CHUNK))
        buf.tensor.fill_(SENTINEL)
        reply = await sc.fetch(bid, tokens)  # planned from the index: the object it knew, not the one there now
        assert reply.reason == "unauthenticated" and reply.loaded_tokens == CHUNK
        assert bool((buf.tensor[:, :, :, CHUNK:] == SENTINEL).all())
        reply = await sc.fetch(bid, tokens)  # the index forgot it: listed, the object there now is refused and dropped
        assert reply.reason == "unauthenticated" and reply.loaded_tokens == CHUNK
        assert not store.exists(names[1])  # deleted: the next store writes it anew, tagged
        assert bool((buf.tensor[:, :, :, CHUNK:] == SENTINEL).all())
    finally:
        await sc.close()
        buf.close()


async def test_the_deployment_fixes_the_model_fingerprint(tmp_path):
    buf = ipc.allocate((2, 2, 2, CHUNK, 32), torch.float16)
    sc = Sidecar(LocalStore(tmp_path), Config(chunk_tokens=CHUNK, presets=("raw",), model=FP, decode_procs=0, warm_up=False))
    try:
        with pytest.raises(RequestError, match="serves model"):
            sc.register(buf.handle, "a-poisoners-claim")
        with pytest.raises(RequestError, match="serves model"):
            await sc.lookup(sc.namespace("a-poisoners-claim", "float16"), list(range(CHUNK)))
        assert sc.buffers[sc.register(buf.handle, FP)].ns.model == FP
    finally:
        await sc.close()
        buf.close()


def test_the_object_key_is_validated_and_kept_out_of_reprs_and_errors():
    assert SECRET not in repr(Config(object_key=SECRET)) and SECRET not in repr(ObjectMAC(KEY, "n"))
    with pytest.raises(ValueError, match="at least 16") as e:
        Config.from_env({"KVFETCHER_OBJECT_KEY": "short-key"})
    assert "short-key" not in str(e.value)
    assert mac.key_from("") is None and len(KEY) == 32


def test_all_presets_round_trip_tagged(kv):
    for p in ("raw", "exact", "q8", "lean"):
        pr = presets.get(p)
        obj = encode_chunk(kv, p, FP, rope_theta=10000.0 if pr.pre_rope else None, auth=ObjectMAC(KEY, name(0, p)))
        decode_chunk(obj, FP, auth=ObjectMAC(KEY, name(0, p)))
