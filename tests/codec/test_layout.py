import pytest
import torch

from kvtest import synthetic_kv
from kvfetcher.codec import layout, tiling


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("planes", [1, 3])
def test_exact_round_trip_is_bit_exact(dtype, planes):
    kv = synthetic_kv(tokens=77, dtype=dtype)
    kv.view(-1)[:4] = torch.tensor([0.0, -0.0, float("inf"), -1e-7]).to(dtype)  # signs, specials
    p = layout.LayoutParams(mode="exact", planes=planes)
    packed = layout.pack(kv, p)
    assert packed.frames.dtype == torch.uint8 and packed.side is None
    back = layout.unpack(packed.frames, None, kv.shape, dtype, p)
    assert torch.equal(back.view(torch.uint8), kv.view(torch.uint8))


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_quant_error_is_within_half_a_step(bits):
    kv = synthetic_kv(tokens=256, dtype=torch.float32)
    p = layout.LayoutParams(mode="quant", bits=bits)
    packed = layout.pack(kv, p)
    assert int(packed.frames.max()) <= (1 << bits) - 1
    back = layout.unpack(packed.frames, packed.side, kv.shape, kv.dtype, p)
    ranges, exact = layout.split_side(packed.side, kv.shape, p)
    step = ranges[..., 1].unsqueeze(3)  # [L, 2, H, 1, D]
    assert torch.all((back - kv).abs() <= step * 0.5 + 1e-5)
    assert torch.equal(back[:, :, :, :1], kv[:, :, :, :1]) and torch.equal(exact, kv[:, :, :, :1])


def test_leading_outlier_token_is_exact_and_does_not_coarsen_the_rest():
    kv = synthetic_kv(tokens=64, dtype=torch.float32)
    kv[:, :, :, 0] = 1000.0  # an attention-sink-like outlier at position 0
    p = layout.LayoutParams(mode="quant")
    packed = layout.pack(kv, p)
    back = layout.unpack(packed.frames, packed.side, kv.shape, kv.dtype, p)
    assert torch.all(back[:, :, :, 0] == 1000.0)
    assert (back[:, :, :, 1:] - kv[:, :, :, 1:]).abs().max() < 0.05
    plain = layout.LayoutParams(mode="quant", exact_tokens=0)
    pk0 = layout.pack(kv, plain)
    back0 = layout.unpack(pk0.frames, pk0.side, kv.shape, kv.dtype, plain)
    assert (back0[:, :, :, 1:] - kv[:, :, :, 1:]).abs().max() > 1.0  # range blown up by the outlier


@pytest.mark.parametrize("tokens", [1, 2])
def test_chunks_no_longer_than_the_exact_tokens(tokens):
    kv = synthetic_kv(tokens=tokens, dtype=torch.float16)
    p = layout.LayoutParams(mode="quant", exact_tokens=2)
    packed = layout.pack(kv, p)
    assert torch.equal(layout.unpack(packed.frames, packed.side, kv.shape, kv.dtype, p), kv)


def test_constant_channel_is_restored_exactly():
    kv = synthetic_kv(tokens=32, dtype=torch.float32)
    kv[1, 0, 1, :, 5] = 2.5
    p = layout.LayoutParams(mode="quant")
    packed = layout.pack(kv, p)
    back = layout.unpack(packed.frames, packed.side, kv.shape, kv.dtype, p)
    assert torch.all(back[1, 0, 1, :, 5] == 2.5)


def test_unpack_writes_into_a_strided_destination_view():
    kv = synthetic_kv(tokens=40)
    p = layout.LayoutParams(mode="exact")
    packed = layout.pack(kv, p)
    buffers = torch.zeros(kv.shape[0], 2, kv.shape[2], 100, kv.shape[4], dtype=kv.dtype)  # room for 100 tokens
    view = buffers[:, :, :, 30:70]
    layout.unpack(packed.frames, None, kv.shape, kv.dtype, p, out=view)
    assert torch.equal(buffers[:, :, :, 30:70], kv)
    assert buffers[:, :, :, :30].abs().sum() == 0 and buffers[:, :, :, 70:].abs().sum() == 0


def test_frames_are_large_enough_for_nvdec_and_aligned():
    geo = layout.geometry((2, 2, 1, 5, 16), torch.float16, layout.LayoutParams(mode="quant"))
    n, planes, h, w = geo.frame_shape
    assert h >= 144 and w >= 144 and h % 8 == 0 and w % 8 == 0


