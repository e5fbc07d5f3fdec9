"""Paged buffers (a serving engine's KV blocks) through the sidecar: a restore into blocks is the flat
restore's bytes in every axis order, stores read blocks, and addressing or tensors that do not fit
are refused before anything is written. In process with CPU tensors (memfds of this process), over
HTTP with the client, and on a GPU through CUDA IPC and a sidecar process."""

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from kvfetcher import ipc
from kvfetcher.api.client import KVClient, SidecarError
from kvfetcher.errors import RequestError
from kvfetcher.kvbuffer import PagedLayout, read_blocks, write_blocks
from kvfetcher.store.local import LocalStore
from kvfetcher.fetch.plan import FetchOptions

from kvtest import SENTINEL, TOKEN, free_port, raw_request, running, sidecar, synthetic_kv

FP = "paged-model"
N = 64  # chunk tokens
LAYERS, HEADS, HEAD_DIM, BS, BLOCKS = 2, 2, 16, 16, 24
TOKENS = list(range(500, 756))  # 256 tokens: 4 chunks, 16 blocks
SCATTERED = [int(b) for b in torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(1))[:16]]
REVERSED = list(range(BLOCKS - 1, BLOCKS - 17, -1))


def paged(shm, dims: str, block_size: int = BS, blocks: int = BLOCKS, device: str = "cpu", **size):
    """Shared paged tensors of ``dims`` filled with SENTINEL, and their registration handle."""
    sizes = dict(L=LAYERS, K=2, B=blocks, T=block_size, H=HEADS, D=HEAD_DIM, **size)
    shape = [math.prod(sizes[c] for c in axis) for axis in PagedLayout(dims, block_size).axes]
    bufs = [shm(shape, fill=SENTINEL, device=device) for _ in range(1 if "L" in dims else sizes["L"])]
    return [b.tensor for b in bufs], ipc.paged_handle([b.handle for b in bufs], PagedLayout(dims, block_size))


def untouched(tensors, dims: str, block_ids) -> bool:
    """Whether every block outside ``block_ids`` still holds SENTINEL."""
    rest = [b for b in range(BLOCKS) if b not in block_ids]
    return bool((read_blocks(tensors, PagedLayout(dims, BS), rest, 0, len(rest) * BS) == SENTINEL).all())


async def stored_and_restored_flat(sc, shm, kv):
    """Store ``kv`` from a flat buffer, then restore it into that buffer: the flat path's bytes."""
    flat = shm((LAYERS, 2, HEADS, len(TOKENS), HEAD_DIM))
    flat.tensor.copy_(kv)
    bid = sc.register(flat.handle, FP)
    assert (await sc.store(bid, TOKENS))["queued_chunks"] == 4
    await sc.flush()
    flat.tensor.fill_(SENTINEL)
    await sc.warmed()  # until then auto leaves the decode workers' presets alone
    r = await sc.fetch(bid, TOKENS, options=FetchOptions(recompute_tokens_per_s=1.0))  # a slow model: fetching is the cost model's choice
    assert (r.error, r.loaded_tokens) == (None, 256), r
    return flat.tensor.clone()


@pytest.mark.parametrize(
    "dims, preset, block_ids, procs",
    [
        ("KBTHD", "raw", SCATTERED, 0),
        ("KBHTD", "raw", REVERSED, 0),
        ("BHT(KD)", "raw", SCATTERED, 0),
        ("BHKTD", "raw", SCATTERED, 0),
        ("LKBTHD", "raw", REVERSED, 0),
        ("BLTH(KD)", "raw", SCATTERED, 0),
        ("BHLT(KD)", "raw", SCATTERED, 0),
        ("BHT(KD)", "q8", SCATTERED, 0),
        ("BLTH(KD)", "q8", REVERSED, 0),
        pytest.param("BHT(KD)", "q8", REVERSED, 1, marks=pytest.mark.slow),  # a decode worker process opens the paged handle
    ],
)
def test_a_restore_into_blocks_is_the_flat_restore(tmp_path, shm, dims, preset, block_ids, procs):
    kv = synthetic_kv(layers=LAYERS, heads=HEADS, tokens=len(TOKENS), head_dim=HEAD_DIM)

    async def main():
        async with running(LocalStore(tmp_path), chunk_tokens=N, presets=(preset,), decode_procs=procs, warm_up=procs > 0) as sc:
            want = await stored_and_restored_flat(sc, shm, kv)
            tensors, handle = paged(shm, dims)
            bid = sc.register(handle, FP)
            await sc.warmed()
            spare = next(b for b in range(BLOCKS) if b not in block_ids)  # a block of the prompt's partial tail
            r = await sc.fetch(bid, TOKENS + [7, 8], block_ids=block_ids + [spare], options=FetchOptions(recompute_tokens_per_s=1.0))
            assert (r.error, r.loaded_tokens, r.decision.preset) == (None, 256, preset), r
            got = read_blocks(tensors, PagedLayout(dims, BS), block_ids, 0, 256)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # byte-identical
            assert untouched(tensors, dims, block_ids)
            if preset == "raw":
                assert torch.equal(got, kv)

    asyncio.run(main())


