"""Engine-decode mode (kvfetcher.integrations.staged with an EngineDecode): the sidecar fetches and
verifies stored objects into the engine's host buffer without decoding them, and the engine restores
them into its paged blocks with the sidecar's own restore. On CPU here (CPU blocks, the CPU codecs:
raw and zstd); the gpu tests decode nvCOMP ANS in an engine whose sidecar sees no CUDA device."""

from __future__ import annotations

import json
import threading
import time
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvfetcher import chunk, codec, ipc, keys
from kvfetcher.api.client import KVClient, SidecarError
from kvfetcher.fetch.plan import EngineDecode, EngineDecoded, FetchOptions
from kvfetcher.format import container, mac
from kvfetcher.integrations import staged
from kvfetcher.integrations.restore_procs import RestoreProcs
from kvfetcher.kvbuffer import PagedLayout, read_blocks, write_blocks
from kvfetcher.store.local import LocalStore

from kvtest import SENTINEL, TOKEN, raw_request, sidecar, synthetic_kv

FP = "engine-decode-model"
N = 64  # chunk tokens
LAYERS, HEADS, HEAD_DIM, BS, BLOCKS = 2, 2, 16, 16, 48
TOKENS = list(range(900, 1540))  # 640 tokens: 10 chunks, 40 blocks
BLOCK_IDS = [int(b) for b in torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(5))[:40]]
DIMS = "BHT(KD)"
LAYOUT = PagedLayout(DIMS, BS)
KV = synthetic_kv(layers=LAYERS, heads=HEADS, tokens=len(TOKENS), head_dim=HEAD_DIM)


def blocks(fill=SENTINEL):
    return [torch.full((BLOCKS, HEADS, BS, 2 * HEAD_DIM), fill, dtype=torch.float16) for _ in range(LAYERS)]


def untouched(tensors, used) -> bool:
    rest = [b for b in range(BLOCKS) if b not in used]
    return bool((read_blocks(tensors, LAYOUT, rest, 0, len(rest) * BS) == SENTINEL).all())


def metric(client: KVClient, name: str, **labels) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in client.metrics().splitlines()
               if line.startswith(name) and not line.startswith("#") and all(w in line for w in want))


def counters(client: KVClient) -> dict[str, float]:
    """Every counter sample of the sidecar, by its name and labels."""
    samples = (line.rsplit(" ", 1) for line in client.metrics().splitlines() if not line.startswith("#"))
    return {k: float(v) for k, v in samples if k.split("{")[0].endswith("_total")}


