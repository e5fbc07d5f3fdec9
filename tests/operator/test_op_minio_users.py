"""Managed MinIO's sidecars get their own MinIO user, limited to the pool's bucket
and prefix; MinIO's root credentials stay with MinIO and the operator.

No MinIO server runs here. The admin flow is checked on the wire instead: a loopback HTTP server
records the requests the MinIO SDK really sends, and the test verifies each one as MinIO would
(AWS SigV4 by the root credentials, recomputed with botocore; the user's secret decrypted with
the root password, in the admin API's encryption format).
"""
from __future__ import annotations

import http.server
import io
import json
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pytest
import urllib3
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from minio.crypto import decrypt
from test_op_builders import MANAGED, pool

from kvfetcher_operator import bucket, builders, injection, minio, users


def env_refs(env: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    return {e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for e in env if "secretKeyRef" in e.get("valueFrom", {})}


def test_sidecars_never_get_the_minio_root_credentials() -> None:
    p = pool(MANAGED)
    root = builders.root_values(None, None)
    values = builders.secret_values(p, None, root_user=root["rootUser"])
    assert values["accessKey"] != root["rootUser"] and values["secretKey"] != root["rootPassword"]
    minio_env = env_refs(minio.statefulset(p)["spec"]["template"]["spec"]["containers"][0]["env"])
    assert minio_env["MINIO_ROOT_USER"] == ("cache-minio-root", "rootUser")
    assert minio_env["MINIO_ROOT_PASSWORD"] == ("cache-minio-root", "rootPassword")
    sidecar_env = env_refs(injection.sidecar_container(p, None)["env"])
    assert sidecar_env["KVFETCHER_S3_ACCESS_KEY"] == ("cache-kvfetcher", "accessKey")
    assert sidecar_env["KVFETCHER_S3_SECRET_KEY"] == ("cache-kvfetcher", "secretKey")
    assert "cache-minio-root" not in {name for name, _ in sidecar_env.values()}
    root_secret = builders.secret(p, root, builders.root_secret_name("cache"))
    assert root_secret["metadata"]["name"] == "cache-minio-root"
    assert root_secret["metadata"]["ownerReferences"] == [builders.owner_reference(p)]


def test_a_pool_secret_holding_the_root_gives_it_to_the_root_secret() -> None:
    """A pool made before the sidecar user kept MinIO's root in its own Secret: MinIO keeps that root."""
    p = pool(MANAGED)
    legacy = {"accessKey": "kvfroot", "secretKey": "rootpw", "authToken": "t", "tenantSalt": "s"}
    root = builders.root_values(None, legacy)
    assert root == {"rootUser": "kvfroot", "rootPassword": "rootpw"}
    values = builders.secret_values(p, legacy, root_user=root["rootUser"])
    assert values["accessKey"] != "kvfroot" and values["secretKey"] != "rootpw"
    assert values["tenantSalt"] == "s" and values["authToken"] == "t"  # the salt never changes
    assert builders.root_values(root, values) == root  # once split, both stay
    assert builders.secret_values(p, values, root_user=root["rootUser"]) == values


def test_sidecar_policy_is_limited_to_the_pools_bucket_and_prefix() -> None:
    policy = users.sidecar_policy("kvcache")
    granted = {(action, resource) for s in policy["Statement"] if s["Effect"] == "Allow"
               for action in s["Action"] for resource in s["Resource"]}
    assert granted == {
        ("s3:GetBucketLocation", "arn:aws:s3:::kvcache"), ("s3:ListBucket", "arn:aws:s3:::kvcache"),
        ("s3:GetObject", "arn:aws:s3:::kvcache/kv/*"), ("s3:PutObject", "arn:aws:s3:::kvcache/kv/*"),
        ("s3:DeleteObject", "arn:aws:s3:::kvcache/kv/*"), ("s3:GetObject", "arn:aws:s3:::kvcache/_meta/calibration/*")}
    assert bucket.PREFIX == "kv/" and not bucket.CLAIM.startswith(bucket.PREFIX)  # the claim is out of reach


def test_sidecars_read_model_calibrations_where_the_data_plane_publishes_them() -> None:
    from kvfetcher.format import calibration

    assert bucket.CALIBRATION_PREFIX == calibration.STORE_PREFIX and not calibration.STORE_PREFIX.startswith(bucket.PREFIX)


class _Recorder(http.server.BaseHTTPRequestHandler):
    requests: list[dict[str, Any]]

    def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.requests.append({"method": "PUT", "path": self.path, "headers": dict(self.headers), "body": body})
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def admin_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    recorded: list[dict[str, Any]] = []
    handler = type("Recorder", (_Recorder,), {"requests": recorded})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", recorded
    server.shutdown()
    server.server_close()


def signed_by(request: dict[str, Any], endpoint: str, access_key: str, secret_key: str) -> bool:
    """Whether `request` carries a valid AWS SigV4 signature by these credentials (as MinIO checks it)."""
    headers = {k.lower(): v for k, v in request["headers"].items()}
    fields = dict(part.strip().split("=", 1) for part in headers["authorization"].split(" ", 1)[1].split(","))
    user, date, region, service, _ = fields["Credential"].split("/")
    signed = fields["SignedHeaders"].split(";")
    aws = AWSRequest(method=request["method"], url=endpoint + request["path"], data=request["body"],
                     headers={h: headers[h] for h in signed})
    aws.context["timestamp"] = headers["x-amz-date"]
    auth = SigV4Auth(Credentials(access_key, secret_key), service, region)
    expected = auth.signature(auth.string_to_sign(aws, auth.canonical_request(aws)), aws)
    return user == access_key and date == headers["x-amz-date"][:8] and expected == fields["Signature"]


def test_admin_flow_makes_the_user_as_root(admin_server: tuple[str, list[dict[str, Any]]]) -> None:
    endpoint, recorded = admin_server
    root = bucket.Target(endpoint, "kvcache", "kvfroot", "root-password-0123456789")
    users.ensure_user(root, "kvfsidecar", "sidecar-secret-0123456789", users.POLICY, users.sidecar_policy("kvcache"))

    assert [(urlsplit(r["path"]).path, dict(parse_qsl(urlsplit(r["path"]).query))) for r in recorded] == [
        ("/minio/admin/v3/add-user", {"accessKey": "kvfsidecar"}),
        ("/minio/admin/v3/add-canned-policy", {"name": users.POLICY}),
        ("/minio/admin/v3/set-user-or-group-policy",
         {"policyName": users.POLICY, "userOrGroup": "kvfsidecar", "isGroup": "false"}),
    ]
    for request in recorded:
        assert signed_by(request, endpoint, "kvfroot", "root-password-0123456789"), request["headers"]
        assert not signed_by(request, endpoint, "kvfsidecar", "sidecar-secret-0123456789")

    def opened(body: bytes, password: str) -> dict[str, Any]:
        return json.loads(decrypt(urllib3.HTTPResponse(body=io.BytesIO(body), preload_content=False), password))

    assert opened(recorded[0]["body"], "root-password-0123456789") == {
        "status": "enabled", "secretKey": "sidecar-secret-0123456789"}
    with pytest.raises(Exception):  # encrypted for MinIO's root only
        opened(recorded[0]["body"], "sidecar-secret-0123456789")
    assert json.loads(recorded[1]["body"]) == users.sidecar_policy("kvcache")


def test_admin_errors_are_reported_without_the_body() -> None:
    from minio.error import MinioAdminException

    text = bucket.describe(MinioAdminException("403", "<Error>secret internals</Error>"))
    assert text == "MinIO admin API error (HTTP 403)"