def test_a_store_reads_blocks_and_a_flat_buffer_loads_it_and_back(tmp_path, shm):
    kv = synthetic_kv(layers=LAYERS, heads=HEADS, tokens=len(TOKENS), head_dim=HEAD_DIM)
    other = list(range(2000, 2256))

    async def main():
        async with running(LocalStore(tmp_path), chunk_tokens=N, presets=("raw",), decode_procs=0, warm_up=False) as sc:
            tensors, handle = paged(shm, "BHT(KD)")
            layout = PagedLayout("BHT(KD)", BS)
            write_blocks(tensors, layout, SCATTERED, kv)
            pid = sc.register(handle, FP)
            assert (await sc.store(pid, TOKENS, block_ids=SCATTERED))["queued_chunks"] == 4
            for t in tensors:
                t.fill_(SENTINEL)  # the KV was copied when the store was queued
            await sc.flush()
            flat = shm((LAYERS, 2, HEADS, 300, HEAD_DIM), fill=SENTINEL)
            fid = sc.register(flat.handle, FP)
            r = await sc.fetch(fid, TOKENS, offset=20, options=FetchOptions(recompute_tokens_per_s=1.0))
            assert (r.error, r.loaded_tokens) == (None, 256) and torch.equal(flat.tensor[:, :, :, 20:276], kv)
            flat.tensor[:, :, :, 20:276] = kv.flip(3)  # other tokens' KV, stored from the flat buffer
            assert (await sc.store(fid, other, offset=20))["queued_chunks"] == 4
            await sc.flush()
            r = await sc.fetch(pid, other, block_ids=REVERSED, options=FetchOptions(recompute_tokens_per_s=1.0))
            assert (r.error, r.loaded_tokens) == (None, 256) and torch.equal(read_blocks(tensors, layout, REVERSED, 0, 256), kv.flip(3))

    asyncio.run(main())


@pytest.mark.parametrize(
    "dims, preset, procs",
    [
        ("BHT(KD)", "raw", 0),
        ("BLTH(KD)", "q8", 0),
        (None, "raw", 0),  # a flat buffer (the CPU connector's staging buffer)
        pytest.param("BHT(KD)", "q8", 1, marks=pytest.mark.slow),  # the straddling chunk is not a decode worker's
    ],
)
def test_a_load_from_first_token_leaves_the_blocks_before_it_alone(tmp_path, shm, dims, preset, procs):
    """vLLM's own prefix-cache hit (tokens 0..96, blocks that other requests may share) stays
    byte-identical: chunk 0 is not fetched, chunk 1 (64..128) writes only 96..128."""
    kv = synthetic_kv(layers=LAYERS, heads=HEADS, tokens=len(TOKENS), head_dim=HEAD_DIM)
    theirs = synthetic_kv(layers=LAYERS, heads=HEADS, tokens=len(TOKENS), head_dim=HEAD_DIM, seed=7)  # what the engine holds
    first = 96

    async def main():
        async with running(LocalStore(tmp_path), chunk_tokens=N, presets=(preset,), decode_procs=procs, warm_up=procs > 0) as sc:
            want = await stored_and_restored_flat(sc, shm, kv)
            fid = sc.register(shm((LAYERS, 2, HEADS, 256, HEAD_DIM)).handle, FP)
            await sc.warmed()
            full = (await sc.fetch(fid, TOKENS, options=FetchOptions(recompute_tokens_per_s=1.0))).kv_bytes
            if dims is None:
                flat = shm((LAYERS, 2, HEADS, 256, HEAD_DIM))
                flat.tensor.copy_(theirs)
                bid, got = sc.register(flat.handle, FP), lambda: flat.tensor
            else:
                tensors, handle = paged(shm, dims)
                write_blocks(tensors, PagedLayout(dims, BS), SCATTERED, theirs)
                bid, got = sc.register(handle, FP), lambda: read_blocks(tensors, PagedLayout(dims, BS), SCATTERED, 0, 256)
            where = {} if dims is None else dict(block_ids=SCATTERED)
            await sc.warmed()
            r = await sc.fetch(bid, TOKENS, first_token=first, **where, options=FetchOptions(recompute_tokens_per_s=1.0))
            assert (r.error, r.loaded_tokens, r.not_loaded) == (None, 256, (256, 256)), r
            assert r.kv_bytes == full * 3 // 4  # chunks 1..3 restored: chunk 0 was not fetched
            assert torch.equal(got()[:, :, :, :first].view(torch.int16), theirs[:, :, :, :first].view(torch.int16))
            assert torch.equal(got()[:, :, :, first:].view(torch.int16), want[:, :, :, first:].view(torch.int16))
            if dims is not None:
                assert untouched(tensors, dims, SCATTERED)
                r = await sc.fetch(bid, TOKENS, first_token=256, **where, options=FetchOptions(recompute_tokens_per_s=1.0))  # all of it is the engine's
                assert (r.error, r.loaded_tokens, r.bytes_read) == (None, 256, 0)
                with pytest.raises(RequestError, match="whole blocks"):
                    await sc.fetch(bid, TOKENS, first_token=first + 1, **where, options=FetchOptions(recompute_tokens_per_s=1.0))

    asyncio.run(main())


