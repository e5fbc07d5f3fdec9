"""The pack replayed from a CUDA graph (codec/graphs.py): the same objects byte for byte as the
eager pack, chunk after chunk (each its own start position), in more threads than graphs."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvfetcher import chunk
from kvfetcher.codec import graphs, layout, nvcomp, rope
from kvfetcher.format import presets

SHIPPED_FP = "smollm2-135m-instruct-q4_1/float32"


@pytest.fixture(autouse=True)
def _no_graphs_yet(monkeypatch):
    """Each test starts with no graph, no chunk kind seen (graphs are kept for the process)."""
    for name, value in {"_idle": {}, "_alive": 0, "_seen": set(), "_failed": set()}.items():
        monkeypatch.setattr(graphs, name, value)


def test_a_rotation_from_a_tensor_start_is_the_one_from_the_int():
    for start in (0, 128, 40_000):
        want = rope.rotation(start, 64, 32, 5e5)
        got = rope.rotation(torch.tensor(float(start), dtype=torch.float64), 64, 32, 5e5)
        assert all(torch.equal(w, g) for w, g in zip(want, got))


def test_off_the_gpu_the_pack_is_the_eager_one():
    kv = torch.randn(2, 2, 3, 32, 64, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    lp = presets.get("q8-zstd").layout
    assert not graphs.enabled(kv, lp)
    want = layout.pack(kv, lp, 32)
    for _ in range(3):
        with graphs.packed(kv, lp, 32) as got:
            assert torch.equal(want.frames, got.frames) and torch.equal(want.side, got.side)


def _chunks(n: int = 4, tokens: int = 128) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    kv = (torch.randn(30, 2, 3, n * tokens, 64, generator=g) * 2).to(torch.float16).cuda()
    return [kv[:, :, :, i * tokens : (i + 1) * tokens].contiguous() for i in range(n)]


def _objects(preset: str, kvs: list[torch.Tensor]) -> list[bytes]:
    T = kvs[0].shape[3]
    return [bytes(chunk.encode_chunk(kv, preset, SHIPPED_FP, start=i * T, rope_theta=1e5)) for i, kv in enumerate(kvs)]


@pytest.mark.gpu
@pytest.mark.skipif(not nvcomp.available(), reason="needs a CUDA GPU and nvCOMP")
@pytest.mark.parametrize("preset", ["q8-ans", "balanced-ans", "compact-ans", "transform-ans"])
def test_replayed_packs_make_the_eager_packs_objects(preset, monkeypatch):
    kvs = _chunks()
    monkeypatch.setenv("KVFETCHER_ENCODE_GRAPHS", "0")
    want = _objects(preset, kvs)
    monkeypatch.setenv("KVFETCHER_ENCODE_GRAPHS", "3")
    assert _objects(preset, kvs) + _objects(preset, kvs) == want + want  # the third chunk on is replayed
    assert any(kind[1] == tuple(kvs[0].shape) and gs for kind, gs in graphs._idle.items()), "no graph was captured"
    with ThreadPoolExecutor(4) as pool:  # more threads than graphs: some packs eager, some replayed
        outs = list(pool.map(lambda _: _objects(preset, kvs), range(8)))
    assert all(o == want for o in outs)
    assert graphs._alive <= 3


def test_a_kind_whose_capture_fails_is_packed_eagerly_from_then_on(monkeypatch, caplog):
    """The capture's failure (an operation it refuses) is logged once and costs no chunk: the pack
    runs op by op, then and for every later chunk of that kind."""
    kv = torch.randn(2, 2, 3, 32, 64, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    lp = presets.get("q8-zstd").layout
    tries = []

    def refuse(kv, params):
        tries.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "enabled", lambda kv, params: True)
    monkeypatch.setattr(graphs, "_capture", refuse)
    want = layout.pack(kv, lp, 32)
    for _ in range(4):
        with graphs.packed(kv, lp, 32) as got:
            assert torch.equal(want.frames, got.frames) and torch.equal(want.side, got.side)
    assert len(tries) == 1 and graphs._alive == 0
    assert "capturing the pack failed" in caplog.text
