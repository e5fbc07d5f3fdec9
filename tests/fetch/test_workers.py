"""Decode worker processes: fetches restored by other processes into a shared buffer (CPU: a memfd).

The same code drives NVDEC in worker processes on a GPU (tests/fetch/test_fetch_gpu.py);
here the workers decode with libavcodec and write through the buffer's shared-memory handle.
"""

import asyncio
import logging
import os
import signal
import sys

import pytest
import torch

from kvfetcher.codec import basis
from kvfetcher.format import container
from kvfetcher import ipc
from kvfetcher.fetch.workers import DecodeWorkers, warmup_object
from kvfetcher.kvbuffer import Destination
from kvfetcher.store.local import LocalStore
from kvfetcher.fetch.plan import FetchOptions

from kvtest import (SENTINEL, buffer_shape, corrupt_segment, corrupt_side, decoded, fetch, foreign, garbage_bitstream, put_chunks, running,
                    synthetic_kv, truncate_after_listing, undecodable)


@pytest.fixture
def shared(shm):
    """A shared buffer for ``kv`` (``capacity`` slots) holding SENTINEL: ``shared(kv, capacity)``."""
    return lambda kv, capacity=None: shm(buffer_shape(kv, capacity), kv.dtype, fill=SENTINEL)


@pytest.mark.parametrize("preset", ["raw", "q8"])
async def test_workers_restore_what_threads_restore_and_raw_bypasses_them(tmp_path, workers, shared, preset):
    kv = synthetic_kv(layers=3, heads=2, tokens=96, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset=preset)
    slots = torch.randperm(130)[:96].tolist()  # scattered, as in a paged cache
    buf = shared(kv, capacity=130)
    dest = Destination(buf.tensor, slots=slots, handle=buf.handle)
    before = workers.stats["chunks"]
    out = await fetch(store, refs, dest, workers=workers)
    assert out.error is None and out.loaded_tokens == 96, out.detail
    # raw is the buffer's own bytes: restored by the direct path, never through a worker's slab
    direct = preset == "raw"
    assert (out.direct_chunks, workers.stats["chunks"] - before) == ((3, 0) if direct else (0, 3))
    assert out.kv_bytes == kv.numel() * kv.element_size()
    assert torch.equal(buf.tensor[:, :, :, slots], decoded(store, refs))
    untouched = sorted(set(range(130)) - set(slots))
    assert bool((buf.tensor[:, :, :, untouched] == SENTINEL).all())


async def test_undecodable_chunk_in_a_worker_is_never_written(tmp_path, workers, shared):
    kv = synthetic_kv(layers=2, heads=2, tokens=96, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset="q8")
    refs[1] = garbage_bitstream(store, refs[1])
    buf = shared(kv)
    out = await fetch(store, refs, Destination(buf.tensor, tokens=96, handle=buf.handle), window=1, workers=workers)
    assert out.error == "corrupt", out.detail
    assert out.loaded_tokens == 32
    assert bool((buf.tensor[:, :, :, 32:64] == SENTINEL).all())


async def test_a_dead_worker_fails_the_fetch_and_is_replaced(tmp_path, shared):
    kv = synthetic_kv(layers=2, heads=2, tokens=64, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset="q8")  # a worker's format (raw takes the direct path)
    w = DecodeWorkers(1)
    try:
        w.start()
        os.kill(w._workers[0].proc.pid, signal.SIGKILL)
        w._workers[0].proc.join(5)
        buf = shared(kv)
        dest = Destination(buf.tensor, tokens=64, handle=buf.handle)
        out = await fetch(store, refs, dest, workers=w)
        # the chunk the dead worker held fails; one that reached the replacement may have landed
        assert out.error == "decoder" and out.loaded_tokens < 64, out
        assert torch.equal(buf.tensor[:, :, :, : out.loaded_tokens], decoded(store, refs)[:, :, :, : out.loaded_tokens])
        out = await fetch(store, refs, dest, workers=w)  # a fresh worker took its place
        assert out.error is None and torch.equal(buf.tensor, decoded(store, refs))
    finally:
        w.close()


async def test_workers_need_the_buffer_handle(tmp_path, workers):
    kv = synthetic_kv(layers=2, heads=2, tokens=32, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32)
    with pytest.raises(ValueError, match="IPC handle"):
        await fetch(store, refs, Destination(torch.zeros_like(kv), tokens=32), workers=workers)


