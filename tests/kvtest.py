"""Test helpers shared by the test modules (import as ``from kvtest import ...``)."""

import socket

import pytest
import torch

from benchmarks.lib.kvsource import synthetic_kv  # noqa: F401  (shared with the benchmarks)


def free_port() -> int:
    """A loopback port nothing listens on (the OS's pick, released at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")
