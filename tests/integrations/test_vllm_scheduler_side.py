"""The connector's scheduler side: a request's own bad ``kv_transfer_params`` makes that request
recompute, never an exception in vLLM's scheduler (which would stop the engine). Run without vLLM
(tests/vllm_stub.py)."""

from __future__ import annotations

from vllm_stub import run_without_vllm

CODE = r'''
from types import SimpleNamespace
import torch
from kvfetcher.integrations.vllm_meta import Options
from kvfetcher.integrations.vllm_scheduler import SchedulerSide

spec = SimpleNamespace(block_size=16, dtype=torch.bfloat16, num_kv_heads=2, head_size=64)
kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])])
vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))
s = SchedulerSide(vllm_config, kv_cache_config, Options(socket="/nonexistent/kvfetcher.sock", model="m"))
for params in ({"presets": ["balnced"]}, {"presets": 5}, {"ttft_budget_s": "soon"}):
    request = SimpleNamespace(request_id=str(params), prompt_token_ids=list(range(600)), kv_transfer_params=params,
                              skip_reading_prefix_cache=False)
    print(s.matched(request, 0), s.matched(request, 0))
s.close()
'''


def test_unknown_presets_in_a_request_make_it_recompute():
    run = run_without_vllm(CODE)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:3] == ["(0, False) (0, False)"] * 3, run.stdout
