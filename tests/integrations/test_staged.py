"""Host staging (kvfetcher.integrations.staged), without vLLM: paged 'blocks' the sidecar cannot map
(CPU tensors here; GPU tensors with a CUDA-less sidecar process in the gpu test) are stored and
loaded through a flat host buffer smaller than the prompt, in windows of whole chunks. A load writes
only tokens first..end, whole blocks; a save copies every block out; a sidecar that cannot open a
CUDA handle says `no_device`, which selects staging."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvfetcher import ipc
from kvfetcher.api.client import KVClient, SidecarError
from kvfetcher.fetch.plan import FetchOptions
from kvfetcher.integrations import staged
from kvfetcher.kvbuffer import PagedLayout, read_blocks, write_blocks
from kvfetcher.store.local import LocalStore

from kvtest import SENTINEL, TOKEN, raw_request, served, sidecar, synthetic_kv

FP = "staged-model"
N = 64  # chunk tokens
LAYERS, HEADS, HEAD_DIM, BS, BLOCKS = 2, 2, 16, 16, 48
TOKENS = list(range(900, 1540))  # 640 tokens: 10 chunks, 40 blocks
BLOCK_IDS = [int(b) for b in torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(3))[:40]]
DIMS = "BHT(KD)"  # vLLM FlashAttention's per-layer cache
SLOW_MODEL = FetchOptions(recompute_tokens_per_s=1.0)  # fetching is the cost model's choice


class Recording(KVClient):
    """A client that records the window of every load and save: (tokens sent, first_token, offset, plan given)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[tuple[str, int, int, int, bool]] = []

    def fetch(self, buffer, tokens, plan=None, **kw):
        self.calls.append(("load", len(tokens), kw.get("first_token", 0), kw.get("offset", 0), plan is not None))
        return super().fetch(buffer, tokens, plan, **kw)

    def store(self, buffer, tokens, **kw):
        self.calls.append(("save", len(tokens), kw.get("first_token", 0), kw.get("offset", 0), False))
        return super().store(buffer, tokens, **kw)


def blocks(fill=SENTINEL, device="cpu"):
    """Per-layer paged tensors as vLLM allocates them, filled with ``fill``."""
    return [torch.full((BLOCKS, HEADS, BS, 2 * HEAD_DIM), fill, dtype=torch.float16, device=device) for _ in range(LAYERS)]


def untouched(tensors, used) -> bool:
    rest = [b for b in range(BLOCKS) if b not in used]
    return bool((read_blocks(tensors, PagedLayout(DIMS, BS), rest, 0, len(rest) * BS) == SENTINEL).all())


@pytest.fixture
def served_sidecar(tmp_path):
    with sidecar(LocalStore(tmp_path / "store"), chunk_tokens=N, presets=("raw",), warm_up=False) as sc:
        yield sc


