"""Shared fixtures: a real S3 server, stores, shared KV buffers, decode worker processes, an empty calibration directory, the real model and its KV; and the
``gpu`` marker's skip on a machine without CUDA. Plain helpers are in ``kvtest``.

Heavy imports (torch, the data plane) happen inside the fixtures, so that the operator's tests,
which need none of them, do not pay for them.
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped where CUDA is not available (CI); they run on a GPU machine."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA (runs on the GPU machine)")
        for item in gpu:
            item.add_marker(skip)


def pytest_configure(config):
    """Tests see only the shipped calibrations and those they make: the local calibration directory
    is a fresh one per session, not the user's."""
    import os
    import tempfile

    os.environ["KVFETCHER_CALIBRATION_DIR"] = tempfile.mkdtemp(prefix="kvf-calibration-")


def pytest_sessionfinish(session, exitstatus):
    """Collect garbage before pytest prints its summary, so that any late finaliser message
    (e.g. an aiohttp "Unclosed client session" from a library) lands above the closing line
    that CI reads, not after it."""
    import gc

    gc.collect()


# --- object storage -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 server (moto) on loopback for the whole session: its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint):
    """An S3Store on a fresh bucket of the session's S3 server."""
    from kvtest import new_bucket

    return new_bucket(s3_endpoint)


@pytest.fixture(params=["local", "s3"])
def store(request):
    """Each store backend in turn, empty: a test using it holds for both."""
    from kvtest import open_store

    return open_store(request.param, request)


@pytest.fixture
def slow_proxy(s3_endpoint):
    """A factory of rate-limited HTTP proxies in front of the S3 server (kvtest.SlowProxy)."""
    from kvtest import SlowProxy

    proxies = []

    def make(bytes_per_s=float("inf")):
        p = SlowProxy(s3_endpoint, bytes_per_s)
        proxies.append(p)
        return p

    yield make
    for p in proxies:
        p.close()


# --- KV buffers -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers():
    """Two started decode worker processes, for one test module."""
    from kvfetcher.fetch.workers import DecodeWorkers

    w = DecodeWorkers(2)
    w.start()
    yield w
    w.close()


@pytest.fixture
def shm():
    """A factory of shared KV buffers as a model allocates them (``ipc.allocate``: a sealed memfd on the
    CPU, CUDA IPC with ``device="cuda"``), optionally filled with ``fill`` (a value, or a tensor to
    copy); all closed after the test."""
    from kvfetcher import ipc

    made = []

    def allocate(shape, dtype=None, device="cpu", fill=None):
        import torch

        b = ipc.allocate(tuple(shape), dtype or torch.float16, device)
        if isinstance(fill, torch.Tensor):
            b.tensor.copy_(fill)
        elif fill is not None:
            b.tensor.fill_(fill)
        made.append(b)
        return b

    yield allocate
    for b in made:
        b.close()


@pytest.fixture
def local(tmp_path, monkeypatch):
    """An empty local calibration directory (``KVFETCHER_CALIBRATION_DIR``), with the caches of what
    was read from the calibration directories cleared before and after."""
    from kvfetcher.codec import basis
    from kvfetcher.format import presets

    d = tmp_path / "calibration"
    monkeypatch.setenv("KVFETCHER_CALIBRATION_DIR", str(d))
    presets.for_model.cache_clear()
    basis.load.cache_clear()
    yield d
    presets.for_model.cache_clear()
    basis.load.cache_clear()


# --- the real model -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def lm():
    """The shipped small model (SmolLM2), loaded once per session."""
    from kvfetcher.eval import model

    return model.load()


@pytest.fixture(scope="session")
def prompt(lm):
    """A short real prompt, its model KV (fp16, as a server's cache holds it) and the reference
    continuation generated from a plain full prefill."""
    import torch

    from kvfetcher.eval import model
    from kvtest import NEW, PROMPT_TOKENS

    ids = model.tokenize(lm, model.sample_text("license.txt"), PROMPT_TOKENS)
    kv, _ = model.prefill(lm, ids)
    reference = model.greedy(lm, ids, kv, NEW)
    return ids, kv.to(torch.float16), reference
