"""The operator touches only what is its own: shared buckets, foreign objects, in-use and retained
pools, endpoints it must not call. kopf with the real handlers against the API emulator, the
bucket step against the S3 server on loopback (as test_op_operator)."""
from __future__ import annotations

import asyncio
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from minio.commonconfig import ENABLED, Filter
from minio.lifecycleconfig import Expiration, LifecycleConfig, Rule
from op_helpers import POOLS, Api, cond, external_pool, is_ready, s3_secret
from test_op_operator import events, managed_pool

from kvfetcher_operator import bucket, builders, injection, kube


def storage_reason(reason: str):
    return lambda o: cond(o, "StorageReady").get("reason") == reason


async def test_shared_bucket_keeps_what_is_not_the_pools(operator, api: Api, s3: str) -> None:
    """An existing bucket's rules and other objects survive the pool, a second pool is refused; the
    lifecycle rule an earlier operator set (expiry by write time, which fights the evictor) goes."""
    target = bucket.Target(s3, "shared", "testing", "testing")
    s3c = bucket.client(target)
    s3c.make_bucket("shared")
    theirs = Rule(ENABLED, rule_filter=Filter(prefix="logs/"), rule_id="owner-rule", expiration=Expiration(days=90))
    old = Rule(ENABLED, rule_filter=Filter(prefix=bucket.PREFIX), rule_id=bucket.RULE_ID, expiration=Expiration(days=7))
    s3c.set_bucket_lifecycle("shared", LifecycleConfig([theirs, old]))
    s3c.put_object("shared", "backups/db.tar", io.BytesIO(b"precious"), 8)
    await api.create("v1/secrets", s3_secret())
    await api.create(POOLS, external_pool("first", s3, "shared", retention={"dataPolicy": "Delete", "ttlDays": 2}))
    await api.wait_for(POOLS, "default", "first", is_ready)
    rules = {r.rule_id: r for r in s3c.get_bucket_lifecycle("shared").rules}
    assert list(rules) == ["owner-rule"] and rules["owner-rule"].expiration.days == 90
    s3c.put_object("shared", bucket.PREFIX + "ab/abc/raw.kvfc", io.BytesIO(b"kv"), 2)

    await api.create(POOLS, external_pool("second", s3, "shared", retention={"dataPolicy": "Delete"}))
    pool = await api.wait_for(POOLS, "default", "second", storage_reason("BucketInUse"))
    assert "default/first" in cond(pool, "StorageReady")["message"]
    await api.delete(POOLS, "default", "second")  # refused pools delete nothing either
    await api.wait_for(POOLS, "default", "second", lambda o: o is None)

    await api.delete(POOLS, "default", "first")
    await api.wait_for(POOLS, "default", "first", lambda o: o is None)
    assert [o.object_name for o in s3c.list_objects("shared", recursive=True)] == ["backups/db.tar"]
    assert [r.rule_id for r in s3c.get_bucket_lifecycle("shared").rules] == ["owner-rule"]


async def test_foreign_objects_of_the_same_name_are_not_adopted(operator, api: Api) -> None:
    """A Service the pool did not create is left alone and the pool says NameConflict."""
    foreign = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "taken-minio", "namespace": "default"},
               "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 80}]}}
    await api.create("v1/services", foreign)
    await api.create(POOLS, managed_pool("taken"))
    pool = await api.wait_for(POOLS, "default", "taken", storage_reason("NameConflict"))
    assert "Service default/taken-minio" in cond(pool, "StorageReady")["message"]
    service = await api.get("v1/services", "default", "taken-minio")
    assert not service["metadata"].get("ownerReferences") and service["spec"]["selector"] == {"app": "theirs"}


class NotS3(BaseHTTPRequestHandler):
    """Answers every request with 200 and a body the operator must not echo."""

    def _answer(self) -> None:
        body = b"<html>internal admin page: SECRET-TOKEN-123</html>"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


async def test_endpoints_the_operator_must_not_call(operator, api: Api) -> None:
    """Link-local endpoints are refused; a non-S3 server is no bucket and its body is not echoed."""
    await api.create("v1/secrets", s3_secret())
    await api.create(POOLS, external_pool("imds", "http://169.254.169.254", "creds"))
    pool = await api.wait_for(POOLS, "default", "imds", storage_reason("EndpointRefused"))
    assert "169.254.169.254" in cond(pool, "StorageReady")["message"]

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        await api.create(POOLS, external_pool("html", f"http://127.0.0.1:{server.server_port}", "html"))
        pool = await api.wait_for(POOLS, "default", "html", storage_reason("BucketUnavailable"))
    finally:
        server.shutdown()
        server.server_close()
    assert cond(pool, "Ready")["status"] == "False"
    assert "SECRET-TOKEN" not in str(pool["status"]) and "SECRET-TOKEN" not in str(events(api, "html"))


