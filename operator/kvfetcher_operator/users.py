"""Managed MinIO's sidecar user: a pool's sidecars never hold MinIO's root credentials.

The operator, as root, keeps one MinIO user per pool (the `accessKey`/`secretKey` of the
pool's Secret) with one policy: list the pool's bucket, and read, write and delete objects under
the sidecars' prefix in it. Nothing else: no other bucket, no object outside the prefix (the
bucket's claim object included), no lifecycle, tags or bucket deletion, no admin API.

Every call is idempotent, so each reconcile repeats them: adding an existing user sets its
secret, adding a policy replaces it, setting a user's policy replaces the user's policies.
"""
from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from minio import MinioAdmin
from minio.credentials import StaticProvider

from . import bucket

POLICY = "kvfetcher-sidecar"


def sidecar_policy(bucket_name: str, prefix: str = bucket.PREFIX) -> dict[str, Any]:
    """The IAM policy of the sidecar user: the bucket listed, objects under `prefix` read, written, deleted;
    model calibrations (`bucket.CALIBRATION_PREFIX`, published by `kvfetcher calibrate`) read only."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            # HeadBucket and ListObjects are both s3:ListBucket to MinIO; the sidecar calls both.
            {"Effect": "Allow", "Action": ["s3:GetBucketLocation", "s3:ListBucket"],
             "Resource": [f"arn:aws:s3:::{bucket_name}"]},
            {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
             "Resource": [f"arn:aws:s3:::{bucket_name}/{prefix}*"]},
            {"Effect": "Allow", "Action": ["s3:GetObject"],
             "Resource": [f"arn:aws:s3:::{bucket_name}/{bucket.CALIBRATION_PREFIX}*"]},
        ],
    }


def ensure_sidecar_user(root: bucket.Target, access_key: str, secret_key: str) -> None:
    """Make (or bring back) the sidecar user `access_key` on the MinIO at `root.endpoint`, reached as root."""
    url = urlsplit(root.endpoint)
    admin = MinioAdmin(endpoint=url.netloc, credentials=StaticProvider(root.access_key, root.secret_key),
                       region=root.region or "", secure=url.scheme == "https", cert_check=not root.insecure,
                       http_client=bucket.http_client(root))
    admin.user_add(access_key, secret_key)
    admin.policy_add(POLICY, policy=sidecar_policy(root.bucket))
    admin.policy_set(POLICY, user=access_key)
