"""The operator end to end: kopf with the real handlers against a Kubernetes API emulator over
HTTP, the bucket step against a real S3 server (moto) on loopback."""
from __future__ import annotations

from kvfetcher_operator import bucket, builders

from op_helpers import POOLS, Api, cond, external_pool, is_ready as ready, s3_secret


async def test_external_pool_becomes_ready_with_bucket_and_ttl(operator, api: Api, s3: str) -> None:
    await api.create("v1/secrets", s3_secret())
    await api.create(POOLS, external_pool("ext", s3, "ext-bucket", retention={"ttlDays": 3}))
    pool = await api.wait_for(POOLS, "default", "ext", ready)
    status = pool["status"]
    assert status["phase"] == "Ready"
    assert status["endpoint"] == s3 and status["bucket"] == "ext-bucket"
    assert cond(pool, "StorageReady")["reason"] == "BucketReady"
    assert cond(pool, "ConfigValid")["status"] == "True"
    target = bucket.Target(s3, "ext-bucket", "testing", "testing")
    assert bucket.ttl_days(target) == 3
    secret = await api.get("v1/secrets", "default", "ext-kvfetcher")
    values = builders.decode_secret_data(secret["data"])
    assert values["endpoint"] == s3 and values["bucket"] == "ext-bucket" and values["authToken"]
