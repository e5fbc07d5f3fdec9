"""`kvfetcher serve` as the operator runs it: configured only by the environment it injects."""

import os
import signal
import subprocess
import sys
import time

import torch

from kvfetcher import ipc
from kvfetcher.api.client import KVClient

from kvtest import free_port, new_bucket, raw_request


def test_serve_from_the_operators_environment(s3_endpoint, tmp_path):
    bucket = new_bucket(s3_endpoint)
    port, sock = free_port(), str(tmp_path / "run" / "kvfetcher.sock")
    env = dict(
        os.environ,
        KVFETCHER_S3_ENDPOINT=s3_endpoint,
        KVFETCHER_S3_BUCKET=bucket.bucket,
        KVFETCHER_S3_ACCESS_KEY="testing",
        KVFETCHER_S3_SECRET_KEY="testing",
        KVFETCHER_AUTH_TOKEN="s3cret",
        KVFETCHER_POOL="pool-a",
        KVFETCHER_PRESET="raw",
        KVFETCHER_CHUNK_TOKENS="32",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfetcher.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--socket", sock],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if raw_request(port, "GET", "/readyz")[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        else:
            raise AssertionError("sidecar never became ready")
        assert raw_request(port, "POST", "/v1/lookup", b"{}")[0] == 401  # the token is required on TCP
        buf = ipc.allocate((2, 2, 1, 64, 8), torch.float16)
        try:
            buf.tensor.normal_()
            c = KVClient(socket_path=sock, token="")
            bid = c.register(buf.handle, "m")
            assert c.store(bid, list(range(64))).queued_chunks == 2  # KVFETCHER_CHUNK_TOKENS=32
            c.flush()
            assert sorted(n.rsplit("/", 1)[1] for n in bucket.list("kv/")) == ["raw.kvfc", "raw.kvfc"]  # KVFETCHER_PRESET
            t = KVClient(f"http://127.0.0.1:{port}", token="s3cret")
            assert t.hit_tokens(None, list(range(64)), model="m", dtype="float16") == 64
            assert c.store(bid, list(range(100, 164))).queued_chunks == 2  # queued, then SIGTERM at once
        finally:
            buf.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out
    assert len(bucket.list("kv/")) == 4  # the queued store was drained before exiting
