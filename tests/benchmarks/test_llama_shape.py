"""llama_shape (bench): the timing model must compute what a Llama computes, so that a fetched
prefix plus a suffix prefill and batched decode steps equal one long prefill."""

import pytest
import torch

from benchmarks.lib.llama_shape import SHAPES, LlamaShape, subset

TINY = SHAPES["tiny"]


def _model(dtype=torch.float32):
    return LlamaShape(TINY, "cpu", dtype=dtype, seed=1)


def _buf(tokens, layers=TINY.layers, dtype=torch.float32):
    return torch.zeros((layers, 2, TINY.kv_heads, tokens, TINY.head_dim), dtype=dtype)


def test_suffix_after_prefix_equals_one_prefill():
    m = _model()
    ids = torch.randint(0, TINY.vocab, (40,), generator=torch.Generator().manual_seed(0))
    a, b = _buf(48), _buf(48)
    t_full = m.prefill(ids, a)
    m.prefill(ids[:32], b)
    t_suffix = m.prefill(ids[32:], b, start=32)
    assert int(t_full) == int(t_suffix)
    torch.testing.assert_close(a[:, :, :, :40], b[:, :, :, :40], rtol=1e-4, atol=1e-4)
    c = _buf(48)
    assert int(m.prefill(ids, c, chunk=16)) == int(t_full)  # chunked prefill: same cache
    torch.testing.assert_close(a[:, :, :, :40], c[:, :, :, :40], rtol=1e-4, atol=1e-4)


def test_batched_decode_equals_prefill_per_request():
    m = _model()
    g = torch.Generator().manual_seed(2)
    lens = [9, 17, 12]
    pool = torch.zeros((4, TINY.layers, 2, TINY.kv_heads, 32, TINY.head_dim))
    seqs = [torch.randint(0, TINY.vocab, (n + 1,), generator=g) for n in lens]
    slots = [3, 0, 2]  # scattered, with an idle slot (1) inside the span
    for s, ids in zip(slots, seqs):
        m.prefill(ids[:-1], pool[s])
    nxt = m.decode_step(torch.stack([ids[-1] for ids in seqs]), pool, torch.tensor(slots), torch.tensor(lens))
    for i, ids in enumerate(seqs):
        ref = _buf(32)
        assert int(m.prefill(ids, ref)) == int(nxt[i])
        torch.testing.assert_close(pool[slots[i], :, :, :, : lens[i] + 1], ref[:, :, :, : lens[i] + 1], rtol=1e-4, atol=1e-4)


def test_layer_subset_has_fewer_layers():
    s = subset(SHAPES["llama3-70b"], 8)
    assert s.layers == 8 and s.hidden == 8192 and s.kv_heads == 8
    assert len(LlamaShape(subset(TINY, 1), "cpu").layers) == 1


@pytest.mark.gpu
def test_bf16_cuda_prefill_and_decode_run():
    m = LlamaShape(TINY, "cuda")
    pool = torch.zeros((2, TINY.layers, 2, TINY.kv_heads, 64, TINY.head_dim), dtype=torch.bfloat16, device="cuda")
    m.prefill(torch.arange(20, device="cuda"), pool[1])
    out = m.decode_step(torch.tensor([3], device="cuda"), pool, torch.tensor([1], device="cuda"), torch.tensor([20], device="cuda"))
    assert out.shape == (1,)
