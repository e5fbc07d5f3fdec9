"""The sidecar's serving check (the pod's readiness probe) against the store's health; a request
naming an unknown preset."""

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


def test_the_store_is_watched_without_a_probe(s3, monkeypatch):
    """kvfetcher_store_up comes from the sidecar's own periodic check: no one need ask /readyz."""
    monkeypatch.setenv("KVFETCHER_STORE_CHECK_S", "0.2")
    with sidecar(s3) as sc:
        assert re.search(r"^kvfetcher_store_up NaN$", raw_request(sc.where["port"], "GET", "/metrics")[1].decode(), re.M)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = raw_request(sc.where["port"], "GET", "/metrics")[1].decode()
            if re.search(r"^kvfetcher_store_up 1\.0$", text, re.M):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("kvfetcher_store_up never went to 1")


def test_a_request_naming_an_unknown_preset_is_refused(tmp_path):
    """A typo'd preset is a 400 naming it, not a miss forever."""
    import json

    from kvtest import TOKEN
    from kvfetcher.store.local import LocalStore

    with sidecar(LocalStore(str(tmp_path))) as sc:
        for path in ("/v1/lookup", "/v1/fetch"):
            body = {"model": "m", "dtype": "float16", "tokens": [1], "options": {"presets": ["balnced", "q8"]}} if path == "/v1/lookup" \
                else {"buffer": "b", "tokens": [1], "options": {"presets": ["balnced"]}}
            status, reply = raw_request(sc.where["port"], "POST", path, json.dumps(body).encode(),
                                        {"Authorization": f"Bearer {TOKEN}"})
            assert status == 400 and "'options': unknown preset(s) ['balnced']" in json.loads(reply)["detail"], reply