def test_bad_shapes_and_dtypes_are_refused():
    with pytest.raises(ValueError):
        layout.pack(torch.zeros(2, 3, 1, 4, 8), layout.LayoutParams())
    with pytest.raises(ValueError):
        layout.pack(torch.zeros(2, 2, 1, 4, 8, dtype=torch.int32), layout.LayoutParams())
    with pytest.raises(ValueError):
        layout.LayoutParams(bits=9)
    with pytest.raises(ValueError):
        layout.LayoutParams(kv_bits=(9, 8))
    with pytest.raises(ValueError):
        layout.LayoutParams(exact_tokens=-1)


def test_bits_map_sets_levels_per_layer_and_kv():
    kv = synthetic_kv(layers=3, tokens=64, dtype=torch.float32)
    p = layout.LayoutParams(mode="quant", bits_map=((8, 8), (4, 6), (2, 8)))
    packed = layout.pack(kv, p)
    tiles = tiling.frames_to_tiles(packed.frames, packed.geometry, 64, kv.shape[2] * kv.shape[4]).view(3, 2, 64, -1)
    assert int(tiles[1, 0].max()) == 15 and int(tiles[1, 1].max()) == 63 and int(tiles[2, 0].max()) == 3
    back = layout.unpack(packed.frames, packed.side, kv.shape, kv.dtype, p)
    step = layout.split_side(packed.side, kv.shape, p)[0][..., 1].unsqueeze(3)
    assert torch.all((back - kv).abs() <= step * 0.5 + 1e-5)
    assert layout.LayoutParams.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError):
        layout.pack(kv, layout.LayoutParams(mode="quant", bits_map=((8, 8),)))


def test_rope_inverse_is_exact():
    from kvfetcher.codec import rope

    k = torch.randn(3, 2, 40, 64, dtype=torch.float64).float()
    cos, sin = rope.rotation(100, 40, 64, 10000.0)
    assert torch.allclose(rope.apply(rope.apply(k, cos, sin, inverse=True), cos, sin), k, atol=1e-5)


@pytest.mark.parametrize("theta", [10000, 500000.0, 1e6])
def test_a_rotation_is_the_llama_formula_bit_for_bit_for_any_positions(theta):
    """Stored chunks were coded with this formula: the cached frequencies must not change a bit."""
    from kvfetcher.codec import rope

    for start, tokens, head_dim in ((0, 256, 128), (32768, 256, 128), (100, 40, 64)):
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        emb = torch.arange(start, start + tokens, dtype=torch.float64)[:, None] * inv[None]
        emb = torch.cat([emb, emb], dim=-1)
        cos, sin = rope.rotation(start, tokens, head_dim, theta)
        assert torch.equal(cos, emb.cos().float()) and torch.equal(sin, emb.sin().float())


def _roped_keys_with_steady_channels(start: int) -> torch.Tensor:
    """Keys whose pre-RoPE channels are large and steady, as real keys' outlier channels are."""
    from kvfetcher.codec import rope

    kv = synthetic_kv(layers=2, heads=2, tokens=128, head_dim=64, dtype=torch.float32)
    kv[:, 0] = kv[:, 0] * 0.05 + torch.linspace(-8, 8, 64)  # pre-RoPE: mean per channel, small spread
    cos, sin = rope.rotation(start, 128, 64, 10000.0)
    kv[:, 0] = rope.apply(kv[:, 0], cos, sin)
    return kv.half()


def test_pre_rope_keys_quantise_far_more_precisely_and_need_the_right_start():
    kv = _roped_keys_with_steady_channels(start=512)
    post, pre = layout.LayoutParams(mode="quant", bits=5), layout.LayoutParams(mode="quant", bits=5, rope_theta=10000.0)
    err = {}
    for name, p in (("post", post), ("pre", pre)):
        packed = layout.pack(kv, p, start=512)
        back = layout.unpack(packed.frames, packed.side, kv.shape, kv.dtype, p, start=512)
        err[name] = (back[:, 0].float() - kv[:, 0].float()).abs().mean()
        assert torch.equal(back[:, :, :, 0], kv[:, :, :, 0])  # exact first token either way
    assert err["pre"] < err["post"] / 4
    packed = layout.pack(kv, pre, start=512)
    wrong = layout.unpack(packed.frames, packed.side, kv.shape, kv.dtype, pre, start=0)
    assert (wrong[:, 0].float() - kv[:, 0].float()).abs().mean() > err["pre"] * 10
    with pytest.raises(ValueError):
        layout.LayoutParams(mode="exact", rope_theta=10000.0)


