"""Managed MinIO's sidecar user: a pool's sidecars never hold MinIO's root credentials.

The operator, as root, keeps one MinIO user per pool (the `accessKey`/`secretKey` of the
pool's Secret) with one policy: list the pool's bucket, and read, write and delete objects under
the sidecars' prefix in it. Nothing else: no other bucket, no object outside the prefix (the
bucket's claim object included), no lifecycle, tags or bucket deletion, no admin API. The
calibration Job's user (`calibratorAccessKey`/`calibratorSecretKey`) may list the bucket and read
and write calibrations, and nothing else; the sidecars only read those.

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
CALIBRATOR_POLICY = "kvfetcher-calibrator"


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


def calibrator_policy(bucket_name: str) -> dict[str, Any]:
    """The IAM policy of the calibration Job's user: the bucket listed, calibrations read and written; nothing else."""
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": ["s3:GetBucketLocation", "s3:ListBucket"],
             "Resource": [f"arn:aws:s3:::{bucket_name}"]},
            {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject"],
             "Resource": [f"arn:aws:s3:::{bucket_name}/{bucket.CALIBRATION_PREFIX}*"]},
        ],
    }


def ensure_user(root: bucket.Target, access_key: str, secret_key: str, policy_name: str,
                policy: dict[str, Any]) -> None:
    """Make (or bring back) the user `access_key` with `policy` on the MinIO at `root.endpoint`, reached as root."""
    url = urlsplit(root.endpoint)
    admin = MinioAdmin(endpoint=url.netloc, credentials=StaticProvider(root.access_key, root.secret_key),
                       region=root.region or "", secure=url.scheme == "https", cert_check=not root.insecure,
                       http_client=bucket.http_client(root))
    admin.user_add(access_key, secret_key)
    admin.policy_add(policy_name, policy=policy)
    admin.policy_set(policy_name, user=access_key)
