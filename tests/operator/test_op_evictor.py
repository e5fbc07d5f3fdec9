"""The pool's evictor: one Deployment per pool running `kvfetcher evict` with the pool's retention
settings and its scoped credentials; created once storage is ready, updated on a spec change,
owned by the pool (so removed with it), its state in the EvictorReady condition."""
from __future__ import annotations

from typing import Any

import kubernetes_validate
from op_helpers import POOLS, Api, cond, external_pool, is_ready, s3_secret
from pod_security import restricted_violations
from test_op_builders import EXTERNAL, MANAGED, pool

from kvfetcher import config as settings
from kvfetcher_operator import builders, evictor, injection


def container(obj: dict[str, Any]) -> dict[str, Any]:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def test_the_evictor_runs_the_cli_with_the_pools_retention() -> None:
    d = evictor.deployment(pool(MANAGED))  # maxSize 1Ti, ttlDays and interval by default
    kubernetes_validate.validate(d, "1.30.0", strict=True)
    assert container(d)["args"] == ["evict", "--store", "http://cache-minio.ml.svc:9000/kvcache", "--ttl-days", "7",
                                    "--every", "60", "--max-bytes", str(2**40)]
    assert container(d)["image"] == "ghcr.io/kvfetcher/kvfetcher-sidecar:0.1.0"  # the sidecar image has the CLI
    unbounded = evictor.deployment(pool({**EXTERNAL, "retention": {"ttlDays": 2, "evictIntervalSeconds": 30}}))
    assert container(unbounded)["args"] == ["evict", "--store", "https://s3.example.com/kv", "--ttl-days", "2",
                                            "--every", "30"]
    # One pod at a time, never injected, restricted, no API token.
    assert d["spec"]["replicas"] == 1 and d["spec"]["strategy"] == {"type": "Recreate"}
    template = d["spec"]["template"]
    assert injection.INJECT_LABEL not in template["metadata"]["labels"]
    assert restricted_violations(template["spec"]) == []
    assert template["spec"]["automountServiceAccountToken"] is False
    assert d["metadata"]["ownerReferences"] == [builders.owner_reference(pool(MANAGED))]


def test_the_evictor_reaches_the_store_with_the_pools_scoped_credentials() -> None:
    """The sidecars' credentials (managed: the pool's MinIO user, never MinIO's root), by reference."""
    env = {e["name"]: e for e in container(evictor.deployment(pool(MANAGED)))["env"]}
    ref = lambda name: tuple(env[name]["valueFrom"]["secretKeyRef"].values())  # noqa: E731
    assert ref(settings.S3_ACCESS_KEY.name) == ("cache-kvfetcher", "accessKey")
    assert ref(settings.S3_SECRET_KEY.name) == ("cache-kvfetcher", "secretKey")
    assert set(env) == {s.name for s in (settings.S3_ENDPOINT, settings.S3_BUCKET, settings.S3_ACCESS_KEY,
                                         settings.S3_SECRET_KEY)}
    external = evictor.deployment(pool(EXTERNAL))  # the user's credentials, region and CA, as the sidecar's
    c = container(external)
    env = {e["name"]: e for e in c["env"]}
    assert env[settings.S3_ACCESS_KEY.name]["valueFrom"]["secretKeyRef"] == {"name": "creds", "key": "id"}
    assert env[settings.S3_REGION.name]["value"] == "eu-1"
    assert env[settings.S3_CA_FILE.name]["value"] == f"{injection.CA_DIR}/ca.crt"
    assert c["volumeMounts"][0]["mountPath"] == injection.CA_DIR
    assert external["spec"]["template"]["spec"]["volumes"] == [injection.ca_volume(pool(EXTERNAL))]
    kubernetes_validate.validate(external, "1.30.0", strict=True)


async def test_one_evictor_per_pool_follows_the_spec(operator, api: Api, s3: str) -> None:
    await api.create("v1/secrets", s3_secret())
    await api.create(POOLS, external_pool("lru", s3, "lru-bucket", retention={"maxSize": "1Gi"}))
    pool_obj = await api.wait_for(POOLS, "default", "lru", is_ready)
    d = await api.get("apps/v1/deployments", "default", "lru-evictor")
    assert container(d)["args"][-2:] == ["--max-bytes", str(2**30)]
    assert d["metadata"]["ownerReferences"][0]["uid"] == "uid-lru"  # the garbage collector removes it with the pool
    assert cond(pool_obj, "EvictorReady")["reason"] == "EvictorStarting"

    # The emulator runs no Deployment controller: report the replica available as one would.
    await api.patch("apps/v1/deployments", "default", "lru-evictor", {"status": {"availableReplicas": 1}})
    pool_obj = await api.wait_for(POOLS, "default", "lru", lambda o: cond(o, "EvictorReady").get("status") == "True")
    assert "under 1Gi and within 7 days, every 60 s" in cond(pool_obj, "EvictorReady")["message"]
    assert is_ready(pool_obj)

    await api.patch(POOLS, "default", "lru", {"spec": {"retention": {"maxSize": "2Gi", "ttlDays": 1,
                                                                     "evictIntervalSeconds": 15}},
                                              "metadata": {"generation": 2}})
    d = await api.wait_for("apps/v1/deployments", "default", "lru-evictor",
                           lambda o: "15" in container(o)["args"])
    assert container(d)["args"] == ["evict", "--store", f"{s3}/lru-bucket", "--ttl-days", "1", "--every", "15",
                                    "--max-bytes", str(2 * 2**30)]
    async with api.session.get("/apis/apps/v1/namespaces/default/deployments") as listing:  # one, however many passes
        assert [i["metadata"]["name"] for i in (await listing.json())["items"]] == ["lru-evictor"]
