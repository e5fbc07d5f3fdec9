"""Host-memory KV buffers are sealed memfds passed over the sidecar's socket, so the webhook adds
no /dev/shm volume, and the pool's schema has no size for one."""
from __future__ import annotations

from typing import Any

from test_op_builders import MANAGED, gpu_pod, pool, valid

from kvfetcher_operator import injection


def _mounts(container: dict[str, Any]) -> list[str]:
    return [m["mountPath"] for m in container.get("volumeMounts") or []]


def test_an_injected_pod_has_no_shm_volume_of_ours() -> None:
    pod = gpu_pod(resources={"limits": {"nvidia.com/gpu": "1"}})
    out = injection.apply_merge_patch(pod, injection.mutate(pod, pool(MANAGED)).patch)
    valid(out)
    assert [v["name"] for v in out["spec"]["volumes"]] == [injection.SOCKET_VOLUME]
    assert not any(v.get("emptyDir", {}).get("medium") == "Memory" for v in out["spec"]["volumes"])
    for container in out["spec"]["initContainers"] + out["spec"]["containers"]:
        assert "/dev/shm" not in _mounts(container), container["name"]


def test_a_model_with_its_own_shm_keeps_it_and_the_sidecar_does_not_mount_it() -> None:
    pod = gpu_pod(resources={"limits": {"nvidia.com/gpu": "1"}}, volumeMounts=[{"name": "dshm", "mountPath": "/dev/shm"}])
    pod["spec"]["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    out = injection.apply_merge_patch(pod, injection.mutate(pod, pool(MANAGED)).patch)
    sidecar = out["spec"]["initContainers"][0]
    assert sidecar["name"] == injection.CONTAINER and "/dev/shm" not in _mounts(sidecar)
    assert [v["name"] for v in out["spec"]["volumes"]] == ["dshm", injection.SOCKET_VOLUME]


def test_the_pool_schema_has_no_shm_size(pool_schema: dict[str, Any]) -> None:
    sidecar = pool_schema["properties"]["spec"]["properties"]["sidecar"]["properties"]
    assert "shmSize" not in sidecar and "port" in sidecar
