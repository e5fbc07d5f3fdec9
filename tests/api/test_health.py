"""The sidecar's serving check (the pod's readiness probe) against the store's health."""

from __future__ import annotations

import os
import re
import time

from kvtest import raw_request, sidecar, unreachable_s3


def test_serving_follows_the_socket_not_the_store(tmp_path):
    with sidecar(unreachable_s3(), socket_path=str(tmp_path / "kvfetcher.sock")) as sc:
        port = sc.where["port"]
        assert raw_request(port, "GET", "/servingz") == (200, b"serving\n")
        assert raw_request(port, "GET", "/readyz")[0] == 503
        os.unlink(sc.socket)  # the model can no longer reach the sidecar: not ready
        assert raw_request(port, "GET", "/servingz")[0] == 503


def test_the_store_is_watched_without_a_probe(s3):
    """kvfetcher_store_up comes from the sidecar's own periodic check: no one need ask /readyz."""
    with sidecar(s3) as sc:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = raw_request(sc.where["port"], "GET", "/metrics")[1].decode()
            if re.search(r"^kvfetcher_store_up 1\.0$", text, re.M):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("kvfetcher_store_up never went to 1")
