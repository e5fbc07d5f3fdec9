"""The one piece of storage I/O the operator does: claim the pool's bucket, empty it, and look
for a model's calibration in it.

Through the S3 API (the MinIO SDK), so the same code serves managed MinIO and any external
S3 endpoint. Short timeouts and a single retry: a storage that does not answer should turn
into a StorageReady=False condition within seconds, and the handler retries later anyway.

The operator touches only what is its own, because an external bucket may be shared:
- objects under PREFIX (where the sidecars write) and the claim object CLAIM, which names the
  one pool (`namespace/name`) that uses the bucket: a second pool is refused, a re-created pool
  of the same name finds its retained data;
- its own lifecycle rule, by ID, which it now only removes: an operator before the evictor
  expired chunks by write time, which would delete the chunks fetched most (the evictor's
  `ttlDays` counts from the last fetch);
- the bucket itself only when it carries the OWNER_TAG this pool set when it created it.
Errors are described by their S3 code or type, never by the response body.
"""
from __future__ import annotations

import io
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import urllib3
from minio import Minio
from minio.commonconfig import Tags
from minio.deleteobjects import DeleteObject
from minio.error import InvalidResponseError, MinioAdminException, S3Error, ServerError
from minio.lifecycleconfig import LifecycleConfig

RULE_ID = "kvfetcher-ttl"
PREFIX = "kv/"
#: model calibrations (the sidecar's format/calibration.STORE_PREFIX): outside PREFIX, so no
#: lifecycle rule or clean-up of chunks reaches them, and sidecars may only read them
CALIBRATION_PREFIX = "_meta/calibration/"
CLAIM = "kvfetcher/pool"
OWNER_TAG = "kvfetcher.io/pool"
_OWNER = re.compile(r"^[a-z0-9][-a-z0-9.]*/[a-z0-9][-a-z0-9.]*$")  # namespace/name


class Claimed(Exception):
    """The bucket is claimed by another pool."""


class NotS3(Exception):
    """The endpoint answered, but not as S3 storage does."""


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


def http_client(target: Target) -> urllib3.PoolManager:
    """Short timeouts, one retry, the target's TLS settings (shared by the S3 and MinIO admin clients)."""
    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=3.0, read=15.0),
        retries=urllib3.Retry(total=1, backoff_factor=0.2),
        cert_reqs="CERT_NONE" if target.insecure else "CERT_REQUIRED",
        ca_certs=target.ca_file,
    )


def client(target: Target) -> Minio:
    url = urlsplit(target.endpoint)
    return Minio(url.netloc, access_key=target.access_key, secret_key=target.secret_key, secure=url.scheme == "https",
                 region=target.region, http_client=http_client(target), cert_check=not target.insecure)


def describe(error: Exception) -> str:
    """A storage error in a few words fit for a status or an Event: never the server's response body."""
    if isinstance(error, S3Error):
        return f"S3 error {error.code}"
    if isinstance(error, InvalidResponseError):
        return "the endpoint's answer is not an S3 response"
    if isinstance(error, ServerError):
        return f"S3 server error (HTTP {error.status_code})"
    if isinstance(error, MinioAdminException):  # its message carries the body: only the status
        return f"MinIO admin API error (HTTP {error._code})"
    if isinstance(error, (Claimed, NotS3)):
        return str(error)
    return f"{type(error).__name__} (the endpoint cannot be reached or does not speak S3)"


def holder(s3: Minio, bucket: str) -> str | None:
    """The pool that claimed `bucket`, or None."""
    try:
        response = s3.get_object(bucket, CLAIM)
    except S3Error as e:
        if e.code == "NoSuchKey":
            return None
        raise
    try:
        text = response.read(256).decode(errors="replace")
    finally:
        response.close()
        response.release_conn()
    if not _OWNER.match(text):
        raise NotS3(f"the claim object {CLAIM} of bucket {bucket} does not name a pool: "
                    f"not an S3 endpoint, or the object is not kvfetcher's")
    return text


