"""A pool's storePresets are what its sidecars get, and a sidecar so configured stores exactly
those presets; the CRD, the operator and the sidecar agree on every preset name; a bad list
gets a reason the status shows; old manifests (defaultPreset) keep working."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from crd_check import validate

from kvfetcher import config as settings
from kvfetcher import keys
from kvfetcher.config import Config
from kvfetcher.format.presets import PRESETS
from kvfetcher.store.local import LocalStore
from kvfetcher_operator import injection
from kvfetcher_operator import spec as specs
from kvtest import running
from op_helpers import POOLS, Api, cond, external_pool
from test_op_builders import gpu_pod, pool

MANAGED = {"storage": {"managed": {}}}
THETA = {injection.ROPE_THETA_ANNOTATION: "10000"}


DRA = {"resources": {"claims": [{"name": "gpu"}]}}  # a model whose GPU the sidecar shares


def injected_env(spec: dict[str, Any], annotations: dict[str, str] | None = None, model: dict | None = None) -> dict[str, str]:
    """The sidecar's literal environment (what is not a Secret or field reference) in a pod injected from
    `spec`; the model container (default: one with a DRA claim, so the sidecar shares its GPU) from `model`."""
    pod = gpu_pod(**(DRA if model is None else model))
    pod["metadata"]["annotations"].update(annotations or {})
    out = injection.apply_merge_patch(pod, injection.mutate(pod, pool(spec)).patch)
    return {e["name"]: e["value"] for e in out["spec"]["initContainers"][0]["env"] if "value" in e}


def codec(**fields: Any) -> dict[str, Any]:
    return {**MANAGED, "codec": fields}


@pytest.mark.parametrize("fields, annotations, stored", [
    ({}, THETA, "balanced-ans"),  # the default
    ({}, {}, "q8-ans"),  # no RoPE base: the q8 variant of the same back end
    ({"storePresets": ["raw"]}, {}, "raw"),  # raw where a pool asks
    ({"storePresets": ["compact-zstd", "raw"]}, {}, "raw"),  # pre-RoPE ones left out, the rest kept
    ({"storePresets": ["compact", "balanced-zstd"]}, THETA, "compact,balanced-zstd"),
    ({"storePresets": ["compact"]}, {injection.ROPE_THETA_ANNOTATION: "1e400"}, "q8"),  # not a usable base
    ({"defaultPreset": "exact"}, {}, "exact"),  # an old manifest's one preset
    ({"defaultPreset": "auto"}, {}, "q8-ans"),  # an old manifest's auto: the default
    ({"allowedPresets": ["raw", "q8"]}, THETA, "q8"),  # balanced-ans not allowed: q8, as before
])
def test_the_sidecar_gets_the_pools_store_presets(fields: dict[str, Any], annotations: dict[str, str],
                                                   stored: str, pool_schema: dict[str, Any]) -> None:
    spec = codec(**fields)
    assert specs.problems(spec) == [] and validate(pool_schema, {"metadata": {"name": "p"}, "spec": spec}) == []
    env = injected_env(spec, annotations)
    assert env[settings.PRESET.name] == stored
    assert (settings.ROPE_THETA.name in env) == (annotations == THETA)
    # Whatever a pool and a pod make of it, the sidecar starts with it (once it knows every name).
    named = stored.split(",") + env[settings.ALLOWED_PRESETS.name].split(",")
    if set(named) <= set(PRESETS):
        Config.from_env(env).validate(PRESETS)


@pytest.mark.parametrize("model", [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}, {}])
def test_a_sidecar_without_a_gpu_stores_the_portable_variant(model: dict) -> None:
    """A device-plugin-only model (or none) gives the sidecar no GPU, so no nvCOMP: -ans becomes -zstd."""
    env = injected_env(codec(storePresets=["balanced-ans", "q8-ans", "q8-zstd", "raw"]), THETA, model)
    assert env[settings.PRESET.name] == "balanced-zstd,q8-zstd,raw"
    Config.from_env(env).validate(PRESETS)


def test_the_pod_says_what_its_sidecar_stores_and_why() -> None:
    pod = gpu_pod()
    notes = injection.mutate(pod, pool(codec(storePresets=["balanced", "raw"]))).patch["metadata"]["annotations"]
    assert notes[injection.STORE_ANNOTATION] == ("raw (balanced need the model's RoPE base: "
                                                 "kvfetcher.io/rope-theta is not set)")
    pod["metadata"]["annotations"][injection.ROPE_THETA_ANNOTATION] = "rope"
    notes = injection.mutate(pod, pool(codec(storePresets=["balanced"]))).patch["metadata"]["annotations"]
    assert notes[injection.STORE_ANNOTATION].endswith("is not a number above 1)")


BAD = [
    ({"storePresets": ["q8", "turbo"]}, "storePresets"),
    ({"storePresets": []}, "storePresets"),
    ({"storePresets": ["compact"], "allowedPresets": ["raw", "q8"]}, "allowedPresets"),
    ({"allowedPresets": ["raw", "exact"]}, "storePresets"),  # neither default is allowed: say which to set
]


@pytest.mark.parametrize("fields, word", BAD, ids=[str(f) for f, _ in BAD])
def test_a_bad_store_preset_list_is_refused_with_a_reason(fields: dict[str, Any], word: str,
                                                          pool_schema: dict[str, Any]) -> None:
    spec = codec(**fields)
    assert validate(pool_schema, {"metadata": {"name": "p"}, "spec": spec}), "the CRD accepted it"
    assert any(word in problem for problem in specs.problems(spec)), specs.problems(spec)


async def test_the_pool_status_says_why_its_store_presets_are_refused(operator, api: Api) -> None:
    """What the API server would refuse (one that predates the schema, or without CEL) gets a reason."""
    bad = external_pool("odd", "http://unused", "unused", codec={"storePresets": ["q8", "turbo"]})
    await api.create(POOLS, bad)
    obj = await api.wait_for(POOLS, "default", "odd", lambda o: cond(o, "ConfigValid").get("status") == "False")
    assert "codec.storePresets: ['turbo'] are not presets" in cond(obj, "ConfigValid")["message"]
    assert await api.get("apps/v1/deployments", "default", "odd-evictor") is None  # nothing built from it


def test_a_repeated_store_preset_is_refused() -> None:
    """The API server refuses it too (a list of type set); the offline CRD check cannot tell."""
    assert any("distinct" in p for p in specs.problems(codec(storePresets=["raw", "raw"])))


def test_the_crd_offers_exactly_the_presets_the_operator_checks(pool_schema: dict[str, Any]) -> None:
    codec_schema = pool_schema["properties"]["spec"]["properties"]["codec"]["properties"]
    for field in ("storePresets", "allowedPresets"):
        assert codec_schema[field]["items"]["enum"] == list(settings.PRESET_NAMES)
        assert codec_schema[field]["maxItems"] == len(settings.PRESET_NAMES)
    assert codec_schema["allowedPresets"]["default"] == list(specs.PRESETS)
    assert set(codec_schema["defaultPreset"]["enum"]) == set(specs.DEFAULT_PRESETS)


@pytest.mark.parametrize("store_presets", [["raw", "q8"], ["exact"]])
async def test_a_sidecar_from_the_injected_env_stores_exactly_the_pools_presets(
        store_presets: list[str], tmp_path, shm) -> None:
    env = injected_env(codec(storePresets=store_presets, allowedPresets=store_presets, chunkTokens=16))
    cfg = Config.from_env(env)
    cfg.decode_procs, cfg.device = 0, "cpu"
    kv = torch.randn(2, 2, 1, 48, 8).to(torch.float16)
    buf = shm(kv.shape, kv.dtype)
    buf.tensor.copy_(kv)
    store = LocalStore(str(tmp_path))
    async with running(store, **{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}) as sc:
        bid = sc.register(buf.handle, "m")
        reply = await sc.store(bid, list(range(48)))
        await sc.flush()
    assert reply["queued_chunks"] == 3
    names = store.list("kv/")
    assert len(names) == 3 * len(store_presets)
    assert {keys.preset_of(n) for n in names} == set(store_presets)
