"""How the webhook makes a vLLM model container use the kvfetcher connector: pure functions over
the container's command, args and image.

The connector is named by vLLM's `--kv-transfer-config` flag, added where the webhook can tell
where vLLM's own arguments are:
- an exec-form command or args that run vLLM (`vllm serve ...`, `python -m vllm.entrypoints...`):
  the flag goes at the end of the args;
- no command, an image whose name says vLLM (`vllm/vllm-openai`, `.../vllm-kvfetcher`): args-only,
  relying on the image's entrypoint; the flag goes at the end of the args;
- a shell (`sh -c "... vllm serve ... && ..."`): the flag goes at the end of the vLLM command
  inside the script, shell-quoted.
A container with a KV-transfer config of its own keeps it. Whatever happens, :func:`connect`
says so in a line for the pod's annotation.
"""
from __future__ import annotations

import json
import re
import shlex
from typing import Any, NamedTuple

FLAGS = ("--kv-transfer-config", "--kv_transfer_config")
SHELLS = ("sh", "bash", "dash", "ash", "zsh")
_RUNS_VLLM = re.compile(r"(?<![\w.-])vllm\s+serve\b|\bvllm\.entrypoints\.[\w.]+")
_SHELL_C = re.compile(r"^-[a-z]*c$")  # -c, -lc, -ec, ...


class Connected(NamedTuple):
    """The container fields to set (empty: none), and what the pod's annotation says."""
    changes: dict[str, list[str]]
    note: str


def config(socket: str) -> str:
    """The `--kv-transfer-config` value: the kvfetcher connector on the sidecar's socket."""
    return json.dumps({
        "kv_connector": "KVFetcherConnector", "kv_connector_module_path": "kvfetcher.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"socket": socket},
    }, separators=(",", ":"))


def _image_is_vllm(image: str) -> bool:
    name = image.split("@")[0].rsplit("/", 1)[-1].split(":")[0]
    return "vllm" in name


def _shell_script(command: list[str], args: list[str]) -> int | None:
    """The index in command + args of a shell's `-c` script, or None."""
    words = command + args
    if not words or words[0].rsplit("/", 1)[-1] not in SHELLS:
        return None
    return next((i + 1 for i, w in enumerate(words[:-1]) if _SHELL_C.match(w)), None)


def _end_of_command(script: str, start: int) -> int | None:
    """Where the simple command running at ``start`` ends (an unquoted ; & | newline or `)`, or
    the script's end, less trailing blanks); None when its quoting does not balance."""
    quote, i = "", start
    while i < len(script):
        ch = script[i]
        if quote:
            if ch == "\\" and quote == '"':
                i += 1
            elif ch == quote:
                quote = ""
        elif ch == "\\":
            i += 1  # an escaped character, a line continuation among them
        elif ch in "'\"":
            quote = ch
        elif ch in ";&|\n)#":
            break
        i += 1
    if quote:
        return None
    end = min(i, len(script))
    while end > start and script[end - 1] in " \t":
        end -= 1
    return end


def _into_script(script: str, value: str) -> str | None:
    """``script`` with the flag at the end of its vLLM command; None where none is found or its end is unclear."""
    found = _RUNS_VLLM.search(script)
    if found is None:
        return None
    end = _end_of_command(script, found.end())
    if end is None:
        return None
    return f"{script[:end]} {FLAGS[0]} {shlex.quote(value)}{script[end:]}"


def connect(container: dict[str, Any], socket: str) -> Connected:
    """What makes ``container`` use the connector on ``socket``, if it runs vLLM and has no
    KV-transfer config of its own."""
    command = [str(w) for w in container.get("command") or []]
    args = [str(w) for w in container.get("args") or []]
    words = command + args
    if any(w.startswith(FLAGS) for w in words):
        return Connected({}, "not added: the container has its own --kv-transfer-config")
    value = config(socket)
    script_at = _shell_script(command, args)
    if script_at is not None:
        script = words[script_at]
        if any(flag in script for flag in FLAGS):
            return Connected({}, "not added: the container's script has its own --kv-transfer-config")
        if not _RUNS_VLLM.search(script):
            return Connected({}, "not added: its shell script runs no `vllm serve` or vllm.entrypoints")
        new = _into_script(script, value)
        if new is None:
            return Connected({}, "not added: the end of the vLLM command in its shell script is unclear (quoting)")
        field, index = ("command", script_at) if script_at < len(command) else ("args", script_at - len(command))
        changed = (command if field == "command" else args)[:]
        changed[index] = new
        return Connected({field: changed}, "added to the vLLM command of its shell script")
    if _RUNS_VLLM.search(" ".join(words)):
        return Connected({"args": args + [FLAGS[0], value]}, "added")
    if not command and _image_is_vllm(container.get("image") or ""):
        return Connected({"args": args + [FLAGS[0], value]}, "added (args-only: the image's entrypoint runs vLLM)")
    return Connected({}, "not added: the container does not run vLLM as far as its command, args and image tell")