def test_kv_bits_applies_to_every_layer():
    kv = synthetic_kv(layers=3, tokens=64, dtype=torch.float32)
    p = layout.LayoutParams(mode="quant", kv_bits=(5, 6))
    assert torch.equal(layout.levels(p, 3), torch.tensor([[31.0, 63.0]] * 3))
    assert layout.LayoutParams.from_dict(p.to_dict()) == p


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_sigma_steps_error_is_within_half_a_step_and_centred(dtype):
    kv = synthetic_kv(tokens=256, dtype=dtype)
    kv[0, 0, 0, 50, 3] = 40.0  # an outlier widens its channel's step instead of clipping
    p = layout.LayoutParams(mode="quant", sigma_steps=((0.05, 0.5),))
    packed = layout.pack(kv, p)
    back = layout.unpack(packed.frames, packed.side, kv.shape, kv.dtype, p)
    ranges, _ = layout.split_side(packed.side, kv.shape, p)
    step = ranges[..., 1].float().unsqueeze(3)
    ulp = kv.float().abs() * (1e-3 if dtype == torch.float16 else 1e-6)  # the result rounded to the dtype
    assert torch.all((back.float() - kv.float()).abs() <= step * 0.5 * 1.01 + ulp + 1e-6)
    assert torch.equal(back[:, :, :, :1], kv[:, :, :, :1])
    body = kv[:, :, :, 1:].float()
    sd = body.std(dim=3, correction=0).unsqueeze(3)
    ratio = (step / sd)[:, :, :, 0]
    plain = torch.ones_like(ratio, dtype=torch.bool)
    plain[0, 0, 0, 3] = False
    assert torch.allclose(ratio[:, 0][plain[:, 0]], torch.tensor(0.05), rtol=2e-3)  # keys: 0.05 sigma
    assert torch.allclose(ratio[:, 1], torch.tensor(0.5), rtol=2e-3)  # values: 0.5 sigma
    assert ratio[0, 0, 0, 3] > 0.06  # the outlier's channel: widened to fit in 8 bits
    tiles = tiling.frames_to_tiles(packed.frames, packed.geometry, kv.shape[3], kv.shape[2] * kv.shape[4])
    assert abs(float(tiles.float().mean()) - 128) < 2  # channels centred on level 128


def test_sigma_profile_stretches_over_depth():
    p = layout.LayoutParams(mode="quant", sigma_steps=((0.1, 0.2), (0.3, 0.4)))
    prof = layout.sigma_profile(p, 4)
    assert torch.allclose(
        prof, torch.tensor([[0.1, 0.2], [0.1, 0.2], [0.3, 0.4], [0.3, 0.4]]))
    assert torch.allclose(layout.sigma_profile(p, 1), torch.tensor([[0.1, 0.2]]))


def test_coarser_sigma_steps_give_fewer_distinct_levels():
    kv = synthetic_kv(tokens=256, dtype=torch.float32)
    fine = layout.pack(kv, layout.LayoutParams(mode="quant", sigma_steps=((0.1, 0.1),))).frames
    coarse = layout.pack(kv, layout.LayoutParams(mode="quant", sigma_steps=((1.0, 1.0),))).frames
    assert len(torch.unique(coarse)) < len(torch.unique(fine)) / 4


@pytest.mark.parametrize("bad", [
    dict(sigma_steps=((0.0, 0.5),)),
    dict(sigma_steps=((0.2, 17.0),)),
    dict(sigma_steps=()),
    dict(sigma_steps=((0.2,),)),
    dict(sigma_steps=((0.2, 0.2),), kv_bits=(5, 6)),
    dict(sigma_steps=((0.2, 0.2),), mode="exact"),
])
def test_bad_sigma_steps_are_refused(bad):
    with pytest.raises(ValueError):
        layout.LayoutParams(**{"mode": "quant", **bad})


def test_sigma_steps_survive_the_header_round_trip():
    p = layout.LayoutParams(mode="quant", sigma_steps=((0.2, 0.5), (0.3, 0.6)), rope_theta=10000.0)
    assert layout.LayoutParams.from_dict(p.to_dict()) == p


# --- basis (per-model channel transform) ------------------------------------------------

