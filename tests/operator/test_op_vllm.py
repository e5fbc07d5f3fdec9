"""The webhook adds the kvfetcher connector to a model container that runs vLLM, unless the pod opts
out or the container already has a KV-transfer config; other model containers keep their arguments."""
from __future__ import annotations

import json

import pytest
from test_op_builders import MANAGED, gpu_pod, pool, valid

from kvfetcher_operator import injection


def model_after(pod):
    decision = injection.mutate(pod, pool(MANAGED))
    assert decision.outcome == "injected"
    out = injection.apply_merge_patch(pod, decision.patch)
    valid(out)
    return out["spec"]["containers"][1]


@pytest.mark.parametrize("container", [
    {"command": ["vllm", "serve"], "args": ["meta-llama/Llama-3.1-8B", "--port", "8000"]},
    {"command": ["python3", "-m", "vllm.entrypoints.openai.api_server"], "args": ["--model", "m"]},
    {"image": "vllm/vllm-openai:v0.26.0", "args": ["--model", "m"]},
    {"image": "vllm/vllm-openai:v0.26.0"},
])
def test_a_vllm_container_gets_the_connector_on_the_sidecars_socket(container):
    pod = gpu_pod(resources={"limits": {"nvidia.com/gpu": "1"}}, **container)
    model = model_after(pod)
    assert model["args"][: len(container.get("args", []))] == container.get("args", [])  # its own come first
    flag, value = model["args"][-2:]
    cfg = json.loads(value)
    assert flag == "--kv-transfer-config"
    assert cfg["kv_connector"] == "KVFetcherConnector" and cfg["kv_connector_module_path"] == "kvfetcher.integrations.vllm"
    assert cfg["kv_role"] == "kv_both" and cfg["kv_load_failure_policy"] == "recompute"
    assert cfg["kv_connector_extra_config"] == {"socket": injection.SOCKET}
    assert model.get("command") == container.get("command")


@pytest.mark.parametrize("container, annotations", [
    ({"command": ["vllm", "serve"], "args": ["m"]}, {injection.VLLM_ANNOTATION: "false"}),  # opted out
    ({"command": ["vllm", "serve"], "args": ["m", "--kv-transfer-config", "{}"]}, {}),  # has its own
    ({"command": ["vllm", "serve"], "args": ["m", "--kv_transfer_config={}"]}, {}),
    ({"command": ["sglang", "serve"], "args": ["m"]}, {}),  # not vLLM
])
def test_other_containers_keep_their_arguments(container, annotations):
    pod = gpu_pod(resources={"limits": {"nvidia.com/gpu": "1"}}, **container)
    pod["metadata"]["annotations"].update(annotations)
    assert model_after(pod).get("args") == container["args"]
