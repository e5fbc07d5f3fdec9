"""gpu_kernels: what the codec's Triton kernels share: Triton where it is installed, whether a kernel
can run on a tensor, and the device a kernel launches on.

CPU-only installs have no Triton: ``triton`` and ``tl`` are then None, and each kernel's module
falls back to torch.
"""

from __future__ import annotations

import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def serves(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on ``t``: a CUDA tensor (or any, under Triton's CPU
    interpreter, which the tests use), with Triton present."""
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """The context to launch a kernel on ``t`` in: Triton launches on the current CUDA device."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
