"""Sparse corrections of outlier-key tokens (layout v7, ``LayoutParams.sparse_tokens``)."""

import dataclasses

import pytest
import torch

from kvfetcher.codec import basis, layout, rope
from kvfetcher.format import calibration

THETA = 100000.0
BASIS = calibration.default().basis  # the shipped model's


def _kv(tokens: int, dtype: torch.dtype, outlier: int | None = 37) -> torch.Tensor:
    L, _, H, D, _ = basis.load(BASIS).enc.shape
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(L, 2, H, tokens, D, generator=g) * 2
    if outlier is not None:
        kv[:, :, :, outlier] *= 8  # a token whose keys stand out in every head
    return kv.to(dtype)


def _params(k: int, step: float = 0.25) -> layout.LayoutParams:
    return layout.LayoutParams(mode="quant", sigma_steps=((0.3, 0.3),), basis=BASIS, trellis=True,
                               sparse_tokens=k, sparse_step=step, rope_theta=THETA)


def _in_basis(kv: torch.Tensor, start: int) -> torch.Tensor:
    enc, _, _ = basis.on_device(BASIS, "cpu")
    x = kv.float().clone()
    cos, sin = rope.rotation(start, x.shape[3], x.shape[-1], THETA)
    x[:, 0] = rope.apply(x[:, 0], cos, sin, inverse=True)
    return torch.einsum("lkhde,lkhte->lkhtd", enc, x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("start", [0, 256])
def test_outlier_token_is_corrected_to_a_fraction_of_a_step(dtype, start):
    kv = _kv(100, dtype)
    p, p0 = _params(3), _params(0)
    packed = layout.pack(kv, p, start=start)
    assert packed.side.dtype == dtype and packed.side.numel() == layout.side_numel(kv.shape, p, dtype)
    back = layout.unpack(packed.frames, packed.side, kv.shape, dtype, p, start=start)
    plain = layout.pack(kv, p0, start=start)
    assert torch.equal(packed.frames, plain.frames)  # the video is unchanged: corrections are side information
    before = layout.unpack(plain.frames, plain.side, kv.shape, dtype, p0, start=start)
    idx, rows = layout.split_sparse(packed.side, kv.shape, p)
    assert idx.shape == (kv.shape[0], kv.shape[2], 3) and rows.shape == (kv.shape[0], 2, kv.shape[2], 3, kv.shape[4])
    assert bool((idx == 37).any(-1).all())  # found in every (layer, head), by its keys alone
    assert bool((idx[..., 1:] > idx[..., :-1]).all()) and int(idx.min()) >= (1 if start == 0 else 0)  # sorted, body only
    # in the basis, the corrected rows are within half a correction step (plus the stored step's rounding)
    step = layout.split_side(packed.side, kv.shape, p)[0][..., 1].float().unsqueeze(3)  # [L, 2, H, 1, D]
    y, yb, y0 = _in_basis(kv, start), _in_basis(back, start), _in_basis(before, start)
    g = idx.long().view(kv.shape[0], 1, kv.shape[2], 3, 1).expand(-1, 2, -1, -1, kv.shape[4])
    err, err0 = (yb - y).gather(3, g), (y0 - y).gather(3, g)
    if dtype == torch.float32:  # (fp16/bf16 add their own rounding of the restored values)
        assert bool((err.abs() <= 0.125 * step * 1.01 + 1e-4).all())
    assert float(err.square().mean()) < (0.04 if dtype == torch.float32 else 0.1) * float(err0.square().mean())
    # other rows are untouched
    mask = torch.ones(kv.shape[0], kv.shape[2], kv.shape[3], dtype=torch.bool).scatter_(2, idx.long(), False)
    m = mask.view(kv.shape[0], 1, kv.shape[2], kv.shape[3], 1).expand_as(kv)
    assert torch.equal(back[m], before[m])


@pytest.mark.parametrize("tokens,start", [(1, 0), (2, 0), (3, 256), (300, 0)])
def test_short_and_long_chunks(tokens, start):
    kv = _kv(tokens, torch.float16, outlier=None)
    p = _params(4, 0.5)
    packed = layout.pack(kv, p, start=start)
    back = layout.unpack(packed.frames, packed.side, kv.shape, kv.dtype, p, start=start)
    body = tokens - 1 if tokens > 1 else tokens  # exact_tokens=1 (chunk.py drops it after position 0)
    assert layout.sparse_count(kv.shape, p) == min(4, body)
    idx, _ = layout.split_sparse(packed.side, kv.shape, p)
    assert idx.shape[-1] == min(4, body) and bool((idx < tokens).all())
    assert torch.isfinite(back.float()).all()


def test_sparse_needs_a_basis_and_old_headers_mean_none():
    with pytest.raises(ValueError, match="sparse_tokens"):
        layout.LayoutParams(mode="quant", sigma_steps=((0.3, 0.3),), sparse_tokens=2)
    with pytest.raises(ValueError, match="sparse_tokens"):
        _params(-1)
    with pytest.raises(ValueError, match="sparse_step"):
        dataclasses.replace(_params(2), sparse_step=2.0)
    d = _params(0).to_dict()
    del d["sparse_tokens"], d["sparse_step"]  # a layout v6 header
    assert layout.LayoutParams.from_dict(d).sparse_tokens == 0
    assert layout.LayoutParams.from_dict(_params(8).to_dict()) == _params(8)


def test_balanced_on_a_model_without_a_basis_drops_the_corrections_with_it(tmp_path, monkeypatch):
    """A model calibrated without a basis (step tables only) stores `balanced` with per-channel
    steps and no sparse corrections, which rank keys in the basis."""
    from kvfetcher.format import container, presets
    from kvfetcher.chunk import decode_chunk, encode_chunk

    monkeypatch.setenv("KVFETCHER_CALIBRATION_DIR", str(tmp_path))
    tables = {k: {"layers": [[1e-4, 1e-4]] * 4} for k in ("basis", "trellis")}
    calibration.write(calibration.artefact("some-other-model", tables, None, (4, 2, 64), None, None), tmp_path)
    presets.for_model.cache_clear()
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(4, 2, 2, 128, 64, generator=g).to(torch.float16)
    obj = encode_chunk(kv, "balanced", "some-other-model", start=0, rope_theta=10000.0)
    presets.for_model.cache_clear()
    h = container.parse_header(obj[: container.header_length(obj[: container.PREFIX_SIZE])])
    assert h.layout.basis is None and h.layout.sparse_tokens == 0
    back = decode_chunk(obj, "some-other-model")
    assert back.shape == kv.shape and float((back.float() - kv.float()).abs().mean()) < 0.2 * float(kv.float().abs().mean())


@pytest.mark.gpu
def test_sparse_corrections_restore_the_same_on_the_gpu_as_on_the_cpu():
    """Layout v7's decode (trellis cumsum, scatter of the corrections, inverse basis, RoPE) on a GPU,
    into a strided view of a KV buffer: the CPU's result up to float rounding, nothing else touched."""
    kv = _kv(256, torch.float16)
    p = _params(4)
    packed = layout.pack(kv, p, start=256)
    cpu = layout.unpack(packed.frames, packed.side, kv.shape, torch.float16, p, start=256)
    buf = torch.zeros(kv.shape[0], 2, kv.shape[2], 600, kv.shape[4], dtype=torch.float16, device="cuda")
    layout.unpack(packed.frames.cuda(), packed.side.cuda(), kv.shape, torch.float16, p, out=buf[:, :, :, 300:556], start=256)
    got = buf[:, :, :, 300:556].cpu().float()
    assert (got - cpu.float()).abs().max() <= 2e-2 * cpu.float().abs().max()
    assert buf[:, :, :, :300].abs().sum() == 0 and buf[:, :, :, 556:].abs().sum() == 0
