"""Hybrid attention in the layout: per-layer RoPE bases (recorded in the header), head_dim 256 with
one KV head, and chunks of every layer restored exactly with ``exact``."""

import dataclasses

import pytest
import torch

from kvfetcher.chunk import decode_chunk, encode_chunk
from kvfetcher.codec import layout, rope
from kvfetcher.codec.params import LayoutParams
from kvfetcher.format import container

#: Gemma 3's pattern: five sliding-window layers at base 10 000, then a full one at 1 000 000
THETAS = tuple(1e6 if (i + 1) % 6 == 0 else 1e4 for i in range(6))
SHAPE = (6, 2, 1, 32, 256)  # one KV head of 256 channels


def steady_keys(thetas, start: int, shape=SHAPE, seed: int = 0) -> torch.Tensor:
    """A chunk whose keys are one constant vector per layer before RoPE, rotated with each layer's
    own base; values random. Keys quantised in the right pre-RoPE frame are constant per channel."""
    g = torch.Generator().manual_seed(seed)
    L, _, H, T, D = shape
    kv = torch.randn(shape, generator=g)
    k0 = (torch.randn(L, H, 1, D, generator=g) * 4).expand(L, H, T, D)
    kv[:, 0] = rope.apply_layers(k0.contiguous(), start, thetas)
    return kv.half()


def test_per_layer_bases_rotate_each_layer_with_its_own():
    x = torch.randn(6, 1, 8, 256)
    r = rope.apply_layers(x, 100, THETAS)
    for i, t in enumerate(THETAS):
        cos, sin = rope.rotation(100, 8, 256, t)
        assert torch.allclose(r[i], rope.apply(x[i], cos, sin))
    assert torch.allclose(rope.apply_layers(r, 100, THETAS, inverse=True), x, atol=1e-5)
    assert rope.compact([1e4] * 3) == 1e4 and rope.compact(THETAS) == THETAS
    with pytest.raises(ValueError, match="6 RoPE bases for 5 layers"):
        rope.per_layer(THETAS, 5)


@pytest.mark.parametrize("thetas", [THETAS, 5e5])
def test_keys_rotated_in_place_equal_a_new_rotation(thetas):
    x = torch.randn(6, 2, 8, 64)
    want = rope.apply_layers(x, 37, thetas, inverse=True)
    y = x.clone()
    assert rope.apply_layers(y, 37, thetas, inverse=True, out=y) is y
    assert torch.equal(y, want) and not torch.equal(y, x)


def test_keys_are_quantised_before_rope_with_each_layers_base():
    start = 512
    kv = steady_keys(THETAS, start)
    lp = LayoutParams(mode="quant", sigma_steps=((0.5, 0.5),), rope_theta=THETAS, exact_tokens=0)
    pk = layout.pack(kv, lp, start)
    back = layout.unpack(pk.frames, pk.side, SHAPE, kv.dtype, lp, start=start)
    right = (back[:, 0].float() - kv[:, 0].float()).abs().max()
    wrong = dataclasses.replace(lp, rope_theta=1e4)  # one base for all: the full layers' keys swing
    pk = layout.pack(kv, wrong, start)
    back_w = layout.unpack(pk.frames, pk.side, SHAPE, kv.dtype, wrong, start=start)
    err_w = (back_w[5, 0].float() - kv[5, 0].float()).abs().max()
    assert right < 0.05 < err_w


def test_the_header_carries_per_layer_bases_and_a_single_base_stays_one_number():
    kv = steady_keys(THETAS, 0)
    h = container.parse_header(encode_chunk(kv, "lean", "gemma-like/fp16", rope_theta=THETAS))
    assert h.layout.rope_theta == THETAS and list(h.to_json()["layout"]["rope_theta"]) == list(THETAS)
    h1 = container.parse_header(encode_chunk(kv, "lean", "gemma-like/fp16", rope_theta=[1e4] * 6))
    assert h1.layout.rope_theta == 1e4  # objects of single-base models read as before
    back = decode_chunk(encode_chunk(kv, "lean", "gemma-like/fp16", start=256, rope_theta=THETAS), "gemma-like/fp16")
    assert (back.float() - kv.float()).abs().max() < 0.5


def test_a_header_with_malformed_bases_is_refused():
    with pytest.raises(ValueError, match="every theta > 1"):
        LayoutParams.from_dict(dict(LayoutParams(mode="quant").to_dict(), rope_theta=[1e4, 0.5]))
    with pytest.raises(ValueError, match="every theta > 1"):
        LayoutParams.from_dict(dict(LayoutParams(mode="quant").to_dict(), rope_theta=[]))


@pytest.mark.parametrize("preset", ["exact", "raw"])
def test_hybrid_shaped_chunks_round_trip_exactly(preset):
    kv = steady_keys(THETAS, 256, seed=3)
    back = decode_chunk(encode_chunk(kv, preset, "gemma-like/fp16", start=256), "gemma-like/fp16")
    assert torch.equal(back.view(torch.int16), kv.view(torch.int16))