def _open_fds() -> int:
    import gc

    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def test_a_registration_that_does_not_fit_is_refused_and_holds_nothing(tmp_path, shm):
    async def main():
        async with running(LocalStore(tmp_path), chunk_tokens=N, presets=("raw",), decode_procs=0, warm_up=False) as sc:
            bad = [
                (paged(shm, "KBTHD", block_size=48)[1], "does not divide"),  # 48 does not divide chunks of 64 tokens
                (dict(paged(shm, "KBTHD")[1], dims="KBHTD"), "does not fit"),  # the tensors are not laid out as the dims say
                (dict(paged(shm, "KBTHD")[1], dims="LKBTHD"), "one tensor"),
                (ipc.paged_handle([paged(shm, "KBTHD")[1]["handles"][0], paged(shm, "KBTHD", blocks=9)[1]["handles"][0]],
                                  PagedLayout("KBTHD", BS)), "differ"),
                (dict(paged(shm, "KBTHD")[1], dims="KBTH"), "paged dims"),
            ]
            before = _open_fds()
            for handle, detail in bad:
                with pytest.raises(RequestError, match=detail):
                    sc.register(handle, FP)
            assert not sc.buffers and _open_fds() == before

    asyncio.run(main())


@pytest.mark.parametrize(
    "where, detail",
    [
        (dict(block_ids=[0, 1, 2, BLOCKS] + list(range(3, 15))), "out of range"),
        (dict(block_ids=[0, 1, 2, 1] + list(range(3, 15))), "distinct"),
        (dict(block_ids=list(range(16)), slots=list(range(256))), "not slots"),
        (dict(offset=4), "not slots or offset"),
        ({}, "needs the request's block_ids"),
    ],
)
def test_addressing_that_does_not_fit_writes_nothing(tmp_path, shm, where, detail):
    async def main():
        async with running(LocalStore(tmp_path), chunk_tokens=N, presets=("raw",), decode_procs=0, warm_up=False) as sc:
            await stored_and_restored_flat(sc, shm, synthetic_kv(layers=LAYERS, heads=HEADS, tokens=256, head_dim=HEAD_DIM))
            tensors, handle = paged(shm, "BHT(KD)")
            bid = sc.register(handle, FP)
            with pytest.raises(RequestError, match=detail):
                await sc.fetch(bid, TOKENS, **where, options=FetchOptions(recompute_tokens_per_s=1.0))
            with pytest.raises(RequestError, match=detail):
                await sc.store(bid, TOKENS, **where)
            assert all(bool((t == SENTINEL).all()) for t in tensors)
            flat = shm((LAYERS, 2, HEADS, 256, HEAD_DIM))
            with pytest.raises(RequestError, match="this one is flat"):
                await sc.fetch(sc.register(flat.handle, FP), TOKENS, block_ids=list(range(16)))

    asyncio.run(main())


