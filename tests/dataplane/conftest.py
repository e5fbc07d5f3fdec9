"""Data-plane fixtures: a real S3 server on loopback, a rate-limited HTTP proxy in front of it,
and the real model's KV for a short prompt (one model per session). Helpers are in dptest."""

from __future__ import annotations

import pytest
import torch

from kvfetcher.eval import model
from kvfetcher.store.s3 import S3Store

from dptest import NEW, PROMPT_TOKENS, SlowProxy, new_bucket


@pytest.fixture(scope="session")
def s3_endpoint():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint) -> S3Store:
    return new_bucket(s3_endpoint)


@pytest.fixture
def slow_proxy(s3_endpoint):
    proxies = []

    def make(bytes_per_s=float("inf")):
        p = SlowProxy(s3_endpoint, bytes_per_s)
        proxies.append(p)
        return p

    yield make
    for p in proxies:
        p.close()


@pytest.fixture(scope="session")
def prompt(lm):
    """A short real prompt, its model KV (fp16, as a server's cache holds it) and the reference
    continuation generated from a plain full prefill."""
    ids = model.tokenize(lm, model.sample_text("license.txt"), PROMPT_TOKENS)
    kv, _ = model.prefill(lm, ids)
    reference = model.greedy(lm, ids, kv, NEW)
    return ids, kv.to(torch.float16), reference
