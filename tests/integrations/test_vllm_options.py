"""The connector's options refuse a typo with a message naming the key (a typo such as
`presets: "balnced,q8"` would otherwise be a miss forever). Run without vLLM (tests/vllm_stub.py)."""

from __future__ import annotations

import pytest
from vllm_stub import run_without_vllm

PARSE = "from kvfetcher.integrations.vllm_meta import Options\nprint(Options.parse({extra!r}))"


@pytest.mark.parametrize("extra, words", [
    ({"presets": "balnced,q8"}, ["'presets'", "balnced"]),
    ({"presets": ["q8", "raw8"]}, ["'presets'", "raw8"]),
    ({"ttft_budget_s": "soon"}, ["'ttft_budget_s'", "soon"]),
    ({"lookup_timeout_s": -1}, ["'lookup_timeout_s'"]),
    ({"lookup_stake": "much"}, ["'lookup_stake'", "much"]),
    ({"idle_step_wait_s": -0.001}, ["idle_step_wait_s"]),
    ({"idle_step_wait_s": "2ms"}, ["idle_step_wait_s", "2ms"]),
    ({"engine_decode": "yes"}, ["engine_decode", "yes"]),
    ({"engine_procs": -1}, ["engine_procs", "-1"]),
    ({"engine_procs": 2.5}, ["engine_procs", "2.5"]),
    ({"sokcet": "/run/x"}, ["sokcet", "unknown"]),
    ({"stores": False}, ["stores", "unknown"]),  # vLLM's kv_role says it, not kv_connector_extra_config
])
def test_bad_options_are_refused_naming_the_key(extra, words):
    run = run_without_vllm(PARSE.format(extra=extra))
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: kvfetcher:") and all(w in last for w in words), last


def test_good_options_parse():
    run = run_without_vllm(PARSE.format(extra={"presets": "balanced, q8", "ttft_budget_s": "1.5", "idle_step_wait_s": 0, "engine_decode": True, "engine_procs": 0}))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "presets=('balanced', 'q8')" in run.stdout and "ttft_budget_s=1.5" in run.stdout and "idle_step_wait_s=0" in run.stdout
    assert "engine_decode=True" in run.stdout and "engine_procs=0" in run.stdout