def test_a_load_fills_the_blocks_it_is_given_and_a_store_wants_them_all(tmp_path, shm):
    """vLLM gives a load the blocks of the tokens it asked for, not of the prompt's later chunks:
    the fetch loads the whole chunks those blocks hold (3 of 4 in 15 blocks) and writes no other;
    a store of the 4 chunks needs all 16 blocks."""
    kv = synthetic_kv(layers=LAYERS, heads=HEADS, tokens=len(TOKENS), head_dim=HEAD_DIM)

    async def main():
        async with running(LocalStore(tmp_path), chunk_tokens=N, presets=("raw",), decode_procs=0, warm_up=False) as sc:
            want = await stored_and_restored_flat(sc, shm, kv)
            tensors, handle = paged(shm, "BHT(KD)")
            bid = sc.register(handle, FP)
            given = SCATTERED[:15]
            r = await sc.fetch(bid, TOKENS, block_ids=given, options=FetchOptions(recompute_tokens_per_s=1.0))
            assert (r.error, r.loaded_tokens, r.not_loaded) == (None, 3 * N, (3 * N, 4 * N)), r
            got = read_blocks(tensors, PagedLayout("BHT(KD)", BS), given[:12], 0, 3 * N)
            assert torch.equal(got.view(torch.int16), want[:, :, :, : 3 * N].view(torch.int16))
            assert untouched(tensors, "BHT(KD)", given[:12])  # the 15th block, short of a chunk, too
            with pytest.raises(RequestError, match="15 block ids"):
                await sc.store(bid, TOKENS, block_ids=given)

    asyncio.run(main())


def test_blocks_over_http_with_the_client(s3, shm):
    kv = synthetic_kv(layers=LAYERS, heads=HEADS, tokens=len(TOKENS), head_dim=HEAD_DIM)
    with sidecar(s3, chunk_tokens=N, warm_up=False) as sc:
        tensors, handle = paged(shm, "BLTH(KD)")
        layout = PagedLayout("BLTH(KD)", BS)
        write_blocks(tensors, layout, SCATTERED, kv)
        bid = sc.sidecar.register(handle, FP)  # host tensors: only in the sidecar's own process (no memfd list crosses a socket)
        c = KVClient(socket_path=sc.socket)
        assert c.store(bid, TOKENS, block_ids=SCATTERED).queued_chunks == 4
        c.flush()
        tensors[0].fill_(SENTINEL)
        r = c.fetch(bid, TOKENS, block_ids=REVERSED, options=FetchOptions(recompute_tokens_per_s=1.0))
        assert (r.error, r.loaded_tokens) == (None, 256) and torch.equal(read_blocks(tensors, layout, REVERSED, 0, 256), kv)
        assert untouched(tensors, "BLTH(KD)", REVERSED)
        with pytest.raises(SidecarError) as e:
            c.fetch(bid, TOKENS, block_ids=REVERSED[:-1] + [REVERSED[0]])
        assert e.value.status == 400 and "distinct" in e.value.detail


@pytest.mark.parametrize(
    "body, detail",
    [
        ({"paged": {"dims": "BHT(KQ)", "block_size": 16}, "handles": [{"kind": "cuda"}]}, "paged dims"),
        ({"paged": {"dims": "BHT(KD)", "block_size": 0}, "handles": [{"kind": "cuda"}]}, "block_size"),
        ({"paged": {"dims": "BHT(KD)", "block_size": 16}}, "give 'handle'"),
        ({"paged": {"dims": "BHT(KD)", "block_size": 16}, "handle": {"kind": "cuda"}, "handles": [{"kind": "cuda"}]}, "give 'handle'"),
        ({"handles": [{"kind": "cuda"}]}, "give 'paged'"),
        ({"paged": {"dims": "BHT(KD)", "block_size": 16}, "handles": [{"kind": "memfd", "pid": 1, "fd": 3}]}, "only a CUDA handle"),
        ({"paged": {"dims": "BHT(KD)", "block_size": 16, "layers": 2}, "handles": [{"kind": "cuda"}]}, "unknown field(s) ['layers']"),
    ],
)
def test_bad_paged_registrations_get_clear_400s(s3, body, detail):
    with sidecar(s3, warm_up=False) as sc:
        status, reply = raw_request(sc.where["port"], "POST", "/v1/buffers", json.dumps({"model": FP, **body}).encode(),
                                    {"Authorization": f"Bearer {TOKEN}"})
    assert status == 400 and detail in json.loads(reply)["detail"], reply