async def test_tenancy_secret_is_part_of_readiness(operator, api: Api, s3: str) -> None:
    """A pool whose tenant salt Secret is missing is not Ready (its pods would not start)."""
    await api.create("v1/secrets", s3_secret())
    await api.create(POOLS, external_pool("salty", s3, "salty", tenancy={
        "saltFrom": "Secret", "secretRef": {"name": "tenant-salt"}}))
    pool = await api.wait_for(POOLS, "default", "salty", storage_reason("TenancySecretMissing"))
    assert not is_ready(pool)
    salt = s3_secret()
    salt["metadata"]["name"] = "tenant-salt"
    salt["data"] = {"salt": "c2FsdA=="}
    await api.create("v1/secrets", salt)
    await api.wait_for(POOLS, "default", "salty", is_ready)


async def test_deletion_waits_for_pods_that_use_the_pool(operator, api: Api, s3: str) -> None:
    """The data and the Secret stay while an injected pod still needs them."""
    await api.create("v1/secrets", s3_secret())
    await api.create(POOLS, external_pool("busy", s3, "busy", retention={"dataPolicy": "Delete"}))
    await api.wait_for(POOLS, "default", "busy", is_ready)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "model-0", "namespace": "default", "annotations": {injection.INJECTED_ANNOTATION: "busy"}},
        "spec": {"containers": [{"name": "m", "image": "m"}]}}
    await api.create("v1/pods", pod)
    await api.wait_for(POOLS, "default", "busy", lambda o: o["status"].get("injectedPods") == 1)
    await api.delete(POOLS, "default", "busy")
    for _ in range(100):
        if any(e["reason"] == "PoolInUse" for e in events(api, "busy")):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("no PoolInUse warning")
    assert await api.get(POOLS, "default", "busy") is not None
    assert bucket.client(bucket.Target(s3, "busy", "testing", "testing")).bucket_exists("busy")
    await api.delete("v1/pods", "default", "model-0")
    await api.wait_for(POOLS, "default", "busy", lambda o: o is None)
    assert not bucket.client(bucket.Target(s3, "busy", "testing", "testing")).bucket_exists("busy")


async def test_retain_keeps_the_salt_for_a_recreated_pool(operator, api: Api, s3: str) -> None:
    """An external Retain pool's Secret survives, and a pool of the same name takes it back."""
    await api.create("v1/secrets", s3_secret())
    await api.create(POOLS, external_pool("keep", s3, "keep"))
    await api.wait_for(POOLS, "default", "keep", is_ready)
    salt = builders.decode_secret_data((await api.get("v1/secrets", "default", "keep-kvfetcher"))["data"])["tenantSalt"]
    await api.delete(POOLS, "default", "keep")
    await api.wait_for(POOLS, "default", "keep", lambda o: o is None)
    secret = await api.get("v1/secrets", "default", "keep-kvfetcher")
    assert not secret["metadata"].get("ownerReferences")
    assert secret["metadata"]["annotations"][kube.RELEASED_ANNOTATION] == "KVCachePool/keep"
    # The emulator runs no garbage collector: remove what the pool owned (its evictor) as one would.
    evictor = await api.get("apps/v1/deployments", "default", "keep-evictor")
    assert evictor["metadata"]["ownerReferences"][0]["uid"] == "uid-keep"
    await api.delete("apps/v1/deployments", "default", "keep-evictor")

    again = external_pool("keep", s3, "keep")
    again["metadata"]["uid"] = "uid-keep-2"
    await api.create(POOLS, again)
    await api.wait_for(POOLS, "default", "keep", is_ready)
    secret = await api.get("v1/secrets", "default", "keep-kvfetcher")
    assert builders.decode_secret_data(secret["data"])["tenantSalt"] == salt
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-keep-2"


def test_bucket_removal_streams_in_bounded_steps(s3: str) -> None:
    """Deletion works a time budget at a time and picks up where it stopped."""
    target = bucket.Target(s3, "many", "testing", "testing")
    bucket.ensure(target, "default/many")
    s3c = bucket.client(target)
    for i in range(25):
        s3c.put_object("many", f"{bucket.PREFIX}{i:02d}/x/raw.kvfc", io.BytesIO(b"kv"), 2)
    removed, done = bucket.remove(target, "default/many", budget_seconds=0)
    assert (removed, done) == (0, False) and s3c.bucket_exists("many")
    removed, done = bucket.remove(target, "default/many")
    assert (removed, done) == (25, True) and not s3c.bucket_exists("many")


def test_bucket_removal_refuses_another_pools_bucket(s3: str) -> None:
    target = bucket.Target(s3, "claimed", "testing", "testing")
    bucket.ensure(target, "team-a/pool")
    with pytest.raises(bucket.Claimed):
        bucket.remove(target, "team-b/pool")
    assert bucket.client(target).bucket_exists("claimed")
