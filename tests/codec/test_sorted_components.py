"""The ``sort_components`` layout (the ``transform-*`` presets): the same KV as ``balanced``'s
layout, planes in another order, and a clear error for a layout that cannot rank components."""

import dataclasses

import pytest
import torch

from kvfetcher.codec import layout
from kvfetcher.codec.params import LayoutParams
from kvfetcher.format import presets


def _kv(seed: int = 0, tokens: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # components of very different spreads, as in a real basis
    scale = torch.logspace(-2, 1, 64).view(1, 1, 1, 1, 64)
    return (torch.randn(30, 2, 3, tokens, 64, generator=g) * scale).half()


@pytest.mark.parametrize("start", [0, 256])
def test_same_kv_as_balanced(start):
    kv = _kv()
    t = dataclasses.replace(presets.get("transform-zstd").layout, rope_theta=100000.0)
    b = dataclasses.replace(presets.get("balanced").layout, rope_theta=100000.0)
    if start:
        t, b = (dataclasses.replace(x, exact_tokens=0) for x in (t, b))
    pt, pb = layout.pack(kv, t, start), layout.pack(kv, b, start)
    assert not torch.equal(pt.frames, pb.frames)  # another order ...
    assert torch.equal(pt.frames.view(-1).sort().values, pb.frames.view(-1).sort().values)  # ... of the same samples
    assert pt.side.numel() == layout.side_numel(kv.shape, t, kv.dtype)
    rt = layout.unpack(pt.frames, pt.side, kv.shape, kv.dtype, t, start=start)
    rb = layout.unpack(pb.frames, pb.side, kv.shape, kv.dtype, b, start=start)
    assert torch.equal(rt, rb)


def test_rows_sorted_by_class():
    kv = _kv(1)
    t = dataclasses.replace(presets.get("transform-zstd").layout, rope_theta=100000.0)
    p = layout.pack(kv, t)
    classes = layout.split_order(p.side, kv.shape, t)
    assert classes.numel() == 30 * 2 * 3 * 64 and classes.dtype == torch.uint8
    ordered = classes[layout.component_order(classes)]
    assert torch.all(ordered[1:] >= ordered[:-1]) and ordered[-1] > ordered[0]


def test_needs_steps():
    with pytest.raises(ValueError, match="sort_components needs sigma_steps"):
        LayoutParams(mode="quant", bits=8, sort_components=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_same_kv_as_balanced():
    """Packed on the GPU, restored on the GPU (the fused unpack) and on the CPU: balanced's KV each time."""
    kv = _kv(2, 256).cuda()
    t = dataclasses.replace(presets.get("transform-zstd").layout, rope_theta=100000.0)
    b = dataclasses.replace(presets.get("balanced").layout, rope_theta=100000.0)
    pt, pb = layout.pack(kv, t), layout.pack(kv, b)
    for dev in ("cuda", "cpu"):
        rt = layout.unpack(pt.frames.to(dev), pt.side.to(dev), kv.shape, kv.dtype, t)
        assert torch.equal(rt, layout.unpack(pb.frames.to(dev), pb.side.to(dev), kv.shape, kv.dtype, b))
