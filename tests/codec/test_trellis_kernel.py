"""The trellis search's kernel (trellis_kernel.py) against the torch search (trellis.py): bit-identical.

On CPU the kernel runs under Triton's interpreter in a subprocess (the interpreter is chosen when
the kernel is defined, so it cannot be switched on in this process); on a GPU it is compiled.
"""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtest import REPO, synthetic_kv
from kvfetcher.codec import basis, layout, trellis, trellis_kernel
from kvfetcher.format import presets

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Values in units of D that hit every branch: Gaussian of several widths, integers and
    half-integers (ties between candidates and between paths), values past the clamp, zeros."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(shape, generator=g) * torch.tensor([0.3, 3.0, 40.0, 200.0])[torch.randint(0, 4, shape, generator=g)]
    kind = torch.randint(0, 5, shape, generator=g)
    v = torch.where(kind == 1, v.round(), v)
    v = torch.where(kind == 2, (2 * v).round() / 2, v)
    v = torch.where(kind == 3, torch.zeros_like(v), v)
    v.view(-1)[:3] = torch.tensor([1e6, -3e7, 255.0])
    return v


def cases(small: bool) -> list[tuple[str, torch.Tensor, int]]:
    """(name, values, dim): odd token counts and component counts (the block mask), strided
    and half-precision inputs, the trellis along the last dim (components side by side)."""
    t = 9 if small else 256
    out = [(f"g3-t{t}-c20", values((3, t, 20), 1), 1),
           ("t1", values((2, 1, 5), 2), 1),
           ("t2-last-dim", values((6, 2), 3), -1),
           ("strided-fp16", values((2, 20, t), 4).clamp(-6e4, 6e4).half().transpose(1, 2), 1)]
    if not small:  # a Llama-3-8B chunk's components, and more than a block of them per program row
        out += [("8b-chunk", values((64, 8, 256, 128), 5), 2), ("c300", values((2, 77, 300), 6), 1)]
    return out


def compare(device: str, small: bool) -> dict[str, int]:
    """Per case, the number of indices where the kernel and the torch search differ."""
    res = {}
    for name, v, dim in cases(small):
        v = v.to(device)
        assert trellis_kernel.enabled(v), "the kernel must serve these values"
        got = trellis.quantise(v, dim)
        want = trellis._search(v.movedim(dim, -1)).movedim(-1, dim)
        assert got.dtype == torch.int16 and got.shape == v.shape
        res[name] = int((got != want).sum())
    # a preset's whole pack, kernel against torch search: the same planes and side information
    kv = synthetic_kv(layers=2, heads=2, tokens=9 if small else 256, head_dim=32, dtype=torch.float16, seed=7)
    packs = [("pack", kv, dataclasses.replace(presets.get("balanced").layout, basis=None, sparse_tokens=0, rope_theta=5e5))]
    if not small:  # the preset itself (basis, sparse corrections) on the model it was calibrated for
        L, _, H, D, _ = basis.load(presets.get("balanced").layout.basis).enc.shape
        packs.append(("pack-balanced", torch.randn(L, 2, H, 256, D, generator=torch.Generator().manual_seed(9)).half(),
                      dataclasses.replace(presets.get("balanced").layout, rope_theta=1e5)))
    for name, kv, p in packs:
        a = layout.pack(kv.to(device), p, 0)
        enabled = trellis_kernel.enabled
        trellis_kernel.enabled = lambda v: False
        try:
            b = layout.pack(kv.to(device), p, 0)
        finally:
            trellis_kernel.enabled = enabled
        res[name] = int((a.frames != b.frames).sum()) + int((a.side.view(torch.int16) != b.side.view(torch.int16)).sum())
    return res


def _interpreter_runs_loops_of_runtime_length() -> bool:
    """Triton 3.6's interpreter (with NumPy 2) fails ``range(T)`` over a kernel argument ``T``."""
    import triton

    return tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 9)


@pytest.mark.slow  # about a minute under the interpreter
@needs_triton
def test_kernel_equals_the_torch_search_under_the_interpreter():
    if not _interpreter_runs_loops_of_runtime_length():
        pytest.skip("this Triton's interpreter cannot loop over a runtime token count")
    code = "import json, test_trellis_kernel as t; print(json.dumps(t.compare('cpu', small=True)))"
    here = str(Path(__file__).parent)  # this module, imported by the subprocess
    path = [here] + [str(REPO / d) for d in ("sidecar", "tests", ".")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res and not any(res.values()), res


def test_cpu_values_take_the_torch_search(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    v = values((2, 9, 3), 8)
    assert not trellis_kernel.enabled(v)
    assert torch.equal(trellis.quantise(v, 1), trellis._search(v.transpose(1, 2)).transpose(1, 2))


@pytest.mark.gpu
@needs_triton
def test_kernel_equals_the_torch_search_on_the_gpu():
    res = compare("cuda", small=False)
    assert not any(res.values()), res
