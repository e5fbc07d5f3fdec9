"""Test helpers shared by the test modules (import as ``from kvtest import ...``)."""

import socket

import pytest
import torch


def synthetic_kv(layers=4, heads=2, tokens=100, head_dim=64, dtype=torch.float16, seed=0) -> torch.Tensor:
    """Per-channel offsets and scales, smooth along tokens plus noise: like RoPE'd keys."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(layers, 2, heads, 1, head_dim, generator=g) * 3
    scale = torch.rand(layers, 2, heads, 1, head_dim, generator=g) + 0.2
    t = torch.arange(tokens).view(1, 1, 1, tokens, 1).float()
    freq = torch.rand(1, 1, 1, 1, head_dim, generator=g) * 0.3
    kv = base + scale * (torch.sin(t * freq) + 0.3 * torch.randn(layers, 2, heads, tokens, head_dim, generator=g))
    return kv.to(dtype)


def free_port() -> int:
    """A loopback port nothing listens on (the OS's pick, released at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)")
