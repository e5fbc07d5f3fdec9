"""Test helpers shared by the test modules (import as ``from kvtest import ...``)."""

import pytest
import torch

from benchmarks.lib.kvsource import synthetic_kv  # noqa: F401  (shared with the benchmarks)
from benchmarks.lib.linkserver import free_port  # noqa: F401


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")
