"""The one piece of storage I/O the operator does: make the pool's bucket and its expiry rule.

Through the S3 API (the MinIO SDK), so the same code serves managed MinIO and any external
S3 endpoint. Short timeouts and a single retry: a storage that does not answer should turn
into a StorageReady=False condition within seconds, and the handler retries later anyway.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

import urllib3
from minio import Minio
from minio.commonconfig import ENABLED, Filter
from minio.deleteobjects import DeleteObject
from minio.lifecycleconfig import Expiration, LifecycleConfig, Rule

RULE_ID = "kvfetcher-ttl"


@dataclass(frozen=True)
class Target:
    """Where a pool's bucket lives and how to reach it."""
    endpoint: str
    bucket: str
    access_key: str
    secret_key: str
    region: str | None = None
    ca_file: str | None = None
    insecure: bool = False


def client(target: Target) -> Minio:
    url = urlsplit(target.endpoint)
    secure = url.scheme == "https"
    http = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=3.0, read=15.0),
        retries=urllib3.Retry(total=1, backoff_factor=0.2),
        cert_reqs="CERT_NONE" if target.insecure else "CERT_REQUIRED",
        ca_certs=target.ca_file,
    )
    return Minio(url.netloc, access_key=target.access_key, secret_key=target.secret_key,
                 secure=secure, region=target.region, http_client=http, cert_check=not target.insecure)


def ensure(target: Target, ttl_days: int) -> bool:
    """Create the bucket if needed and set its TTL rule; returns whether the bucket was created."""
    s3 = client(target)
    created = False
    if not s3.bucket_exists(target.bucket):
        s3.make_bucket(target.bucket, location=target.region)
        created = True
    rule = Rule(ENABLED, rule_filter=Filter(prefix=""), rule_id=RULE_ID, expiration=Expiration(days=ttl_days))
    s3.set_bucket_lifecycle(target.bucket, LifecycleConfig([rule]))
    return created


def ttl_days(target: Target) -> int | None:
    """The expiry the bucket's kvfetcher rule sets, or None: for checking what `ensure` left behind."""
    config = client(target).get_bucket_lifecycle(target.bucket)
    for rule in (config.rules if config else []):
        if rule.rule_id == RULE_ID and rule.expiration is not None:
            return rule.expiration.days
    return None


def remove(target: Target) -> int:
    """Delete every object and then the bucket (the `Delete` data policy); returns the objects removed."""
    s3 = client(target)
    if not s3.bucket_exists(target.bucket):
        return 0
    names = [DeleteObject(o.object_name) for o in s3.list_objects(target.bucket, recursive=True)]
    errors = list(s3.remove_objects(target.bucket, names))
    if errors:
        raise RuntimeError(f"could not delete {len(errors)} objects from {target.bucket}: {errors[0]}")
    s3.remove_bucket(target.bucket)
    return len(names)
