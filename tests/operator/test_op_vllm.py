"""The webhook adds the kvfetcher connector to a model container that runs vLLM, unless the pod opts
out or the container already has a KV-transfer config; other model containers keep their arguments."""
from __future__ import annotations

import json
import subprocess

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


def annotated(pod):
    decision = injection.mutate(pod, pool(MANAGED))
    return decision.patch["metadata"]["annotations"][injection.CONNECTOR_ANNOTATION]


@pytest.mark.parametrize("container", [
    {"image": "registry.example.com/vllm-kvfetcher:v0.26.0", "args": ["--model", "m"]},  # the image's entrypoint
    {"image": "ghcr.io/acme/vllm@sha256:" + "a" * 64},
])
def test_an_args_only_container_of_a_vllm_image_gets_the_flag(container):
    model = model_after(gpu_pod(resources={"limits": {"nvidia.com/gpu": "1"}}, **container))
    assert model["args"][-2] == "--kv-transfer-config" and "command" not in model


@pytest.mark.parametrize("command, args", [
    (["sh", "-c"], ["pip list > /dev/null; exec vllm serve m --port 8000 && echo done"]),
    (["/bin/bash", "-lc", "vllm serve 'my model' \\\n  --port 8000 | tee /tmp/log"], []),
    (["sh", "-c", "python3 -m vllm.entrypoints.openai.api_server --model m"], []),
])
def test_a_shell_script_running_vllm_gets_the_flag_inside_it(command, args, tmp_path):
    """The flag lands in the vLLM command itself, shell-quoted: a real shell hands vLLM the JSON intact."""
    pod = gpu_pod(resources={"limits": {"nvidia.com/gpu": "1"}}, command=command, args=args)
    model = model_after(pod)
    assert annotated(pod) == "added to the vLLM command of its shell script"
    words = model.get("command", []) + model.get("args", [])
    assert len(words) == len(command + args)  # nothing appended after the script (it would be $0, $1...)
    script = words[[i for i, w in enumerate(words) if w.endswith("c") and w.startswith("-")][0] + 1]
    # Run it with stand-ins for vllm and python3 that print the arguments they are given.
    stub = tmp_path / "bin"
    stub.mkdir()
    for name in ("vllm", "python3"):
        (stub / name).write_text("#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done\n")
        (stub / name).chmod(0o755)
    run = subprocess.run(["sh", "-c", script], capture_output=True, text=True, cwd=tmp_path,
                         env={"PATH": f"{stub}:/usr/bin:/bin"})
    printed = run.stdout.splitlines()
    i = printed.index("--kv-transfer-config")
    assert json.loads(printed[i + 1])["kv_connector_extra_config"] == {"socket": injection.SOCKET}


@pytest.mark.parametrize("container, annotations, note", [
    ({"command": ["vllm", "serve"], "args": ["m"]}, {}, "added"),
    ({"command": ["vllm", "serve"], "args": ["m"]}, {injection.VLLM_ANNOTATION: "false"}, "not added: the pod's"),
    ({"command": ["vllm", "serve"], "args": ["m", "--kv-transfer-config", "{}"]}, {}, "not added: the container has"),
    ({"command": ["sglang", "serve"], "args": ["m"]}, {}, "not added: the container does not run vLLM"),
    ({"command": ["sh", "-c", "vllm serve 'm"]}, {}, "not added: the end of the vLLM command"),
    ({"command": ["sh", "-c", "sglang serve m"]}, {}, "not added: its shell script runs no"),
])
def test_the_pod_says_whether_the_flag_was_added(container, annotations, note):
    pod = gpu_pod(resources={"limits": {"nvidia.com/gpu": "1"}}, **container)
    pod["metadata"]["annotations"].update(annotations)
    assert annotated(pod).startswith(note)
    if note.startswith("not added"):
        assert model_after(pod).get("args") == container.get("args")