def _claim(s3: Minio, bucket: str, owner: str) -> None:
    found = holder(s3, bucket)
    if found is None:
        s3.put_object(bucket, CLAIM, io.BytesIO(owner.encode()), len(owner.encode()))
    elif found != owner:
        raise Claimed(f"bucket {bucket} is used by KVCachePool {found}")


def _drop_rule(s3: Minio, bucket: str) -> None:
    """Remove kvfetcher's lifecycle rule, keeping the bucket's others. Also the check that the endpoint
    speaks S3: an answer that does not parse raises."""
    config = s3.get_bucket_lifecycle(bucket)
    rules = config.rules if config else []
    others = [r for r in rules if r.rule_id != RULE_ID]
    if len(others) == len(rules):
        return
    if others:
        s3.set_bucket_lifecycle(bucket, LifecycleConfig(others))
    else:
        s3.delete_bucket_lifecycle(bucket)


def ensure(target: Target, owner: str) -> bool:
    """Create (and tag) the bucket if needed, claim it for `owner`, drop kvfetcher's old lifecycle rule;
    returns whether the bucket was created."""
    s3 = client(target)
    created = False
    if not s3.bucket_exists(target.bucket):
        s3.make_bucket(target.bucket, location=target.region)
        tags = Tags.new_bucket_tags()
        tags[OWNER_TAG] = owner
        s3.set_bucket_tags(target.bucket, tags)
        created = True
    _drop_rule(s3, target.bucket)
    _claim(s3, target.bucket, owner)
    return created


def calibrations(target: Target, tag: str) -> list[str]:
    """The calibration artefacts the store holds for model tag `tag` (`<tag>-<digest>.json`), by name."""
    prefix = f"{CALIBRATION_PREFIX}{tag}/"
    return sorted(o.object_name[len(prefix):] for o in client(target).list_objects(target.bucket, prefix=prefix)
                  if o.object_name.endswith(".json"))


def ttl_days(target: Target) -> int | None:
    """The expiry kvfetcher's lifecycle rule sets, or None (no rule): for checking what `ensure` left behind."""
    config = client(target).get_bucket_lifecycle(target.bucket)
    for rule in (config.rules if config else []):
        if rule.rule_id == RULE_ID and rule.expiration is not None:
            return rule.expiration.days
    return None


def _created_by(s3: Minio, bucket: str, owner: str) -> bool:
    try:
        tags = s3.get_bucket_tags(bucket)
    except S3Error as e:
        if e.code in ("NoSuchTagSet", "NoSuchTagSetError"):
            return False
        raise
    return bool(tags) and tags.get(OWNER_TAG) == owner


def remove(target: Target, owner: str, budget_seconds: float = 20.0) -> tuple[int, bool]:
    """The `Delete` data policy, a step at a time: (objects removed in this call, whether all is done).

    Deletes the objects under PREFIX, streaming (never the whole listing in memory), for up to
    `budget_seconds`; once they are gone, removes the claim (and any lifecycle rule of kvfetcher's), and
    the bucket itself only if this pool created it and nothing else is left in it. Raises
    Claimed, deleting nothing, when another pool holds the bucket.
    """
    s3 = client(target)
    if not s3.bucket_exists(target.bucket):
        return 0, True
    found = holder(s3, target.bucket)
    if found not in (None, owner):
        raise Claimed(f"bucket {target.bucket} is used by KVCachePool {found}; nothing deleted")
    deadline = time.monotonic() + budget_seconds
    removed, finished = 0, True

    def names() -> Iterator[DeleteObject]:
        nonlocal removed, finished
        for obj in s3.list_objects(target.bucket, prefix=PREFIX, recursive=True):
            if time.monotonic() > deadline:
                finished = False
                return
            removed += 1
            yield DeleteObject(obj.object_name)

    errors = list(s3.remove_objects(target.bucket, names()))
    if errors:
        raise RuntimeError(f"could not delete {len(errors)} objects from {target.bucket}: {errors[0].code}")
    if not finished:
        return removed, False
    _drop_rule(s3, target.bucket)
    s3.remove_object(target.bucket, CLAIM)
    if _created_by(s3, target.bucket, owner) and next(iter(s3.list_objects(target.bucket)), None) is None:
        s3.remove_bucket(target.bucket)
    return removed, True