@pytest.mark.parametrize("damage, reason", [(corrupt_segment, "corrupt"), (corrupt_side, "corrupt"), (truncate_after_listing, "truncated"),
                                            (foreign, "foreign")])
async def test_a_damaged_chunk_is_caught_before_any_worker_writes(tmp_path, workers, shared, damage, reason):
    """Checksums are computed in the workers on this path: still nothing unverified is written."""
    kv = synthetic_kv(layers=2, heads=2, tokens=96, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset="q8")
    first = decoded(store, refs[:1])
    refs[1] = damage(store, refs[1])
    buf = shared(kv)
    out = await fetch(store, refs, Destination(buf.tensor, tokens=96, handle=buf.handle), window=1, workers=workers)
    assert out.error == reason, out.detail
    assert out.loaded_tokens == 32 and torch.equal(buf.tensor[:, :, :, :32], first)
    assert bool((buf.tensor[:, :, :, 32:64] == SENTINEL).all())


async def test_a_buffer_the_workers_cannot_open_is_restored_in_process(tmp_path, workers, shared):
    """If workers cannot map the buffer (seen with a later CUDA IPC buffer on an H200), the chunk is
    decoded in the calling process from the bytes already read: the fetch still completes."""
    kv = synthetic_kv(layers=2, heads=2, tokens=64, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset="q8")
    buf = shared(kv)
    gone = dict(buf.handle, inode=[0, 0])  # a handle no worker can open: it names another file
    before = workers.stats["chunks"]
    out = await fetch(store, refs, Destination(buf.tensor, tokens=64, handle=gone), workers=workers)
    assert out.error is None and out.loaded_tokens == 64, out.detail
    assert workers.stats["chunks"] == before  # restored in this process
    assert torch.equal(buf.tensor, decoded(store, refs))
    assert out.bytes_read == sum(r.size for r in refs)  # nothing downloaded twice


# --- warm-up and eager open ---------------------------------------------------------------------


def round_trip(workers):
    """A request through every worker: the one-way messages sent before it have been handled."""
    assert workers.warm("cpu", [warmup_object("q8")]).restored == [1] * workers.procs


def test_a_warm_up_object_runs_the_code_paths_of_its_preset():
    h = container.parse_header(warmup_object("balanced"))
    assert h.layout.basis and h.layout.trellis and h.layout.sparse_tokens and h.layout.exact_tokens
    assert h.side is not None and all(s.length for s in h.segments)


def test_a_warm_up_object_of_a_model_s_geometry_is_coded_as_its_chunks_are():
    from kvfetcher.format import presets

    h = container.parse_header(warmup_object("q8", (4, 2, 32, 64), torch.bfloat16, "another-model"))
    assert (tuple(h.shape), h.dtype, h.start) == ((4, 2, 2, 32, 64), "bfloat16", 32)
    with pytest.raises(ValueError, match="needs a calibration"):  # never stored for it, so never warmed
        warmup_object("balanced", (4, 2, 32, 64), torch.bfloat16, "another-model")
    L, H, D = basis.load(presets.get("balanced").layout.basis).shape
    h = container.parse_header(warmup_object("balanced", (L, H, 256, D), torch.bfloat16, "smollm2-135m-instruct-q4_1/float32"))
    assert h.layout.basis == presets.get("balanced").layout.basis and h.layout.sparse_tokens > 0  # the shipped model's chunks keep it


def test_warm_up_restores_every_object_in_every_worker(workers):
    objects = [warmup_object(p) for p in ("exact", "q8", "lean", "balanced")]
    before = dict(workers.stats)
    w = workers.warm("cpu", objects)
    assert w.restored == [4, 4] and w.errors == [], w
    assert len(w.seconds) == 2 and all(s > 0 for s in w.seconds)
    assert workers.stats == before  # a warm-up is not a fetch: the statistics stay those of fetches