# --- GPU: CUDA IPC into a sidecar process ----------------------------------------------------


def _serve(tmp_path, port):
    env = dict(os.environ, KVFETCHER_STORE_DIR=str(tmp_path / "store"), KVFETCHER_AUTH_TOKEN="t", KVFETCHER_PRESET="raw,lean",
               KVFETCHER_CHUNK_TOKENS=str(N), KVFETCHER_ROPE_THETA="10000")
    env.pop("KVFETCHER_S3_ENDPOINT", None)
    proc = subprocess.Popen([sys.executable, "-m", "kvfetcher.cli", "serve", "--host", "127.0.0.1", "--port", str(port)], env=env)
    for _ in range(600):
        try:
            if raw_request(port, "GET", "/readyz")[0] == 200:
                return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the sidecar did not start")


def _warmed(port) -> None:
    """Wait until the served sidecar's registration warm-up is over (its ``kvfetcher_decode_warming`` gauge
    is 0): a cold decoder's first restore would teach the rates a start-up, and auto would recompute."""
    for _ in range(600):
        if b"kvfetcher_decode_warming 0.0" in raw_request(port, "GET", "/metrics")[1]:
            return
        time.sleep(0.1)
    raise RuntimeError("the sidecar's decode workers did not warm up")


@pytest.mark.gpu
def test_cuda_paged_tensors_restore_as_the_flat_buffer_does(tmp_path):
    """vLLM's tensors as a sidecar process opens them by CUDA IPC: FlashAttention's per-layer NHD views
    and its cross-layer tensor; raw (host to device, then a scatter) and lean (HEVC, needing no calibration:
    decoded and unpacked on the GPU by decode workers, then a scatter) give the flat restore's bytes."""
    kv = synthetic_kv(layers=LAYERS, heads=HEADS, tokens=len(TOKENS), head_dim=HEAD_DIM).cuda()
    port = free_port()
    proc = _serve(tmp_path, port)
    try:
        c = KVClient(f"http://127.0.0.1:{port}", token="t")
        flat = ipc.allocate((LAYERS, 2, HEADS, len(TOKENS), HEAD_DIM), torch.float16, "cuda")
        flat.tensor.copy_(kv)
        torch.cuda.synchronize()
        fid = c.register(flat.handle, FP)
        assert c.store(fid, TOKENS).queued_chunks == 4
        c.flush()
        _warmed(port)
        per_layer = [torch.zeros(BLOCKS, BS, HEADS, 2 * HEAD_DIM, dtype=torch.float16, device="cuda").permute(0, 2, 1, 3)
                     for _ in range(LAYERS)]  # logical (blocks, heads, block_size, 2 * head_dim) of NHD memory
        cross = torch.zeros(BLOCKS, LAYERS, BS, HEADS, 2 * HEAD_DIM, dtype=torch.float16, device="cuda")
        for tensors, dims in ((per_layer, "BHT(KD)"), (cross, "BLTH(KD)")):
            layout = PagedLayout(dims, BS)
            pid = c.register_paged(tensors, layout, FP)
            _warmed(port)
            for preset in ("raw", "lean"):
                flat.tensor.fill_(SENTINEL)
                for t in tensors if isinstance(tensors, list) else [tensors]:
                    t.fill_(SENTINEL)
                torch.cuda.synchronize()
                want = c.fetch(fid, TOKENS, options=FetchOptions(presets=[preset], recompute_tokens_per_s=1.0))
                r = c.fetch(pid, TOKENS, block_ids=SCATTERED, options=FetchOptions(presets=[preset], recompute_tokens_per_s=1.0))
                assert (r.error, r.loaded_tokens, r.decision.preset) == (None, 256, preset) and want.loaded_tokens == 256, r
                got = read_blocks(tensors, layout, SCATTERED, 0, 256)
                assert torch.equal(got.view(torch.int16), flat.tensor.view(torch.int16)), (dims, preset)
                assert untouched(tensors, dims, SCATTERED)
                if preset == "raw":
                    assert torch.equal(got, kv)
            c.unregister(pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