class Loads(KVClient):
    """A client that records each load's (buffer, first_token, offset, objects answered) and may
    damage the arena after a reply (``after``)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls, self.after = [], None

    def fetch(self, buffer, tokens, plan=None, **kw):
        reply = super().fetch(buffer, tokens, plan, **kw)
        self.calls.append((buffer, kw.get("first_token", 0), kw.get("offset", 0), [tuple(o) for o in reply.objects or ()]))
        if self.after:
            self.after(reply)
        return reply


OBJECT_KEY = "the pool's object key, 32 characters or more"  # (without one no entropy format is read into a GPU engine)

@pytest.fixture
def served_sidecar(tmp_path):
    with sidecar(LocalStore(tmp_path / "store"), chunk_tokens=N, presets=("raw", "q8-zstd"), warm_up=False, object_key=OBJECT_KEY) as sc:
        c = KVClient(socket_path=sc.socket)
        src = blocks()
        write_blocks(src, LAYOUT, BLOCK_IDS, KV)
        buf, st, _ = staged.register(c, src, LAYOUT, FP, 0, 1024)
        assert st.engine is None  # host memory: the sidecar decodes (staged mode) unless asked
        assert st.store(c, buf, TOKENS, BLOCK_IDS, N) == 10
        c.flush()
        st.close()
        yield sc


def engine(sc, staging_tokens=192, client=None, procs=False):
    """An engine-decode staging of fresh blocks; with ``procs`` they are memfds and one restore
    process (which maps them as it maps a GPU's blocks by CUDA IPC) restores whole objects."""
    c = client or Loads(socket_path=sc.socket)
    shared = [ipc.allocate((BLOCKS, HEADS, BS, 2 * HEAD_DIM), torch.float16) for _ in range(LAYERS)] if procs else None
    dst = [b.tensor.fill_(SENTINEL) for b in shared] if procs else blocks()
    write_blocks(dst, LAYOUT, BLOCK_IDS[:10], KV[:, :, :, :160].flip(0))  # the engine's own KV before token 160
    buf, st, _ = staged.register(c, dst, LAYOUT, FP, 0, staging_tokens, engine_decode=True)
    assert st.engine is not None and st.arena not in (None, buf)
    if procs:
        st.workers = RestoreProcs(ipc.paged_handle([b.handle for b in shared], LAYOUT), 1, ("raw", "zstd"))
        _STARTED.append(st.workers)
        deadline = time.monotonic() + 120
        while not st.workers.ready():
            assert time.monotonic() < deadline, "the restore process did not start"
            time.sleep(0.05)
    return c, dst, buf, st


_STARTED: list[RestoreProcs] = []  # restore processes a test started: stopped after it


@pytest.fixture(autouse=True)
def _stop_restore_processes():
    yield
    while _STARTED:
        _STARTED.pop().close()


@pytest.fixture(params=[False, True], ids=["engine-thread", "restore-procs"])
def procs(request):
    return request.param


def sidecar_decoded(sc, preset: str) -> torch.Tensor:
    """What the sidecar itself restores of the prompt in ``preset`` into a flat host buffer."""
    c = KVClient(socket_path=sc.socket)
    flat = ipc.allocate((LAYERS, 2, HEADS, len(TOKENS), HEAD_DIM), torch.float16)
    assert c.fetch(c.register(flat.handle, FP), TOKENS, options=FetchOptions(presets=(preset,), recompute_tokens_per_s=1.0)).loaded_tokens == 640
    return flat.tensor.clone()


@pytest.mark.parametrize("preset", ["raw", "q8-zstd"])
def test_the_engine_restores_the_verified_objects_past_its_own_hit_in_arena_windows(served_sidecar, preset, procs):
    """A load from token 160 through an arena of 192 tokens' bytes: each window's objects are placed
    whole (the chunk straddling 160 too), the engine writes 160..640 only, byte-identical to what the
    sidecar restores itself; the sidecar decoded nothing (its KV counter) and counted the objects.
    With restore processes they restored every whole object (the straddling one: the engine's thread)."""
    c, dst, _, st = engine(served_sidecar, procs=procs)
    kv_before = metric(c, "kvfetcher_kv_bytes_restored_total")
    options = FetchOptions(presets=(preset,), recompute_tokens_per_s=1.0)
    assert st.fetch(c, st.arena, TOKENS, BLOCK_IDS, 160, 640, options=options) == 640
    arenas = [a for a, _, _ in st.arenas]
    assert len(set(arenas)) == 2 and [b for b, _, _, _ in c.calls] == [arenas[k % 2] for k in range(len(c.calls))]  # the two in turn
    assert all(off == 0 for _, _, off, _ in c.calls)  # an arena is addressed by first_token only
    firsts = [first for _, first, _, _ in c.calls]
    assert firsts[0] == 160 and all(f % N == 0 for f in firsts[1:]) and len(firsts) >= 2, firsts  # windows of what fit
    assert [o[0] for call in c.calls for o in call[3]] == list(range(128, 640, N))  # every chunk once, from the one straddling 160
    got = read_blocks(dst, LAYOUT, BLOCK_IDS, 0, 640)
    assert torch.equal(got[:, :, :, :160], KV[:, :, :, :160].flip(0))  # vLLM's own blocks: never written
    assert metric(c, "kvfetcher_kv_bytes_restored_total") == kv_before  # the sidecar decoded none of it
    want = KV if preset == "raw" else sidecar_decoded(served_sidecar, preset)
    assert torch.equal(got[:, :, :, 160:].view(torch.int16), want[:, :, :, 160:].view(torch.int16))
    assert untouched(dst, BLOCK_IDS)
    assert metric(c, "kvfetcher_engine_objects_total", preset=preset) == 8
    assert (st.workers.restored if procs else 0) == (7 if procs else 0)  # 192..640: seven whole chunks
    st.fetch(c, st.arena, TOKENS, BLOCK_IDS, 160, 640, options=options)  # its report of the first load rides on this one
    assert metric(c, "kvfetcher_engine_kv_bytes_total", preset=preset) > 0
    assert metric(c, "kvfetcher_engine_decode_seconds_total", preset=preset) > 0


def test_the_sidecar_fills_the_next_window_while_the_engine_restores_this_one(served_sidecar, monkeypatch):
    """Windows of two chunks (an arena of 192 tokens' KV holds two raw objects with their headers),
    each object's restore made slow: the second window's fetch has
    answered before the first window's restores end (two arenas in turn), and the load is whole."""
    c, dst, _, st = engine(served_sidecar)
    events, restore = [], staged.chunk.restore_object

    def slow_restore(*a, **kw):
        time.sleep(0.2)  # far longer than a window's fetch from the local store
        out = restore(*a, **kw)
        events.append(("restored", a[1].start))
        return out

    c.after = lambda reply: events.append(("fetched", reply.objects[0][0]))
    monkeypatch.setattr(staged.chunk, "restore_object", slow_restore)
    assert st.fetch(c, st.arena, TOKENS, BLOCK_IDS, 0, 640, options=FetchOptions(presets=("raw",), recompute_tokens_per_s=1.0)) == 640
    assert events.index(("fetched", 128)) < events.index(("restored", 64)), events  # window 2 was in before window 1's last chunk
    assert torch.equal(read_blocks(dst, LAYOUT, BLOCK_IDS, 0, 640).view(torch.int16), KV.view(torch.int16))


def test_the_deadline_bounds_the_restores_here_and_the_rest_is_recomputed(served_sidecar, monkeypatch):
    """One window holding every object (an arena of 1024 tokens), each object's restore made slow
    (0.2 s) under a 0.5 s deadline: the restores stop once it has passed, the load ends at the last
    whole chunk written, and no block past it is touched; without a deadline the same load is whole."""
    c, dst, _, st = engine(served_sidecar, staging_tokens=1024)
    restore = staged.chunk.restore_object

    def slow_restore(*a, **kw):
        time.sleep(0.2)
        return restore(*a, **kw)

    monkeypatch.setattr(staged.chunk, "restore_object", slow_restore)
    opts = FetchOptions(presets=("raw",), recompute_tokens_per_s=1.0, deadline_s=0.5)
    t0 = time.monotonic()
    upto = st.fetch(c, st.arena, TOKENS, BLOCK_IDS, 0, 640, options=opts)
    assert 0 < upto < 640 and upto % N == 0 and time.monotonic() - t0 < 1.5, upto
    assert len(c.calls) == 1  # one window: the restores here, not the windows, were cut short
    got = read_blocks(dst, LAYOUT, BLOCK_IDS, 0, 640)
    assert torch.equal(got[:, :, :, :upto].view(torch.int16), KV[:, :, :, :upto].view(torch.int16))
    assert bool((got[:, :, :, upto:] == SENTINEL).all())
    assert st.fetch(c, st.arena, TOKENS, BLOCK_IDS, 0, 640, options=FetchOptions(presets=("raw",), recompute_tokens_per_s=1.0)) == 640


@pytest.mark.parametrize("engine_decode", [True, False])
def test_a_fetch_waits_for_a_busy_staging_buffer_no_longer_than_its_deadline(served_sidecar, engine_decode):
    """A store holds the buffer (its copy out of the blocks) past the fetch's 0.3 s deadline: the
    fetch loads nothing and returns by then, in engine-decode and in staged mode alike; once the
    buffer is free the same fetch loads."""
    if engine_decode:
        c, dst, buf, st = engine(served_sidecar)
        buf = st.arena
    else:
        c, dst = Loads(socket_path=served_sidecar.socket), blocks()
        buf, st, _ = staged.register(c, dst, LAYOUT, FP, 0, 192)
    opts = FetchOptions(presets=("raw",), recompute_tokens_per_s=1.0, deadline_s=0.3)
    st.lock.acquire()
    threading.Timer(1.5, st.lock.release).start()
    before, t0 = read_blocks(dst, LAYOUT, BLOCK_IDS, 0, 640), time.monotonic()
    assert st.fetch(c, buf, TOKENS, BLOCK_IDS, 0, 640, options=opts) == 0
    assert time.monotonic() - t0 < 1.0 and not c.calls
    assert torch.equal(read_blocks(dst, LAYOUT, BLOCK_IDS, 0, 640), before)  # nothing written
    time.sleep(1.6)
    assert st.fetch(c, buf, TOKENS, BLOCK_IDS, 0, 640, options=replace(opts, deadline_s=30.0)) == 640


def test_a_window_that_fails_to_restore_ends_the_load_after_the_window_fetched_ahead(served_sidecar):
    """The second window's second object (tokens 192..256) altered after the sidecar verified it:
    the load ends there, and the third window, fetched meanwhile, has answered before it returns."""
    c, dst, _, st = engine(served_sidecar)

    def damage(reply):
        if reply.objects[0][0] == 128:
            start, offset, size = reply.objects[1]
            memory = next(m for a, _, m in st.arenas if a == c.calls[-1][0])
            memory[offset + size - 3] ^= 0xFF

    c.after = damage
    assert st.fetch(c, st.arena, TOKENS, BLOCK_IDS, 0, 640, options=FetchOptions(presets=("raw",), recompute_tokens_per_s=1.0)) == 192
    assert [first for _, first, _, _ in c.calls] == [0, 128, 256]  # the third asked before the second failed, and waited for
    got = read_blocks(dst, LAYOUT, BLOCK_IDS, 0, 640)
    assert torch.equal(got[:, :, :, :192].view(torch.int16), KV[:, :, :, :192].view(torch.int16))
    assert bool((got[:, :, :, 192:] == SENTINEL).all())


def test_a_load_ends_at_end_and_a_window_never_writes_past_it(served_sidecar):
    c, dst, _, st = engine(served_sidecar, staging_tokens=1024)
    plan = c.lookup(st.arena, TOKENS + [1, 2], FetchOptions(presets=("q8-zstd",), recompute_tokens_per_s=1.0))
    assert (plan.preset, plan.loaded_tokens) == ("q8-zstd", 640)
    assert st.fetch(c, st.arena, TOKENS + [1, 2], BLOCK_IDS, 0, 320, plan) == 320
    assert len(c.calls) == 1  # one window holds it all, with the plan
    got = read_blocks(dst, LAYOUT, BLOCK_IDS, 0, 640)
    assert bool((got[:, :, :, 320:] == SENTINEL).all()) and untouched(dst, BLOCK_IDS[:20])


def test_a_corrupt_stored_object_never_reaches_the_blocks(served_sidecar, tmp_path):
    """Chunk 5's q8-zstd object damaged in the store: the sidecar's check stops the load there
    (chunks 2-4 restored, nothing of 5 or later written) and deletes the object."""
    ck = keys.chunk_keys(keys.Namespace(FP, "float16", shape=(LAYERS, HEADS, HEAD_DIM)), TOKENS, N)
    path = tmp_path / "store" / keys.object_name(ck[5], "q8-zstd")
    obj = bytearray(path.read_bytes())
    h = container.parse_header(bytes(obj))
    obj[h.header_size + h.segments[0].offset + 5] ^= 0xFF
    path.write_bytes(bytes(obj))
    c, dst, _, st = engine(served_sidecar, staging_tokens=1024)
    assert st.fetch(c, st.arena, TOKENS, BLOCK_IDS, 128, 640, options=FetchOptions(presets=("q8-zstd",), recompute_tokens_per_s=1.0)) == 320
    assert [o[0] for o in c.calls[0][3]] == [128, 192, 256]
    got = read_blocks(dst, LAYOUT, BLOCK_IDS, 0, 640)
    assert bool((got[:, :, :, 320:] == SENTINEL).all()) and untouched(dst, BLOCK_IDS[:20])
    assert not path.exists()


def test_bytes_changed_in_the_arena_after_the_reply_are_refused_by_the_engine(served_sidecar, procs):
    """The engine re-checks every part's CRC-32 on the bytes it decodes: an object altered after the
    sidecar verified it (here the third of the window) is not decoded; the chunks before it are
    (with restore processes too, which check what they map of the arena)."""
    c = Loads(socket_path=served_sidecar.socket)
    c, dst, _, st = engine(served_sidecar, staging_tokens=1024, client=c, procs=procs)

    def damage(reply):
        start, offset, size = reply.objects[2]
        memory = next(m for a, _, m in st.arenas if a == c.calls[-1][0])  # the arena this reply filled
        memory[offset + size - 3] ^= 0xFF  # inside its last segment

    c.after = damage
    assert st.fetch(c, st.arena, TOKENS, BLOCK_IDS, 0, 640, options=FetchOptions(presets=("q8-zstd",), recompute_tokens_per_s=1.0)) == 128
    got = read_blocks(dst, LAYOUT, BLOCK_IDS, 0, 640)
    assert torch.equal(got[:, :, :, 128:160], KV[:, :, :, 128:160].flip(0))  # its blocks as the engine had them
    # restore processes may have written whole objects after it meanwhile: past the end returned, recomputed by the engine
    assert bool((got[:, :, :, 160 : 192 if procs else 640] == SENTINEL).all()) and untouched(dst, BLOCK_IDS if procs else BLOCK_IDS[:10])


def test_plans_for_an_engine_buffer_use_its_formats_and_rates(served_sidecar, tmp_path):
    """An engine decoding on a GPU: its plan weighs `q8-ans` (whether or not this sidecar has an ans
    decoder), and `q8-zstd` at a GPU's rate after the fetch (not overlapped with it); the sidecar's own buffers see `ans`
    only where it can decode it (nvCOMP on a GPU)."""
    ns = keys.Namespace(FP, "float16", shape=(LAYERS, HEADS, HEAD_DIM))
    store, tokens = LocalStore(tmp_path / "store"), [t + 7 for t in TOKENS]
    for k in keys.chunk_keys(ns, tokens, N):  # listed sizes are all a plan reads
        for preset in ("q8-ans", "q8-zstd"):
            store.put(keys.object_name(k, preset), bytes(4000))
    c = KVClient(socket_path=served_sidecar.socket)
    flat = ipc.allocate((LAYERS, 2, HEADS, 256, HEAD_DIM), torch.float16)
    own = c.register(flat.handle, FP)
    gpu = c.register(flat.handle, FP, engine=EngineDecode(("raw", "zstd", "ans"), "cuda"))
    slow = FetchOptions(recompute_tokens_per_s=1.0, refresh=True)
    mine, theirs = c.lookup(own, tokens, slow), c.lookup(gpu, tokens, slow)
    assert ("q8-ans" in mine.options) == codec.decodable("ans") and "q8-ans" in theirs.options
    if torch.cuda.is_available():  # this sidecar decodes zstd at a GPU's rate too, overlapped with the download
        assert theirs.options["q8-zstd"] > mine.options["q8-zstd"]  # the engine decodes after the fetch
    else:
        assert theirs.options["q8-zstd"] < mine.options["q8-zstd"]  # decoded at a GPU's rate, not this CPU's
    assert c.lookup(None, tokens, slow, model=FP, kv_shape=(LAYERS, HEADS, HEAD_DIM)).options.keys() == theirs.options.keys()  # the scheduler's


@pytest.mark.parametrize("trust_store", [False, True])
def test_without_an_object_key_a_gpu_engine_is_handed_no_entropy_object_unless_the_store_is_trusted(tmp_path, trust_store):
    """A GPU engine decodes entropy formats with nvCOMP, which does not validate its input: a sidecar
    without an object key plans none for it (zstd still for its own buffers: decoded on the CPU),
    unless told its store is trusted (KVFETCHER_TRUST_STORE)."""
    ns = keys.Namespace(FP, "float16", shape=(LAYERS, HEADS, HEAD_DIM))
    store = LocalStore(tmp_path / "store")
    for k in keys.chunk_keys(ns, TOKENS, N):  # listed sizes are all a plan reads
        for preset in ("q8-ans", "q8-zstd", "raw"):
            store.put(keys.object_name(k, preset), bytes(4000))
    with sidecar(store, chunk_tokens=N, presets=("raw",), warm_up=False, trust_store=trust_store) as sc:
        c = KVClient(socket_path=sc.socket)
        flat = ipc.allocate((LAYERS, 2, HEADS, 256, HEAD_DIM), torch.float16)
        own, gpu = c.register(flat.handle, FP), c.register(flat.handle, FP, engine=EngineDecode(("raw", "zstd", "ans"), "cuda"))
        slow = FetchOptions(recompute_tokens_per_s=1.0, refresh=True)
        mine, theirs = c.lookup(own, TOKENS, slow), c.lookup(gpu, TOKENS, slow)
    assert "raw" in theirs.options and "q8-zstd" in mine.options
    assert ("q8-zstd" in theirs.options) == ("q8-ans" in theirs.options) == trust_store
    assert ("q8-ans" in mine.options) == (trust_store and codec.decodable("ans"))


def test_the_wire_contract_is_checked(served_sidecar):
    c = KVClient(socket_path=served_sidecar.socket)
    flat = ipc.allocate((LAYERS, 2, HEADS, 256, HEAD_DIM), torch.float16)
    own = c.register(flat.handle, FP)
    arena = c.register(flat.handle, FP, engine=EngineDecode(("raw", "zstd"), "cpu"))
    with pytest.raises(SidecarError, match="only for an engine-decode buffer"):
        c.fetch(own, TOKENS, decoded=[EngineDecoded("raw", 10, 0.1)])
    with pytest.raises(SidecarError, match="no slots, offset or block_ids"):
        c.fetch(arena, TOKENS, offset=-64, first_token=64)
    for formats, device, match in ((("h264",), "cuda", "engine formats"), (("raw",), "tpu", "engine device")):
        body = {"model": FP, "handle": {"kind": "cuda", "args": {"tuple": []}, "shape": [1], "dtype": "float16"},
                "engine": {"formats": list(formats), "device": device}}
        status, reply = raw_request(served_sidecar.where["port"], "POST", "/v1/buffers", json.dumps(body).encode(),
                                    {"Authorization": f"Bearer {TOKEN}"})
        assert status == 400 and match in json.loads(reply)["detail"], reply
    body = {"model": FP, "handle": {"kind": "cuda", "args": {"tuple": []}, "shape": [1], "dtype": "float16"}, "engine": {"formats": ["raw"]}}
    status, reply = raw_request(served_sidecar.where["port"], "POST", "/v1/buffers", json.dumps(body).encode(), {"Authorization": f"Bearer {TOKEN}"})
    assert status == 400 and "memfd" in json.loads(reply)["detail"], reply


def test_an_arena_holding_no_object_is_a_clear_error(served_sidecar):
    c = KVClient(socket_path=served_sidecar.socket)
    tiny = ipc.allocate((LAYERS, 2, HEADS, 8, HEAD_DIM), torch.float16)
    arena = c.register(tiny.handle, FP, engine=EngineDecode(("raw",), "cpu"))
    with pytest.raises(SidecarError, match="holds no stored object"):
        c.fetch(arena, TOKENS, options=FetchOptions(presets=("raw",), recompute_tokens_per_s=1.0))


def test_restore_object_is_the_one_restore(tmp_path):
    """decode_chunk goes through restore_object, which refuses a foreign model before decoding."""
    obj = chunk.encode_chunk(KV[:, :, :, :N], "q8-zstd", FP)
    assert torch.equal(chunk.decode_chunk(obj, FP), chunk.decode_chunk(obj, FP, out=torch.empty_like(KV[:, :, :, :N])))
    with pytest.raises(Exception, match="fingerprint|model"):
        chunk.decode_chunk(obj, "another-model")


# --- GPU: a device-plugin pod, whose sidecar sees no CUDA device -------------------------------


def _gpu_with_nvcomp() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kvfetcher.codec import nvcomp

    if not nvcomp.available():
        pytest.skip("needs nvCOMP (the kvfetcher[gpu] extra)")


def _hidden_cuda_sidecar(tmp_path, **env) -> dict[str, str]:
    return {**dict(KVFETCHER_STORE_DIR=str(tmp_path / "store"), KVFETCHER_CHUNK_TOKENS=str(N), KVFETCHER_PRESET="raw",
                   KVFETCHER_WARM_UP="0", CUDA_VISIBLE_DEVICES=""), **env}


@pytest.mark.gpu
def test_gpu_blocks_load_ans_decoded_here_through_a_sidecar_without_cuda(tmp_path):
    """GPU blocks, a sidecar process with CUDA hidden: the registration is refused as no_device, so
    the connector decodes itself; `q8-ans` objects (coded on this GPU, as a GPU pod elsewhere in the
    fleet would) load from token 160 byte-identical to this GPU's own decode of them, with nothing
    decoded by the sidecar, which has no ANS decoder at all."""
    _gpu_with_nvcomp()
    from kvtest import served

    kv = KV.cuda()
    ns = keys.Namespace(FP, "float16", shape=(LAYERS, HEADS, HEAD_DIM))
    store = LocalStore(tmp_path / "store")
    want = torch.empty_like(kv)
    for i, k in enumerate(keys.chunk_keys(ns, TOKENS, N)):
        name = keys.object_name(k, "q8-ans")  # tagged: without a key no ans object is read into a GPU engine
        obj = chunk.encode_chunk(kv[:, :, :, i * N : (i + 1) * N], "q8-ans", FP, start=i * N,
                                 auth=mac.ObjectMAC(mac.key_from(OBJECT_KEY), name))
        store.put(name, obj)
        want[:, :, :, i * N : (i + 1) * N] = chunk.decode_chunk(obj, FP, device="cuda")
    with served(str(tmp_path / "kvf.sock"), _hidden_cuda_sidecar(tmp_path, KVFETCHER_OBJECT_KEY=OBJECT_KEY)):
        c = Loads(socket_path=str(tmp_path / "kvf.sock"))
        dst = [b.cuda() for b in blocks()]
        write_blocks(dst, LAYOUT, BLOCK_IDS[:10], kv[:, :, :, :160].flip(0))
        torch.cuda.synchronize()
        buf, st, why = staged.register(c, dst, LAYOUT, FP, 0, 192)
        assert st is not None and st.engine is not None and "ans" in st.engine.formats and "needs a sidecar with CUDA" in why, why
        options = FetchOptions(presets=("q8-ans",), recompute_tokens_per_s=1.0)
        assert st.fetch(c, buf, TOKENS, BLOCK_IDS, 160, 640, options=options) == 640
        got = read_blocks(dst, LAYOUT, BLOCK_IDS, 0, 640)
        assert torch.equal(got[:, :, :, :160], kv[:, :, :, :160].flip(0))
        assert torch.equal(got[:, :, :, 160:].view(torch.int16), want[:, :, :, 160:].view(torch.int16))
        assert metric(c, "kvfetcher_engine_objects_total", preset="q8-ans") == 8
        assert metric(c, "kvfetcher_kv_bytes_restored_total") == 0
        plan = c.lookup(st.arena, TOKENS, FetchOptions(recompute_tokens_per_s=1.0, refresh=True))
        assert plan.preset == "q8-ans", plan  # auto weighs the format only this engine decodes


@pytest.mark.gpu
@pytest.mark.parametrize("engine_procs", [0, 2])
def test_gpu_blocks_restored_by_this_process_when_asked_although_the_sidecar_opens_the_gpu(tmp_path, engine_procs):
    """``engine_decode=True`` (the connector's option): the sidecar sees the GPU and could restore
    into the blocks itself, yet the registration is engine-decode and the load is restored here, in
    this process' CUDA context, or with ``engine_procs`` in its restore processes (CUDA IPC of the
    blocks); raw objects arrive byte-identical."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kvtest import served

    kv = KV.cuda()
    ns = keys.Namespace(FP, "float16", shape=(LAYERS, HEADS, HEAD_DIM))
    store = LocalStore(tmp_path / "store")
    for i, k in enumerate(keys.chunk_keys(ns, TOKENS, N)):
        store.put(keys.object_name(k, "raw"), chunk.encode_chunk(kv[:, :, :, i * N : (i + 1) * N].cpu(), "raw", FP, start=i * N))
    env = {k: v for k, v in _hidden_cuda_sidecar(tmp_path).items() if k != "CUDA_VISIBLE_DEVICES"}
    with served(str(tmp_path / "kvf.sock"), env):
        c = Loads(socket_path=str(tmp_path / "kvf.sock"))
        dst = [b.cuda() for b in blocks()]
        buf, st, why = staged.register(c, dst, LAYOUT, FP, 0, 192, engine_decode=True, engine_procs=engine_procs)
        assert st is not None and st.engine is not None and "engine_decode" in why, why
        deadline = time.monotonic() + 120
        while engine_procs and not st.workers.ready():
            assert time.monotonic() < deadline, "the restore processes did not start"
            time.sleep(0.05)
        assert st.fetch(c, buf, TOKENS, BLOCK_IDS, 0, 640, options=FetchOptions(presets=("raw",), recompute_tokens_per_s=1.0)) == 640
        assert torch.equal(read_blocks(dst, LAYOUT, BLOCK_IDS, 0, 640).view(torch.int16), kv.view(torch.int16))
        assert metric(c, "kvfetcher_engine_objects_total", preset="raw") == 10 and metric(c, "kvfetcher_kv_bytes_restored_total") == 0
        assert (st.workers.restored if engine_procs else 0) == (10 if engine_procs else 0)
        st.close()


@pytest.mark.gpu
def test_gpu_vllm_engine_decodes_ans_past_its_own_hit_with_a_sidecar_without_cuda(tmp_path):
    """A real vLLM engine (SmolLM2, bf16) beside a sidecar with CUDA hidden, as in a device-plugin pod:
    the connector picks engine-decode by itself. A prompt's first 1,024 tokens are stored (raw, by
    that sidecar), then also as `q8-ans` (coded on this GPU, as a GPU pod elsewhere would); after
    the sidecar restarts (its index lists both), vLLM holds the prompt's first 400 tokens itself and
    the forced `q8-ans` load fills 400..1024: the engine decoded the objects on its GPU (the sidecar
    handed over 3 objects and decoded nothing, the engine reported its decodes). The restarted
    sidecar knows no buffer of the engine until the load registers it again, so the load plans with
    the request's own presets. The forced `raw` load's 32 greedy tokens equal those of vLLM's own
    prefix-cache hit at the same split (`q8-ans`'s, lossy, are reported). One device call, <= 150 s."""
    _gpu_with_nvcomp()
    pytest.importorskip("vllm")
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # this process touches CUDA before the engine starts
    from benchmarks.vllm_ttft.engine import generate, smollm2_dir, start_llm, wait_stored, warm_index
    from benchmarks.vllm_ttft.vllm_ttft_bench import filler, identity_prompts
    from kvtest import served

    split, shared, new, chunk_tokens, fp = 1024, 400, 32, 256, "smollm2-135m"
    d = smollm2_dir()
    prompt = identity_prompts(d)["raw"]
    cfg = json.loads((d / "config.json").read_text())
    look = dict(model=fp, dtype="bfloat16", kv_shape=(cfg["num_hidden_layers"], cfg["num_key_value_heads"],
                                                      cfg["hidden_size"] // cfg["num_attention_heads"]))
    sock = str(tmp_path / "kvf.sock")
    env = _hidden_cuda_sidecar(tmp_path, KVFETCHER_CHUNK_TOKENS=str(chunk_tokens), KVFETCHER_OBJECT_KEY=OBJECT_KEY)
    llm, out = None, {}
    with served(sock, env):
        client = KVClient(socket_path=sock)
        llm = start_llm(d, sock, fp, prefix_caching=True, max_model_len=2048, timeout_s=120, gpu_memory_utilization=0.3)
        run = lambda p, params: generate(llm, [p], new, params, 60)[1][0]  # noqa: E731 - (tokens, num_cached_tokens)
        run(prompt[:split] + filler(10, len(prompt) - split), {})  # computed; its save stores the prefix's 4 chunks
        wait_stored(client, prompt, split, look)
        hit, hit_cached = run(prompt, {})  # vLLM's own prefix cache at the split
        ref, _ = run(prompt, None)  # a recompute
        assert hit_cached == split
    ns = keys.Namespace(fp, "bfloat16", shape=look["kv_shape"])
    store = LocalStore(tmp_path / "store")
    for i, k in enumerate(keys.chunk_keys(ns, prompt[:split], chunk_tokens)):  # the same KV, also as q8-ans
        kv = chunk.decode_chunk(store.get(keys.object_name(k, "raw")), fp, device="cuda")
        name = keys.object_name(k, "q8-ans")
        store.put(name, chunk.encode_chunk(kv, "q8-ans", fp, start=i * chunk_tokens, auth=mac.ObjectMAC(mac.key_from(OBJECT_KEY), name)))
    with served(sock, env):  # a fresh index, which lists both presets
        client = KVClient(socket_path=sock)
        assert warm_index(client, prompt, **look) == split
        for preset in ("q8-ans", "raw"):  # raw's load carries the engine's report of its ans decodes
            llm.reset_prefix_cache()
            run(prompt[:shared] + filler(20, len(prompt) - shared), None)  # vLLM holds the first 400 tokens itself
            before = counters(client)
            tokens, cached = run(prompt, {"presets": [preset], "ttft_budget_s": 1e6})
            grew = {k: v - before.get(k, 0.0) for k, v in counters(client).items() if v != before.get(k, 0.0)}
            out[preset] = dict(cached=cached, objects=grew.get(f'kvfetcher_engine_objects_total{{preset="{preset}"}}', 0),
                               equals_vllm_hit=tokens == hit, equals_recompute=tokens == ref,
                               sidecar_decoded_bytes=grew.get("kvfetcher_kv_bytes_restored_total", 0), counters_grew=grew)
            print(f"[{preset} forced] {out[preset]}", flush=True)
        out["engine_reported_ans_kv_bytes"] = metric(client, "kvfetcher_engine_kv_bytes_total", preset="q8-ans")
    print(json.dumps(out), flush=True)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "engine_decode_vllm.json").write_text(json.dumps(out, indent=1))
    for preset in ("q8-ans", "raw"):
        r = out[preset]
        assert r["cached"] == split and r["objects"] == 3 and r["sidecar_decoded_bytes"] == 0, (preset, r)
        decided = {k: v for k, v in r["counters_grew"].items() if k.startswith(("kvfetcher_preset_decisions_total", "kvfetcher_fallbacks_total"))}
        assert decided == {f'kvfetcher_preset_decisions_total{{preset="{preset}"}}': 1.0}, (preset, r)
        assert r["equals_vllm_hit"] and r["equals_recompute"], (preset, r)  # q8 is lossy, yet on this prompt not one of the 32 tokens may move
    assert out["engine_reported_ans_kv_bytes"] > 0, out


DAEMON_CHILD = '''
import multiprocessing as mp

def child(q):
    from kvfetcher.fetch.workers import DecodeWorkers
    try:
        mp.get_context("spawn").Process(target=print).start()
        plain = "allowed"
    except AssertionError:
        plain = "refused"
    w = DecodeWorkers(1)
    w.start()
    w.close()
    q.put((plain, "started", mp.current_process().daemon))

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,), daemon=True)
    p.start()
    print(*q.get(timeout=120))
    p.join()
'''


def test_restore_processes_start_from_a_daemonic_process_as_vllms_tensor_parallel_workers_are(tmp_path):
    """multiprocessing refuses children to a daemonic process (vLLM's tensor-parallel workers); decode
    workers (the restore processes) start there all the same, and the process stays daemonic."""
    import subprocess
    import sys

    script = tmp_path / "daemon_child.py"
    script.write_text(DAEMON_CHILD)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "refused started True", out.stdout


def test_a_store_copied_out_by_the_restore_processes_loads_back_identical(tmp_path):
    """Engine-decode with a restore process: a prompt's blocks stored through the staging (copied
    out by the process, in windows of 192 tokens), then loaded into other blocks, are the same bytes."""
    with sidecar(LocalStore(tmp_path / "store"), chunk_tokens=N, presets=("raw",), warm_up=False) as sc:
        c, dst, buf, st = engine(sc, procs=True)
        write_blocks(dst, LAYOUT, BLOCK_IDS, KV)
        assert st.store(c, buf, TOKENS, BLOCK_IDS, N) == 10
        assert st.workers.copied == 4  # 640 tokens in windows of 192 (three chunks each): one piece a window
        c.flush()
        st.close()
        c2, back, _, st2 = engine(sc, staging_tokens=1024)
        assert st2.fetch(c2, st2.arena, TOKENS, BLOCK_IDS, 0, 640, options=FetchOptions(presets=("raw",), recompute_tokens_per_s=1.0)) == 640
        assert torch.equal(read_blocks(back, LAYOUT, BLOCK_IDS, 0, 640).view(torch.int16), KV.view(torch.int16))


def test_restore_processes_closed_while_they_start_leave_none_behind():
    """``close`` right after the processes began starting (a registration that failed): once it
    returns no restore process is alive, and none starts later."""
    import multiprocessing

    def workers() -> set[int]:
        return {p.pid for p in multiprocessing.active_children() if p.name == "kvf-decode-worker"}

    before = workers()  # (another test's, not yet collected)
    shared = ipc.allocate((BLOCKS, HEADS, BS, 2 * HEAD_DIM), torch.float16)
    procs = RestoreProcs(ipc.paged_handle([shared.handle], LAYOUT), 2, ("raw",))
    time.sleep(0.2)
    procs.close()
    time.sleep(3)
    assert not procs.ready()
    assert not workers() - before