async def test_a_bad_warm_up_object_is_reported_and_the_workers_still_serve(tmp_path, workers, shared):
    good = warmup_object("q8")
    w = workers.warm("cpu", [undecodable(good), b"not a chunk" * 8, good])
    assert w.restored == [1, 1], w
    assert len(w.errors) == 3 and sum("Corrupt" in e for e in w.errors) == 2 and "Foreign" in w.errors[0], w.errors
    kv = synthetic_kv(layers=2, heads=2, tokens=64, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset="q8")
    buf = shared(kv)
    before = workers.stats["chunks"]
    out = await fetch(store, refs, Destination(buf.tensor, tokens=64, handle=buf.handle), workers=workers)
    assert out.error is None and workers.stats["chunks"] - before == 2
    assert torch.equal(buf.tensor, decoded(store, refs))


def test_a_worker_that_dies_before_its_warm_up_is_replaced():
    w = DecodeWorkers(1)
    try:
        w.start()
        dead = w._workers[0].proc
        os.kill(dead.pid, signal.SIGKILL)
        dead.join(5)
        r = w.warm("cpu", [warmup_object("q8"), warmup_object("q8")])
        assert r.restored == [1] and len(r.errors) == 1 and "died" in r.errors[0], r
        assert w._workers[0].proc is not dead and w._workers[0].proc.is_alive()
    finally:
        w.close()


async def test_an_opened_buffer_is_held_by_the_workers(tmp_path, workers, shared):
    """Opened when the model registers it: the workers restore into it even after its file is gone."""
    kv = synthetic_kv(layers=2, heads=2, tokens=64, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset="q8")
    buf = shared(kv)
    workers.open(buf.handle)
    round_trip(workers)
    buf.close()  # unlinked: a worker that had not mapped it could not any more
    try:
        before = workers.stats["chunks"]
        out = await fetch(store, refs, Destination(buf.tensor, tokens=64, handle=buf.handle), workers=workers)
        assert out.error is None and workers.stats["chunks"] - before == 2, out
        assert torch.equal(buf.tensor, decoded(store, refs))
    finally:
        workers.forget(buf.handle)


async def test_a_buffer_that_failed_to_open_is_remembered_until_forgotten(tmp_path, workers, shared):
    """An eager open that fails is remembered as a fetch's would be: chunks for that buffer are
    restored in the calling process, even once it could be opened, until it is forgotten."""
    kv = synthetic_kv(layers=2, heads=2, tokens=64, head_dim=32)
    store = LocalStore(tmp_path)
    refs = put_chunks(store, kv, 32, preset="q8")
    buf = shared(kv)
    later = 1000  # an fd number not open yet
    handle = dict(buf.handle, fd=later)
    workers.open(handle)
    round_trip(workers)
    os.dup2(buf.handle["fd"], later)  # now it could be opened
    try:
        dest = Destination(buf.tensor, tokens=64, handle=handle)
        before = workers.stats["chunks"]
        out = await fetch(store, refs, dest, workers=workers)
        assert out.error is None and workers.stats["chunks"] == before, out  # restored here, not retried
        assert torch.equal(buf.tensor, decoded(store, refs))
        workers.forget(handle)
        buf.tensor.fill_(SENTINEL)
        out = await fetch(store, refs, dest, workers=workers)
        assert out.error is None and workers.stats["chunks"] - before == 2, out
        assert torch.equal(buf.tensor, decoded(store, refs))
    finally:
        workers.forget(handle)
        os.close(later)


async def test_a_fetch_beside_a_warm_up_does_not_teach_the_estimator(tmp_path, shared):
    kv = synthetic_kv(layers=2, heads=2, tokens=64, head_dim=32)
    async with running(LocalStore(tmp_path), chunk_tokens=32, presets=("exact",), decode_procs=1, device="cpu", warm_up=False) as sc:
        buf = shared(kv)
        buf.tensor.copy_(kv)
        bid = sc.register(buf.handle, "m")
        await sc.store(bid, list(range(64)))
        await sc.flush()
        learned = lambda: "exact" in sc.estimator.rates(sc.objects.endpoint).decode_Bps  # noqa: E731
        warming = asyncio.get_running_loop().create_future()
        sc._warming = warming  # a registration's warm-up still under way
        try:
            for _ in range(2):  # the second would teach (the first of a format never does), but shares the workers
                r = await sc.fetch(bid, list(range(64)), options=FetchOptions(presets=["exact"], recompute_tokens_per_s=1e-9))
                assert r.loaded_tokens == 64 and not learned(), r
        finally:
            warming.set_result(None)  # (close awaits it)
        r = await sc.fetch(bid, list(range(64)), options=FetchOptions(presets=["exact"], recompute_tokens_per_s=1e-9))
        assert r.loaded_tokens == 64 and learned(), r
        buf.close()


