"""fused_pack: the pack's front as one kernel against the torch path (codec/layout.py).

The two sum in other orders, so values and statistics agree to float32's rounding, not bit for
bit; packed chunks then restore as closely as the torch path's. On CPU the kernel runs under
Triton's interpreter in a subprocess (chosen when the kernel is defined); on a GPU it is compiled.
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
from kvfetcher.codec import fused_pack, layout
from kvfetcher.codec.params import LayoutParams

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def _basis(layers: int, heads: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(layers * 2 * heads, d, d, generator=g, dtype=torch.float64))
    return q.float().reshape(layers, 2, heads, d, d), torch.randn(layers, 2, heads, d, generator=g)


def cases() -> list[tuple[str, torch.Tensor, int, bool, bool]]:
    """(name, KV, b0, RoPE, basis): a token count off the kernel's blocks, a sink token, a strided
    half-precision view, every step alone and together."""
    kv = synthetic_kv(3, 2, 37, 64, torch.float16, seed=1)
    wide = synthetic_kv(2, 2, 96, 64, torch.float32, seed=2)
    strided = synthetic_kv(2, 2, 64, 32, torch.bfloat16, seed=3).transpose(3, 4).contiguous().transpose(3, 4)
    return [("plain", kv, 0, False, False), ("rope-sink", kv, 1, True, False), ("basis", kv, 0, False, True),
            ("rope-basis-sink", wide, 1, True, True), ("strided-bf16", strided, 0, True, True)]


def _torch_front(kv, b0, rope_cs, basis):
    x = kv.to(torch.float32, copy=True)
    if rope_cs is not None:
        cos, sin = rope_cs
        half = x.shape[-1] // 2
        k = x[:, 0]
        x[:, 0] = k * cos - torch.cat([-k[..., half:], k[..., :half]], dim=-1) * sin
    if basis is not None:
        enc, mean = basis
        x = torch.einsum("lkhde,lkhte->lkhtd", enc, x) - mean.unsqueeze(3)
    body = x[:, :, :, b0:]
    var, mu = torch.var_mean(body, dim=3, correction=0)
    low, high = torch.aminmax(body, dim=3)
    return x, (mu, var, low, high)


def compare(device: str) -> dict[str, float]:
    """Per case, the largest difference between the kernel's and torch's results, relative to their scale."""
    from kvfetcher.codec import rope

    res = {}
    for name, kv, b0, use_rope, use_basis in cases():
        L, _, H, T, D = kv.shape
        kv = kv.to(device)
        rope_cs = rope.rotation(5, T, D, 10000.0, device) if use_rope else None
        basis = tuple(t.to(device) for t in _basis(L, H, D, 4)) if use_basis else None
        assert fused_pack.enabled(kv)
        got = fused_pack.project(kv, b0, rope_cs, basis)
        want = _torch_front(kv, b0, rope_cs, basis)
        worst = 0.0
        for g, w in zip((got[0], *got[1]), (want[0], *want[1])):
            worst = max(worst, float((g - w).abs().max() / w.abs().max().clamp(min=1e-6)))
        res[name] = worst
    return res


def _interpreted(code: str) -> str:
    here = str(Path(__file__).parent)
    path = [here] + [str(REPO / d) for d in ("sidecar", "tests", ".")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


@needs_triton
def test_the_interpreted_kernel_projects_as_torch_does():
    res = json.loads(_interpreted("import json, test_fused_pack as t; print(json.dumps(t.compare('cpu')))"))
    assert len(res) == len(cases())
    for name, worst in res.items():
        assert worst < 1e-5, f"{name}: {worst}"


@pytest.mark.gpu
@needs_triton
def test_the_compiled_kernel_projects_as_torch_does():
    for name, worst in compare("cuda").items():
        assert worst < 1e-5, f"{name}: {worst}"


def restore_errors(device: str) -> dict[str, list[float]]:
    """RMS error of a chunk packed and unpacked, the pack's front by the kernel and by torch, per layout."""
    kv = synthetic_kv(4, 2, 64, 64, torch.float16, seed=7).to(device)
    L, _, H, T, D = kv.shape
    base = LayoutParams(mode="quant", bits=8, sigma_steps=((0.35, 0.35),), exact_tokens=1)
    layouts = {"sigma": base, "trellis-sorted": dataclasses.replace(base, trellis=True, sort_components=True, rope_theta=10000.0),
               "ranges": LayoutParams(mode="quant", bits=6)}
    res = {}
    for name, lp in layouts.items():
        errs = []
        for fused in (True, False):
            enabled = fused_pack.enabled
            fused_pack.enabled = enabled if fused else (lambda v: False)
            try:
                p = layout.pack(kv, lp, 3)
            finally:
                fused_pack.enabled = enabled
            back = layout.unpack(p.frames, p.side, tuple(kv.shape), kv.dtype, lp, start=3)
            errs.append(float((back.float() - kv.float()).square().mean().sqrt()))
        res[name] = errs
    return res


@pytest.mark.slow  # the trellis search under the interpreter
@needs_triton
def test_chunks_packed_by_the_kernel_restore_as_closely_as_the_torch_paths():
    res = json.loads(_interpreted("import json, test_fused_pack as t; print(json.dumps(t.restore_errors('cpu')))"))
    for name, (fused, plain) in res.items():
        assert fused <= plain * 1.01 + 1e-6, f"{name}: {fused} against {plain}"


def test_the_kernel_serves_shapes_it_can_and_a_body_with_tokens(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fused_pack.enabled(torch.zeros(1))
    assert fused_pack.supports(128, 256) and fused_pack.supports(32, 1)
    assert not fused_pack.supports(48, 256) and not fused_pack.supports(16, 256) and not fused_pack.supports(64, 0)
    if fused_pack.triton is not None:
        with pytest.raises(ValueError, match="body"):
            fused_pack.project(torch.zeros(1, 2, 1, 4, 32), 4)


@pytest.mark.gpu
@needs_triton
def test_chunks_packed_by_the_compiled_kernel_restore_as_closely_as_the_torch_paths():
    for name, (fused, plain) in restore_errors("cuda").items():
        assert fused <= plain * 1.01 + 1e-6, f"{name}: {fused} against {plain}"
