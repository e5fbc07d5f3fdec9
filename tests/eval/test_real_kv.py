"""The codec on real KV from the shipped model (SmolLM2-135M): exactness and accuracy."""

import json

import pytest
import torch

from kvfetcher.eval import accuracy, model
from kvfetcher.cli import main as cli_main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompt(lm):
    ids, cont = accuracy.prompt_ids(lm, "dialogue.txt", 0, 256)
    kv = model.prefill(lm, ids)[0].half()
    return ids, cont, kv


def test_exact_round_trip_is_bit_exact_on_real_kv(lm, prompt):
    _, _, kv = prompt
    rt = accuracy.round_trip(kv, "exact", lm.fingerprint, chunk_tokens=128)
    assert torch.equal(rt.kv.view(torch.uint8), kv.view(torch.uint8))


def test_q8_error_is_bounded_and_greedy_continuation_identical(lm, prompt):
    ids, cont, kv = prompt
    rt = accuracy.round_trip(kv, "q8", lm.fingerprint, chunk_tokens=128)
    # per channel and chunk: half a quantisation step, plus fp16 rounding of the result
    for s in range(0, kv.shape[3], 128):
        x = kv[:, :, :, s : s + 128].float()
        step = (x.amax(3) - x.amin(3)) / 255
        err = (rt.kv[:, :, :, s : s + 128].float() - x).abs().amax(3)
        assert torch.all(err <= step * 0.5 + x.abs().amax(3) * 2e-3 + 1e-6)
    assert model.greedy(lm, ids, rt.kv, 32) == model.greedy(lm, ids, kv, 32)
    nll_o = model.continuation_nll(lm, ids, kv, cont)
    assert abs(model.continuation_nll(lm, ids, rt.kv, cont) - nll_o) / nll_o < 0.01


def test_eval_cli_prints_the_documented_json(tmp_path, capsys, lm):
    from kvfetcher.eval.model import cache_dir

    text = tmp_path / "t.txt"
    text.write_text(model.sample_text("prose.txt"))
    argv = ["eval", "--model", str(cache_dir() / "smollm2-135m"), "--text", str(text), "--tokens", "200", "--cont", "64",
            "--preset", "q8", "--json"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("preset", "model", "tokens", "ratio_vs_fp16", "tf_top1", "kl", "nll_increase_pct", "stats", "gate",
                "bit_exact", "encode_mb_s", "decode_mb_s", "codec_backend"):
        assert key in out, key
    assert out["preset"] == "q8" and out["tokens"] == 200 and out["continuation"] == 64 and out["bit_exact"] is False
    assert 1.2 < out["ratio_vs_fp16"] < 4 and 0.9 <= out["tf_top1"] <= 1 and 0 <= out["kl"] < 0.01
    assert out["codec_backend"] == "x265+libavcodec" and out["gate"]["passed"]
    assert "greedy" not in out and "retrieval" not in out  # secondary figures only when asked