async def test_a_sidecar_warms_its_workers_and_maps_a_buffer_when_it_is_registered(tmp_path, shared):
    kv = synthetic_kv(layers=2, heads=2, tokens=64, head_dim=32)
    async with running(LocalStore(tmp_path), chunk_tokens=32, presets=("exact",), decode_procs=1, device="cpu") as sc:
        assert sc.metrics.registry.get_sample_value("kvfetcher_decode_warm_up_seconds") > 0
        assert sc.metrics.registry.get_sample_value("kvfetcher_errors_total", {"reason": "warm_up"}) is None
        buf = shared(kv)
        buf.tensor.copy_(kv)
        bid = sc.register(buf.handle, "m")
        await sc._warming  # this model's chunk geometry, in the background
        assert sc.metrics.registry.get_sample_value("kvfetcher_errors_total", {"reason": "warm_up"}) is None
        await sc.store(bid, list(range(64)))
        await sc.flush()
        round_trip(sc.workers)
        buf.close()  # only a worker that mapped it at registration can still write it
        buf.tensor.fill_(SENTINEL)
        r = await sc.fetch(bid, list(range(64)), options=FetchOptions(presets=["exact"], recompute_tokens_per_s=1e-9))
        assert (r.error, r.loaded_tokens, sc.workers.stats["chunks"]) == (None, 64, 2), r
        assert torch.equal(buf.tensor, kv)
        assert "exact" not in sc.estimator.rates(sc.objects.endpoint).decode_Bps  # a first fetch pays set-up: not learned
        r = await sc.fetch(bid, list(range(64)), options=FetchOptions(presets=["exact"], recompute_tokens_per_s=1e-9))
        assert r.loaded_tokens == 64 and "exact" in sc.estimator.rates(sc.objects.endpoint).decode_Bps


@pytest.mark.parametrize("allowed, expected", [(None, {"exact", "q8", "lean", "q8-zstd"}), (("raw", "q8"), {"q8"})])
async def test_a_registration_warms_every_preset_a_fetch_may_choose_not_only_those_written(tmp_path, shared, monkeypatch, allowed, expected):
    """A sidecar that writes raw still fetches what other writers stored (any preset a lookup allows):
    its workers meet those at registration, not on a first fetch. Here on a CPU: the coded presets
    model "m" may use without a calibration."""
    kv = synthetic_kv(layers=2, heads=2, tokens=64, head_dim=32)
    async with running(LocalStore(tmp_path), chunk_tokens=32, presets=("raw",), allowed_presets=allowed, decode_procs=1,
                       device="cpu") as sc:
        warmed = []
        real = sc.workers.warm
        monkeypatch.setattr(sc.workers, "warm", lambda device, objects: (warmed.extend(objects), real(device, objects))[1])
        buf = shared(kv)
        sc.register(buf.handle, "m")
        await sc.warmed()
        got = [container.parse_header(o) for o in warmed]
        assert {h.preset for h in got} == expected
        assert all(h.shape == (2, 2, 2, 32, 32) for h in got)  # the model's geometry, a chunk's tokens
        assert sc.metrics.registry.get_sample_value("kvfetcher_errors_total", {"reason": "warm_up"}) is None
        buf.close()


async def test_presets_with_no_encoder_here_are_named_once_and_the_others_warmed(tmp_path, shared, monkeypatch, caplog):
    """A GPU without NVENC and an image without PyAV can decode HEVC but not make a warm-up chunk of
    it: those presets are named in one warning (no traceback, no error counted), the rest warmed."""
    monkeypatch.setitem(sys.modules, "kvfetcher.codec.pyav", None)  # PyAV's libx265 not installed
    warmup_object.cache_clear()  # (chunks made by earlier tests)
    kv = synthetic_kv(layers=2, heads=2, tokens=64, head_dim=32)
    async with running(LocalStore(tmp_path), chunk_tokens=32, presets=("raw",), allowed_presets=("raw", "q8", "lean", "q8-zstd"),
                       decode_procs=1, device="cpu") as sc:
        warmed = []
        real = sc.workers.warm
        monkeypatch.setattr(sc.workers, "warm", lambda device, objects: (warmed.extend(objects), real(device, objects))[1])
        buf = shared(kv)
        await sc.warmed()  # the start's warm-up (what this sidecar serves) has said the same once
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvfetcher.service"):
            sc.register(buf.handle, "m")
            await sc.warmed()
        assert {container.parse_header(o).preset for o in warmed} == {"q8-zstd"}
        named = [r for r in caplog.records if "not warmed with" in r.getMessage()]
        assert len(named) == 1 and "q8,lean" in named[0].getMessage() and "PyAV" in named[0].getMessage()
        assert named[0].exc_info is None
        assert sc.metrics.registry.get_sample_value("kvfetcher_errors_total", {"reason": "warm_up"}) is None
        buf.close()