def _shipped_basis():
    from kvfetcher.codec import basis

    from kvfetcher.format import calibration

    return basis.load(calibration.default().basis)  # the shipped model's


def test_shipped_basis_is_invertible_and_named_by_its_content():
    from kvfetcher.codec import basis

    b = _shipped_basis()
    L, H, D = b.shape
    eye = torch.eye(D).expand(L, 2, H, D, D)
    assert torch.allclose(b.dec @ b.enc, eye, atol=1e-3)
    assert basis.build(b.name.rsplit("-", 1)[0], b.enc, b.mean).name == b.name  # digest of the content
    assert basis.fits(b.name, (L, 2, H, 256, D), "smollm2-135m-instruct-q4_1/float32")
    assert not basis.fits(b.name, (L, 2, H, 256, D), "another-model/fp16")
    assert not basis.fits(b.name, (L + 1, 2, H, 256, D), "smollm2-135m-instruct-q4_1/float32")
    with pytest.raises(ValueError):
        basis.load("smollm2-135m-000000000000")


def test_transform_decorrelates_and_orders_by_weighted_variance():
    from kvfetcher.codec import basis

    g = torch.Generator().manual_seed(1)
    mix = torch.randn(1, 8, 8, generator=g, dtype=torch.float64)
    x = torch.randn(1, 4000, 8, generator=g, dtype=torch.float64) @ mix  # correlated channels
    w = torch.diag(torch.tensor([4.0, 1, 1, 1, 1, 1, 1, 0.25], dtype=torch.float64)).unsqueeze(0)
    enc, dec = basis.transform(w, basis.covariance([x]), ridge=0.0)
    y = ((x - x.mean(1, keepdim=True)) @ enc[0].T)[0]
    c = y.T @ y / y.shape[0]
    off = c - torch.diag(c.diagonal())
    assert off.abs().max() < 1e-8 * c.diagonal().max()  # uncorrelated components
    assert torch.all(c.diagonal()[:-1] >= c.diagonal()[1:])  # in decreasing variance
    assert torch.allclose(dec[0] @ enc[0], torch.eye(8, dtype=torch.float64), atol=1e-9)
    # the weighted error of a component error e is |e|^2: enc is orthonormal in the metric
    assert torch.allclose(dec[0].T @ w[0] @ dec[0], torch.eye(8, dtype=torch.float64), atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_basis_round_trip_error_is_half_a_step_per_component(dtype):
    b = _shipped_basis()
    L, H, D = b.shape
    kv = synthetic_kv(layers=L, heads=H, tokens=256, head_dim=D, dtype=dtype)
    p = layout.LayoutParams(mode="quant", sigma_steps=((0.3, 0.6),), basis=b.name, rope_theta=10000.0)
    assert layout.LayoutParams.from_dict(p.to_dict()) == p
    orig = kv.clone()
    packed = layout.pack(kv, p, start=256)
    assert torch.equal(kv, orig)  # pack never writes into its input (fp32 keys are un-rotated in a copy)
    back = layout.unpack(packed.frames, packed.side, kv.shape, kv.dtype, p, start=256)
    assert torch.equal(back[:, :, :, :1], kv[:, :, :, :1])  # the exact first token
    # error in the coded domain: keys un-rotated, then enc, per head
    from kvfetcher.codec import rope

    def coded(t):
        x = t.float().clone()
        cos, sin = rope.rotation(256, x.shape[3], D, 10000.0)
        x[:, 0] = rope.apply(x[:, 0], cos, sin, inverse=True)
        return torch.einsum("lkhde,lkhte->lkhtd", b.enc, x)

    ranges, _ = layout.split_side(packed.side, kv.shape, p)
    step = ranges[..., 1].float().unsqueeze(3)  # [L, 2, H, 1, D]
    err = (coded(back) - coded(kv))[:, :, :, 1:].abs()
    # the restored dtype's rounding (<= 2**-11 relative, x2 for RoPE's pairs), seen through enc
    ulp = (2.0**-10 if dtype == torch.float16 else 2.0**-23) * kv.float().abs().amax(dim=(3, 4), keepdim=True)
    slack = b.enc.abs().sum(-1).unsqueeze(3) * ulp
    assert torch.all(err <= step * 0.5 * 1.01 + slack + 1e-5)
    # one step per (layer, k|v) for all unwidened components: the pooled allocation
    med = step.flatten(2).median(-1).values
    assert (step.flatten(2) == med.unsqueeze(-1)).float().mean() > 0.5


@pytest.mark.parametrize("trellis", [False, True])
def test_basis_unpack_writes_into_a_strided_destination_view(trellis):
    b = _shipped_basis()
    L, H, D = b.shape
    kv = synthetic_kv(layers=L, heads=H, tokens=64, head_dim=D, dtype=torch.float16)
    p = layout.LayoutParams(mode="quant", sigma_steps=((0.2, 0.2),), basis=b.name, trellis=trellis)
    packed = layout.pack(kv, p)
    buf = torch.zeros(L, 2, H, 128, D, dtype=torch.float16)
    view = buf[:, :, :, 32:96]
    layout.unpack(packed.frames, packed.side, kv.shape, kv.dtype, p, out=view)
    assert torch.equal(view, layout.unpack(packed.frames, packed.side, kv.shape, kv.dtype, p))
    assert torch.all(buf[:, :, :, :32] == 0) and torch.all(buf[:, :, :, 96:] == 0)


def test_basis_needs_sigma_steps_and_a_matching_shape():
    b = _shipped_basis()
    with pytest.raises(ValueError):
        layout.LayoutParams(mode="quant", basis=b.name)
    kv = synthetic_kv(layers=2, heads=2, tokens=64)
    with pytest.raises(ValueError, match="basis"):
        layout.pack(kv, layout.LayoutParams(mode="quant", sigma_steps=((0.2, 0.2),), basis=b.name))


def test_basis_mean_keeps_high_mean_components_on_their_mean_with_fp16_offsets():
    """Near-constant components hundreds of steps from zero: an fp16 offset alone cannot place
    the grid within a step there, so each comes back off by a random part of a step, the same for
    every token; subtracting the basis' calibration mean first keeps them on their values."""
    b = _shipped_basis()
    L, H, D = b.shape
    g = torch.Generator().manual_seed(3)
    y = torch.randn(L, 2, H, 256, D, generator=g, dtype=torch.float64)
    quiet = b.mean.double().abs() > 5  # [L, 2, H, D]: components far from zero, made near-constant
    y = torch.where(quiet.unsqueeze(3), b.mean.double().unsqueeze(3) + 0.3 + 1e-4 * y, y)
    kv = torch.einsum("lkhde,lkhte->lkhtd", b.dec.double(), y).to(torch.float16)
    p = layout.LayoutParams(mode="quant", sigma_steps=((0.01, 0.01),), basis=b.name)
    packed = layout.pack(kv, p)
    back = layout.unpack(packed.frames, packed.side, kv.shape, kv.dtype, p)
    step = layout.split_side(packed.side, kv.shape, p)[0][..., 1].double()  # [L, 2, H, D]
    err = torch.einsum("lkhde,lkhte->lkhtd", b.enc.double(), back.double() - kv.double())[:, :, :, 1:]
    bias = (err.mean(3) / step).abs()
    assert int(quiet.sum()) >= 20
    assert float(bias[quiet].mean()) < 0.045  # 0.027 here; 0.076 with the mean taken as zero (checked)


def test_paged_blocks_of_another_geometry_or_dtype_are_refused_before_a_write():
    from kvfetcher.kvbuffer import PagedKV, PagedLayout

    kv = synthetic_kv(layers=2, heads=2, tokens=32, head_dim=64)
    p = layout.LayoutParams(mode="quant", bits=8)
    pk = layout.pack(kv, p)
    for blocks, dtype in (([0, 1, 2], kv.dtype), ([0, 1], torch.float32)):  # 48 tokens of blocks; a float32 buffer
        paged = PagedKV(torch.full((4, 2, 16, 2, 128), 7.0, dtype=dtype), PagedLayout("BLTH(KD)", 16))
        with pytest.raises(ValueError, match="destination blocks"):
            layout.unpack(pk.frames, pk.side, tuple(kv.shape), kv.dtype, p, out=paged.block_write(blocks))
        assert (paged.tensors[0] == 7).all()
    paged = PagedKV(torch.zeros((4, 2, 16, 2, 128), dtype=kv.dtype), PagedLayout("BLTH(KD)", 16))
    layout.unpack(pk.frames, pk.side, tuple(kv.shape), kv.dtype, p, out=paged.block_write([3, 1]))
    assert torch.equal(paged.read([3, 1]), layout.unpack(pk.frames, pk.side, tuple(kv.shape), kv.dtype, p))