def stored(sc, kv, tokens=TOKENS, staging_tokens=192) -> list[tuple]:
    """Store ``kv`` of ``tokens`` from CPU blocks through a staging of ``staging_tokens``; the client's calls."""
    src = blocks()
    write_blocks(src, PagedLayout(DIMS, BS), BLOCK_IDS[: len(tokens) // BS], kv)
    c = Recording(socket_path=sc.socket)
    buf, st, _ = staged.register(c, src, PagedLayout(DIMS, BS), FP, 0, staging_tokens)
    assert st.store(c, buf, tokens, BLOCK_IDS, N) == len(tokens) // N
    c.flush()
    st.close()
    return c.calls


def test_a_prompt_longer_than_the_staging_is_stored_and_loaded_in_windows_from_a_first_token(served_sidecar):
    """10 chunks through 3 chunks of staging: saves of windows 0, 192, 384, 576; a load from token
    160 (vLLM's own prefix-cache hit, mid-chunk) writes 160..640 only, in windows starting there."""
    kv = synthetic_kv(layers=LAYERS, heads=HEADS, tokens=len(TOKENS), head_dim=HEAD_DIM)
    assert stored(served_sidecar, kv) == [("save", 192, 0, 0, False), ("save", 384, 192, -192, False), ("save", 576, 384, -384, False),
                                          ("save", 640, 576, -576, False)]
    theirs = synthetic_kv(layers=LAYERS, heads=HEADS, tokens=len(TOKENS), head_dim=HEAD_DIM, seed=9)  # the engine's own KV
    dst = blocks()
    layout = PagedLayout(DIMS, BS)
    write_blocks(dst, layout, BLOCK_IDS[:10], theirs[:, :, :, :160])
    c = Recording(socket_path=served_sidecar.socket)
    buf, st, why = staged.register(c, dst, layout, FP, 0, 192)
    assert "host memory" in why
    assert st.fetch(c, buf, TOKENS, BLOCK_IDS, 160, 640, options=SLOW_MODEL) == 640
    assert [call[1:4] for call in c.calls] == [(352, 160, -160), (512, 320, -320), (640, 512, -512)]  # whole chunks in 192 slots
    got = read_blocks(dst, layout, BLOCK_IDS, 0, 640)
    assert torch.equal(got[:, :, :, :160].view(torch.int16), theirs[:, :, :, :160].view(torch.int16))  # never written
    assert torch.equal(got[:, :, :, 160:].view(torch.int16), kv[:, :, :, 160:].view(torch.int16))  # byte-identical
    assert untouched(dst, BLOCK_IDS)


def test_a_store_from_a_first_token_copies_out_only_the_chunks_after_it(served_sidecar, monkeypatch, tmp_path):
    """The scheduler's lookup found the first 4 chunks stored: the store's windows start at token
    256 and no block before it is read."""
    kv = synthetic_kv(layers=LAYERS, heads=HEADS, tokens=len(TOKENS), head_dim=HEAD_DIM)
    src = blocks()
    write_blocks(src, PagedLayout(DIMS, BS), BLOCK_IDS, kv)
    c = Recording(socket_path=served_sidecar.socket)
    buf, st, _ = staged.register(c, src, PagedLayout(DIMS, BS), FP, 0, 192)
    read, copy = [], st._from_blocks
    monkeypatch.setattr(st, "_from_blocks", lambda ids, a, b: read.append((a, b)) or copy(ids, a, b))
    assert st.store(c, buf, TOKENS, BLOCK_IDS, N, first_token=256) == 10  # 6 queued, 4 counted as the caller's
    c.flush()
    st.close()
    assert read == [(256, 448), (448, 640)]
    assert [call[1:4] for call in c.calls] == [(448, 256, -256), (640, 448, -448)]
    chunks = [n for n in LocalStore(tmp_path / "store").list("kv/") if n.endswith("/raw.kvfc")]
    assert len(chunks) == 6, chunks


def test_a_plan_is_used_when_one_window_holds_the_prompt_and_a_load_ends_at_end(served_sidecar):
    kv = synthetic_kv(layers=LAYERS, heads=HEADS, tokens=len(TOKENS), head_dim=HEAD_DIM)
    stored(served_sidecar, kv, staging_tokens=1024)
    dst = blocks()
    layout = PagedLayout(DIMS, BS)
    c = Recording(socket_path=served_sidecar.socket)
    buf, st, _ = staged.register(c, dst, layout, FP, 0, 1024)
    plan = c.lookup(buf, TOKENS + [1, 2, 3], SLOW_MODEL)
    assert (plan.preset, plan.loaded_tokens) == ("raw", 640)
    assert st.fetch(c, buf, TOKENS + [1, 2, 3], BLOCK_IDS, 0, 320, plan, SLOW_MODEL) == 320
    assert c.calls == [("load", 643, 0, 0, True)]
    got = read_blocks(dst, layout, BLOCK_IDS, 0, 640)
    assert torch.equal(got[:, :, :, :320], kv[:, :, :, :320]) and bool((got[:, :, :, 320:] == SENTINEL).all())  # nothing past end
    assert untouched(dst, BLOCK_IDS[:20])


def test_a_partial_hit_loads_the_stored_chunks_and_stops(served_sidecar):
    kv = synthetic_kv(layers=LAYERS, heads=HEADS, tokens=len(TOKENS), head_dim=HEAD_DIM)
    stored(served_sidecar, kv[:, :, :, :256], TOKENS[:256])  # 4 of the 10 chunks
    dst = blocks()
    c = Recording(socket_path=served_sidecar.socket)
    buf, st, _ = staged.register(c, dst, PagedLayout(DIMS, BS), FP, 0, 192)
    assert st.fetch(c, buf, TOKENS, BLOCK_IDS, 0, 640, options=SLOW_MODEL) == 256
    assert [call[1:4] for call in c.calls] == [(192, 0, 0), (384, 192, -192)]  # the second window found chunk 4 missing
    assert torch.equal(read_blocks(dst, PagedLayout(DIMS, BS), BLOCK_IDS, 0, 256), kv[:, :, :, :256])
    assert untouched(dst, BLOCK_IDS[:16])


def test_a_staging_smaller_than_a_chunk_moves_nothing(served_sidecar):
    kv = synthetic_kv(layers=LAYERS, heads=HEADS, tokens=len(TOKENS), head_dim=HEAD_DIM)
    stored(served_sidecar, kv)
    c = KVClient(socket_path=served_sidecar.socket)
    dst = blocks()
    buf, st, _ = staged.register(c, dst, PagedLayout(DIMS, BS), FP, 0, 48)
    assert st.fetch(c, buf, TOKENS, BLOCK_IDS, 0, 640, options=SLOW_MODEL) == 0
    assert st.store(c, buf, TOKENS, BLOCK_IDS, N) == 0
    assert untouched(dst, [])


def test_windows_over_http_are_checked(served_sidecar):
    """A negative offset gives slots only from first_token on; a store's first_token is whole chunks;
    a store from first_token reads nothing before it."""
    c = KVClient(socket_path=served_sidecar.socket)
    buf, st, _ = staged.register(c, blocks(), PagedLayout(DIMS, BS), FP, 0, 128)
    with pytest.raises(SidecarError, match="out of range"):
        c.fetch(buf, TOKENS[:128], offset=-10, first_token=0)
    with pytest.raises(SidecarError, match="out of range"):
        c.fetch(buf, TOKENS[:256], offset=-64, first_token=64)  # 192 tokens from 64 do not fit 128 slots
    with pytest.raises(SidecarError, match="whole chunks"):
        c.store(buf, TOKENS[:256], offset=-96, first_token=96)
    st.buffer.tensor.fill_(1.0)
    rep = c.store(buf, TOKENS[:256], offset=-128, first_token=128)
    assert (rep.skipped_chunks, rep.queued_chunks) == (2, 2)
    c.flush()
    assert c.hit_tokens(buf, TOKENS[:256]) == 0  # chunks 0 and 1 were never stored: the run starts with a miss


def test_a_cuda_handle_to_a_sidecar_without_cuda_is_refused_as_no_device(served_sidecar):
    if torch.cuda.is_available():
        pytest.skip("this sidecar has CUDA (the gpu test hides it from a sidecar process)")
    body = {"model": FP, "handle": {"kind": "cuda", "args": {"tuple": []}, "shape": [1], "dtype": "float16"}}
    status, reply = raw_request(served_sidecar.where["port"], "POST", "/v1/buffers", json.dumps(body).encode(),
                                {"Authorization": f"Bearer {TOKEN}"})
    reply = json.loads(reply)
    assert status == 400 and reply["error"] == "no_device" and "needs a sidecar with CUDA" in reply["detail"], reply
    assert SidecarError(400, reply["error"], reply["detail"]).no_device
    assert SidecarError(400, "bad_request", "a CUDA buffer handle needs a sidecar with CUDA").no_device  # an older sidecar
    assert not SidecarError(400, "bad_request", "this sidecar serves model 'x', not 'y'").no_device


def test_the_connector_option_is_checked():
    pytest.importorskip("vllm")
    from kvfetcher.integrations.vllm_meta import Options

    assert Options.parse({"staging_tokens": 4096}).staging_tokens == 4096
    for bad in (0, -1, 1.5, "8192", True):
        with pytest.raises(ValueError, match="staging_tokens"):
            Options.parse({"staging_tokens": bad})


# --- GPU: a device-plugin pod's sidecar, which sees no CUDA device ----------------------------


@pytest.mark.gpu
def test_gpu_blocks_through_a_sidecar_without_cuda(tmp_path):
    """The sidecar process runs with CUDA hidden (CUDA_VISIBLE_DEVICES=""), as beside a device-plugin
    GPU: the registration is refused as no_device, so staging is chosen; a prompt's KV stored from
    GPU blocks and loaded back through a staging of 3 chunks, from a first token mid-chunk, is
    byte-identical; that sidecar decodes no GPU-only format."""
    env = dict(KVFETCHER_STORE_DIR=str(tmp_path / "store"), KVFETCHER_PRESET="raw,q8,q8-zstd", KVFETCHER_CHUNK_TOKENS=str(N),
               KVFETCHER_WARM_UP="0", CUDA_VISIBLE_DEVICES="")
    formats = subprocess.run([sys.executable, "-c", "from kvfetcher.fetch.plan import FORMATS; print(sorted(set(FORMATS.values())))"],
                             env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, check=True).stdout
    assert "ans" not in formats and "hevc" in formats and "zstd" in formats, formats
    kv = synthetic_kv(layers=LAYERS, heads=HEADS, tokens=len(TOKENS), head_dim=HEAD_DIM).cuda()
    layout = PagedLayout(DIMS, BS)
    with served(str(tmp_path / "kvf.sock"), env):
        c = Recording(socket_path=str(tmp_path / "kvf.sock"))
        src = blocks(device="cuda")
        write_blocks(src, layout, BLOCK_IDS, kv)
        torch.cuda.synchronize()
        buf, st, why = staged.register(c, src, layout, FP, 0, 192)
        assert st is not None and "needs a sidecar with CUDA" in why, why
        assert st.store(c, buf, TOKENS, BLOCK_IDS, N) == 10
        c.flush()
        for preset in ("raw", "q8", "q8-zstd"):
            dst = blocks(device="cuda")
            write_blocks(dst, layout, BLOCK_IDS[:10], kv[:, :, :, :160].flip(0))  # the engine's own KV before token 160
            dbuf, dst_staging, _ = staged.register(c, dst, layout, FP, 0, 192)
            options = FetchOptions(presets=(preset,), recompute_tokens_per_s=1.0)
            assert dst_staging.fetch(c, dbuf, TOKENS, BLOCK_IDS, 160, 640, options=options) == 640, preset
            got = read_blocks(dst, layout, BLOCK_IDS, 0, 640)
            assert torch.equal(got[:, :, :, :160], kv[:, :, :, :160].flip(0))
            if preset == "raw":
                assert torch.equal(got[:, :, :, 160:].view(torch.int16), kv[:, :, :, 160:].view(torch.int16))  # byte-identical
            else:  # a lossy preset: what a flat host buffer loads, byte for byte
                flat = ipc.allocate((LAYERS, 2, HEADS, 640, HEAD_DIM), torch.float16)
                assert c.fetch(c.register(flat.handle, FP), TOKENS, options=options).loaded_tokens == 640
                assert torch.equal(got[:, :, :, 160:].cpu().view(torch.int16), flat.tensor[:, :, :, 160:].view(torch.int16)), preset
            assert untouched(dst, BLOCK_IDS)


def test_staging_memory_stays_pinned_until_closed_or_collected_and_mapped_until_unpinned(monkeypatch, caplog):
    """On a GPU the staging (both arenas in engine-decode mode) is page-locked for the copies to the
    blocks; each is unpinned once, before its memory can be unmapped; one CUDA refuses stays pageable."""
    calls = []
    monkeypatch.setattr(ipc, "pin", lambda t: calls.append(("pin", t.data_ptr())) or len(calls) == 1)
    monkeypatch.setattr(ipc, "unpin", lambda t: calls.append(("unpin", t.data_ptr(), t.numel())))

    class Owner:
        pass

    a, b = torch.zeros(1000, dtype=torch.uint8), torch.zeros(10, dtype=torch.uint8)
    owner = Owner()
    done = staged.pin_while_alive(owner, [a, b])
    assert "could not be page-locked" in caplog.text  # b: refused, so never unpinned
    done()
    done()
    del owner
    assert calls == [("pin", a.data_ptr()), ("pin", b.data_ptr()), ("unpin", a.data_ptr(), 1000)]
    calls.clear()
    owner, ptr = Owner(), a.data_ptr()
    staged.pin_while_alive(owner, [a])
    del a  # the finalizer holds it: still mapped when unpinned
    del owner
    assert calls == [("pin", ptr), ("unpin", ptr, 1000)]