def test_a_registration_warms_no_preset_whose_basis_is_not_of_the_buffer_s_shape(tmp_path):
    """A tensor-parallel rank's buffer holds some of the model's KV heads: the model's basis (of
    all its heads) cannot code them, so no fetch into it chooses those presets and none is warmed."""
    from kvfetcher import keys
    from kvfetcher.config import Config
    from kvfetcher.format import presets
    from kvfetcher.service import Sidecar

    model = "smollm2-135m-instruct-q4_1/float32"  # the shipped calibration's model
    L, H, D = basis.load(presets.get("balanced").layout.basis).shape
    sc = Sidecar(LocalStore(tmp_path), Config(chunk_tokens=32, presets=("raw",), decode_procs=0, read_procs=0))
    whole = sc._coded_presets(keys.Namespace(model, "float16", shape=(L, H, D)))
    rank = sc._coded_presets(keys.Namespace(model, "float16", shape=(L, 1, D)))
    with_basis = {p for p in whole if presets.get(p, model).layout.basis is not None}
    assert "balanced" in with_basis and "q8" in whole
    assert set(rank) == set(whole) - with_basis


async def test_a_gpu_sidecar_touches_no_gpu_before_a_model_registers_one(tmp_path):
    async with running(LocalStore(tmp_path), chunk_tokens=32, presets=("exact",), decode_procs=1, device="cuda") as sc:
        # a warm-up at start would have opened a GPU of the sidecar's choosing (and failed here on a CPU)
        assert sc.metrics.registry.get_sample_value("kvfetcher_errors_total", {"reason": "warm_up"}) is None
        assert sc.metrics.registry.get_sample_value("kvfetcher_decode_warm_up_seconds") == 0


def test_restore_here_restores_a_whole_object_into_scratch_as_decode_chunk_does():
    from kvfetcher.chunk import decode_chunk
    from kvfetcher.errors import ContainerError
    from kvfetcher.fetch.workers import restore_here

    obj = warmup_object("q8", (2, 2, 32, 64), torch.float16, "m")
    assert restore_here(obj, "cpu") == decode_chunk(obj, "m").numel() * 2
    with pytest.raises(ContainerError):
        restore_here(obj[:-1], "cpu")  # a short object is refused, as a fetch refuses it


async def test_a_sidecar_decoding_in_its_threads_warms_a_gpu_buffer_only(tmp_path, shm, monkeypatch):
    """Without decode workers the sidecar's threads decode: a GPU buffer's registration restores one
    chunk of each coded preset in this process (the fused unpack compiles per geometry); a CPU
    buffer has nothing to compile and costs nothing."""
    from kvfetcher.config import Config
    from kvfetcher.service import Sidecar
    from kvfetcher.store.local import LocalStore

    sc = Sidecar(LocalStore(tmp_path), Config(chunk_tokens=32, presets=("raw", "q8"), decode_procs=0, read_procs=0, warm_up=True))
    await sc.start()
    warmed = []
    monkeypatch.setattr(sc, "warm_here", warmed.append)
    try:
        sc.register(shm((2, 2, 2, 64, 16)).handle, "m")
        await sc.warmed()
        assert warmed == []  # a CPU buffer
        sc.warm_here = Sidecar.warm_here.__get__(sc)
        sc.warm_here(next(iter(sc.buffers.values())))  # (what a GPU buffer's registration runs) restores q8 here, not raw
        assert sc.metrics.warm_up_seconds._value.get() > 0
        assert 'kvfetcher_errors_total{reason="warm_up"}' not in sc.metrics.exposition().decode()
    finally:
        await sc.close()
