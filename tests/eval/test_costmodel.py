"""costmodel: shape arithmetic, the prefill model and its fit, and the winner per link."""

import pytest

from kvfetcher.fetch import choice
from kvfetcher.eval import costmodel
from kvfetcher.eval.costmodel import LLAMA3_8B, LLAMA3_70B, Gpu, Representation


def test_llama3_shapes_kv_and_params():
    assert LLAMA3_8B.kv_bytes_per_token() == 32 * 2 * 8 * 128 * 2  # 128 KiB per token in bf16
    assert costmodel.kv_bytes(LLAMA3_70B, 1000) == 1000 * 80 * 2 * 8 * 128 * 2
    # Llama-3-8B: ~7.0 B parameters in its layers (+ embeddings and head ~1.05 B)
    assert 6.9e9 < LLAMA3_8B.params_per_layer() * LLAMA3_8B.layers < 7.0e9
    assert 64e9 < LLAMA3_70B.params_per_layer() * LLAMA3_70B.layers < 70e9


def test_attention_grows_quadratically_matmuls_linearly():
    lin1, att1 = costmodel.prefill_flops(LLAMA3_8B, 4096)
    lin2, att2 = costmodel.prefill_flops(LLAMA3_8B, 8192)
    head = 2.0 * LLAMA3_8B.hidden * LLAMA3_8B.vocab
    assert (lin2 - head) == pytest.approx(2 * (lin1 - head))
    assert att2 == pytest.approx(4 * att1)
    # prefill per KV byte grows with the context: the case for fetching long prompts
    per_byte = [sum(costmodel.prefill_flops(LLAMA3_8B, t)) / costmodel.kv_bytes(LLAMA3_8B, t) for t in (4096, 32768, 131072)]
    assert per_byte == sorted(per_byte) and per_byte[-1] > 2 * per_byte[0]
    # 70B: ~2.5x the KV per token of 8B, ~9x the matmul work
    assert LLAMA3_70B.kv_bytes_per_token() / LLAMA3_8B.kv_bytes_per_token() == 2.5
    assert 8.5 < LLAMA3_70B.params_per_layer() * 80 / (LLAMA3_8B.params_per_layer() * 32) < 10


def test_fit_recovers_efficiencies():
    gpu = Gpu("x", 989.0, 0.55, 0.35)
    pts = [(s, t, gpu.prefill_seconds(s, t)) for s in (LLAMA3_8B, LLAMA3_70B) for t in (4096, 16384, 65536)]
    e1, e2 = costmodel.fit_efficiency(pts, 989.0)
    assert e1 == pytest.approx(0.55, rel=1e-6) and e2 == pytest.approx(0.35, rel=1e-6)
    with pytest.raises(ValueError):
        costmodel.fit_efficiency([(LLAMA3_8B, 4096, 0.1)], 989.0)


def test_the_gpus_prefill_model_splits_a_prefill_where_the_flops_do():
    """Tokens ``n..T`` after ``n`` cost the layers' matmuls of ``T - n`` tokens and the attention
    of a ``T`` prefill less that of an ``n`` one; the LM head once."""
    gpu, T, n = Gpu("x", 989.0), 32768, 8192
    m = gpu.prefill_model(LLAMA3_8B)
    assert m.seconds(0, T) == gpu.prefill_seconds(LLAMA3_8B, T)
    assert m.seconds(n, T - n) == pytest.approx(gpu.prefill_seconds(LLAMA3_8B, T) - gpu.prefill_seconds(LLAMA3_8B, n) + m.c0)


REPS = {"raw": Representation(1.0, 4e9, "raw"), "q8": Representation(1.76, 0.5e9)}


def test_compare_slow_link_recompute_fast_link_fetch():
    rec = 0.57  # 8B, 16K on an H200
    slow = costmodel.compare(LLAMA3_8B, 16384, 1e9 / 8, rec, REPS)
    assert slow.winner == choice.RECOMPUTE and slow.seconds["raw"] > 10
    fast = costmodel.compare(LLAMA3_8B, 16384, 100e9 / 8, rec, REPS)
    assert fast.winner == "raw"
    kv = costmodel.kv_bytes(LLAMA3_8B, 16384)
    assert fast.seconds["raw"] == pytest.approx(0.005 + max(kv / 12.5e9, kv / 4e9))
    assert fast.speedup_over(choice.RECOMPUTE) == pytest.approx(rec / fast.seconds["raw"])


def test_compare_compressed_wins_where_link_not_decoder_limits():
    # 70B, 128K (43 GB of KV): at 25 Gbit/s with a decoder faster than the link, q8's 1.76x fewer bytes win
    reps = {"raw": REPS["raw"], "q8": Representation(1.76, 8e9)}
    v = costmodel.compare(LLAMA3_70B, 131072, 25e9 / 8, 60.0, reps)
    assert v.winner == "q8"
    assert v.speedup_over("raw") == pytest.approx(1.76, rel=0.01)
    only_raw = costmodel.compare(LLAMA3_70B, 131072, 25e9 / 8, 60.0, reps, allowed={"raw"})
    assert only_raw.winner == "raw" and "q8" not in only_raw.seconds
