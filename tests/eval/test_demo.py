import json

import pytest

from kvfetcher import cli


@pytest.mark.slow
def test_demo_json(monkeypatch, capsys):
    monkeypatch.delenv("KVFETCHER_S3_ENDPOINT", raising=False)
    monkeypatch.delenv("KVFETCHER_PRESET", raising=False)
    rc = cli.main(["demo", "--json", "--tokens", "300", "--chunk-tokens", "128", "--new-tokens", "8"])
    r = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert r["identical_tokens"] is True and r["matching_tokens"] == 8
    assert r["preset"] == "q8" and r["fetch_decision"] == "q8" and r["fetch_error"] is None
    assert r["loaded_tokens"] == 256 and r["computed_tokens"] == 44
    assert r["bytes_fetched"] > 0 and r["compression_ratio"] > 1.2  # q8 + lossless HEVC vs fp16
    assert r["bytes_stored"] >= r["bytes_fetched"]
    assert r["kv_bytes_fp16"] == 256 * 30 * 2 * 3 * 64 * 2
    assert r["ttft_recompute_s"] > 0 and r["ttft_fetch_s"] > 0


def test_demo_text(monkeypatch, capsys):
    from kvfetcher.eval.demo import render

    r = {
        "model": "m", "prompt_tokens": 10, "chunk_tokens": 4, "preset": "q8", "ttft_recompute_s": 2.0, "ttft_fetch_s": 1.0,
        "speedup": 2.0, "loaded_tokens": 8, "computed_tokens": 2, "fetch_s": 0.5, "fetch_decision": "q8",
        "fetch_predicted_s": 0.4, "fetch_error": None, "bytes_fetched": 1_000_000, "kv_bytes_fp16": 2_000_000,
        "compression_ratio": 2.0, "bytes_stored": 1_000_000, "store_s": 1.0, "new_tokens": 4, "identical_tokens": False, "matching_tokens": 3, "text": "hi",
    }
    out = render(r)
    assert "identical: NO (3/4)" in out and "(2.0x)" in out
