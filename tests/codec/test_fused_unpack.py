"""The fused GPU unpack (fused_unpack.py) against layout.unpack's torch path.

On CPU the kernel runs under Triton's interpreter in a subprocess (the interpreter is chosen when
the kernel is defined, so it cannot be switched on in this process); on a GPU it is compiled.
The interpreter rounds float32 to bfloat16 differently from the GPU, so it is checked in float16
and float32 there, and in bfloat16 on the GPU.
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
from kvfetcher.codec import basis, fused_unpack, layout
from kvfetcher.format import presets

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def cases(dtypes: tuple[torch.dtype, ...], interpreted: bool) -> list[tuple[str, torch.Tensor, layout.LayoutParams, int]]:
    """(name, KV, layout, start): every branch of the kernel, odd token counts for the block masks."""
    L, _, H, D, _ = basis.load(presets.get("balanced").layout.basis).enc.shape
    g = torch.Generator().manual_seed(3)
    smol = torch.randn(L, 2, H, 40, D, generator=g) * 2
    smol[:, :, :, 17] *= 8  # an outlier token for the sparse corrections
    big = synthetic_kv(layers=2, heads=2, tokens=45, head_dim=128, dtype=torch.float32, seed=4)
    balanced = dataclasses.replace(presets.get("balanced").layout, rope_theta=100000.0)
    out = []
    for i, dt in enumerate(dtypes):
        n = str(dt).split(".")[-1]
        if i == 0 or not interpreted:  # the basis' matrix products are slow under the interpreter: one dtype there
            out += [(f"balanced-{n}-start256", smol.to(dt), dataclasses.replace(balanced, exact_tokens=0), 256),
                    (f"balanced-{n}-sink", smol.to(dt), balanced, 0)]
        if not interpreted:  # the transform family: the basis and the components' sort
            out.append((f"balanced-sorted-{n}-start256", smol.to(dt), dataclasses.replace(balanced, exact_tokens=0, sort_components=True), 256))
        trellis_rope = layout.LayoutParams(mode="quant", sigma_steps=((0.2, 0.3),), trellis=True, rope_theta=5e5)
        out += [
            (f"trellis-rope-{n}", big.to(dt), trellis_rope, 512),
            (f"trellis-rope-sorted-{n}", big.to(dt), dataclasses.replace(trellis_rope, sort_components=True), 512),
            (f"q8-luma-{n}", big.to(dt), layout.LayoutParams(mode="quant", bits=8, planes=1), 0),
            (f"lean-{n}", big.to(dt), layout.LayoutParams(mode="quant", kv_bits=(5, 6), rope_theta=5e5), 0),
        ]
    return out


def compare(device: str, dtypes: tuple[torch.dtype, ...]) -> dict[str, dict[str, float]]:
    """Unpack every case with the torch path and the kernel, into a strided view of a larger buffer
    (poisoned first, so an unwritten value shows); per case the largest difference in units of the
    KV dtype's spacing, and the fraction of values that differ."""
    res = {}
    for name, kv, p, start in cases(dtypes, interpreted=device == "cpu"):
        interp = os.environ.pop("TRITON_INTERPRET", None)  # pack with the torch trellis search: the unpack is under test
        pk = layout.pack(kv, p, start)
        if interp is not None:
            os.environ["TRITON_INTERPRET"] = interp
        got = {}
        for flag in ("0", "1"):
            os.environ["KVFETCHER_FUSED_UNPACK"] = flag
            assert fused_unpack.enabled(pk.frames.to(device)) == (flag == "1"), "the kernel must run exactly when asked"
            buf = torch.full((*kv.shape[:3], kv.shape[3] + 9, kv.shape[4]), float("nan"), dtype=kv.dtype, device=device)
            view = buf[:, :, :, 5 : 5 + kv.shape[3]]
            layout.unpack(pk.frames.to(device), pk.side.to(device), tuple(kv.shape), kv.dtype, p, out=view, start=start)
            got[flag] = view.float().cpu()
            assert torch.isnan(buf[:, :, :, :5]).all() and torch.isnan(buf[:, :, :, 5 + kv.shape[3]:]).all(), "wrote outside the view"
        a, b = got["0"], got["1"]
        # the spacing of the KV dtype at the value, or at the chunk's mean magnitude for values near
        # zero (where the basis' sums cancel, float32 rounding differences are absolute, not relative)
        spacing = torch.finfo(kv.dtype).eps * torch.maximum(a.abs(), a.abs().mean())
        res[name] = {"ulps": float(((a - b).abs() / spacing).nan_to_num(float("inf")).max()),
                     "frac": float((a != b).float().mean()), "nan": bool(torch.isnan(b).any())}
    os.environ.pop("KVFETCHER_FUSED_UNPACK", None)
    return res


def check(res: dict[str, dict[str, float]]) -> None:
    for name, r in res.items():
        assert not r["nan"], f"{name}: values left unwritten"
        if "float32" in name:
            # at float32's precision the compiler's fused multiply-adds and the basis' summation order
            # show (seen on an H100: up to 365 units, 4e-5 of the chunk's mean magnitude)
            assert r["ulps"] <= 1000, f"{name}: {r}"
            continue
        # 16-bit output rounds those away but for a last bit here and there (H100: <= 1 unit, < 0.01% of values)
        assert r["ulps"] <= 2 and r["frac"] < 0.001, f"{name}: {r}"


@pytest.mark.slow  # minutes under the interpreter
@needs_triton
def test_fused_unpack_matches_the_torch_path_under_the_interpreter():
    code = ("import json, torch, test_fused_unpack as t; "
            "print(json.dumps(t.compare('cpu', (torch.float16, torch.float32))))")
    check(json.loads(_interpreted(code)))


PAGED = {"BLTH(KD)": True, "BHT(KD)": False, "BHLT(KD)": True}  # vLLM's cross-layer, per-layer, cross-layer HND: one tensor?


def _paged(dims: str, kv: torch.Tensor, block_size: int, spare: int, device: str):
    """Paged tensors of ``dims`` for ``kv``'s geometry with ``spare`` more blocks than it needs,
    NaN everywhere; and the chunk's blocks, shuffled."""
    from kvfetcher.kvbuffer import PagedKV, PagedLayout

    L, _, H, T, D = kv.shape
    n = T // block_size + spare
    sizes = {"B": n, "L": L, "T": block_size, "H": H, "KD": 2 * D}
    axes = PagedLayout(dims, block_size).axes
    per = [sizes[a] for a in axes]
    tensors = torch.full(per, float("nan"), dtype=kv.dtype, device=device) if PAGED[dims] else \
        [torch.full(per, float("nan"), dtype=kv.dtype, device=device) for _ in range(L)]
    blocks = torch.randperm(n, generator=torch.Generator().manual_seed(7))[: T // block_size].tolist()
    return PagedKV(tensors, PagedLayout(dims, block_size)), blocks


def paged_cases(device: str) -> list[tuple[str, torch.Tensor, layout.LayoutParams, int]]:
    """Later chunks (no exact row: written in place) of each kernel branch, and a prefix's first
    (its exact row: through a temporary); under the interpreter none with a basis (slow there)."""
    out = []
    for name, kv, p, start in cases((torch.float16,), interpreted=device == "cpu"):
        if "q8" in name or "sorted" in name and "trellis" not in name or "balanced" in name and device == "cpu":
            continue  # (q8: the same branch as lean's; the sorted frames' reading: trellis-rope's case)
        if p.exact_tokens and "balanced" not in name:
            out.append((f"{name}-later", kv, dataclasses.replace(p, exact_tokens=0), start + 256))
        out.append((name, kv, p, start))
    return out


def compare_paged(device: str) -> dict[str, dict[str, bool]]:
    """Unpack cases with the kernel into a flat tensor and straight into paged blocks of each of
    vLLM's layouts (a prefix's first chunk, with its exact row, through a temporary): per case and
    layout whether the blocks hold the flat values bit for bit, and nothing else was written."""
    from kvfetcher.kvbuffer import ChunkRef, PagedDestination

    os.environ["KVFETCHER_FUSED_UNPACK"] = "1"
    res = {}
    for name, kv, p, start in paged_cases(device):
        interp = os.environ.pop("TRITON_INTERPRET", None)
        pk = layout.pack(kv, p, start)
        if interp is not None:
            os.environ["TRITON_INTERPRET"] = interp
        frames, side = pk.frames.to(device), pk.side.to(device)
        flat = layout.unpack(frames, side, tuple(kv.shape), kv.dtype, p, start=start)
        bs = 5  # (40- and 45-token cases: whole blocks)
        for dims in PAGED:
            paged, blocks = _paged(dims, kv, bs, 3, device)
            dest = PagedDestination(paged, blocks, kv.shape[3])
            target = dest.block_write(ChunkRef("", 0, 0, kv.shape[3]))
            layout.unpack(frames, side, tuple(kv.shape), kv.dtype, p, out=target, start=start)
            others = [b for b in range(paged.blocks) if b not in blocks]
            res[f"{name} {dims}"] = {"equal": bool(torch.equal(paged.read(blocks).cpu(), flat.cpu())),
                                     "outside_untouched": bool(torch.isnan(paged.read(others)).all()),
                                     "in_place": target is not None}
    os.environ.pop("KVFETCHER_FUSED_UNPACK", None)
    return res


def _interpreted(code: str) -> str:
    """Run ``code`` in a subprocess under Triton's interpreter; its last line of output."""
    here = str(Path(__file__).parent)  # this module, imported by the subprocess
    path = [here] + [str(REPO / d) for d in ("sidecar", "tests", ".")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


@pytest.mark.slow  # a minute under the interpreter
@needs_triton
def test_the_kernel_writes_straight_into_paged_blocks_what_it_writes_into_a_flat_buffer():
    res = json.loads(_interpreted("import json, test_fused_unpack as t; print(json.dumps(t.compare_paged('cpu')))"))
    assert len(res) == len(paged_cases("cpu")) * len(PAGED) == 18, res
    for name, r in res.items():
        assert r == {"equal": True, "outside_untouched": True, "in_place": True}, f"{name}: {r}"


@pytest.mark.gpu
@needs_triton
def test_the_compiled_kernel_writes_straight_into_paged_blocks_what_it_writes_into_a_flat_buffer():
    for name, r in compare_paged("cuda").items():
        assert r == {"equal": True, "outside_untouched": True, "in_place": True}, f"{name}: {r}"


def test_the_kernel_serves_cuda_frames_unless_switched_off(monkeypatch):
    frames = torch.zeros(1, 1, 8, 8, dtype=torch.uint8)
    monkeypatch.delenv("KVFETCHER_FUSED_UNPACK", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fused_unpack.enabled(frames)  # CPU frames: the torch path
    if torch.cuda.is_available() and fused_unpack.triton is not None:
        assert fused_unpack.enabled(frames.cuda())
        monkeypatch.setenv("KVFETCHER_FUSED_UNPACK", "0")
        assert not fused_unpack.enabled(frames.cuda())
    assert not fused_unpack.supports(48, 256) and not fused_unpack.supports(16, 256) and fused_unpack.supports(64, 256)


@pytest.mark.gpu
@needs_triton
def test_fused_unpack_matches_the_torch_path_on_the_gpu():
    check(compare("cuda", (torch.bfloat16, torch.float16, torch.float32)))


@pytest.mark.gpu
@needs_triton
def test_fused_unpack_addresses_buffers_past_2_to_the_31_values(monkeypatch):
    """A 70B model's 128K-token buffer holds 2**32 values: the kernel's offsets must be 64-bit."""
    kv = synthetic_kv(layers=2, heads=1, tokens=40, head_dim=128, dtype=torch.bfloat16, seed=5)
    p = layout.LayoutParams(mode="quant", sigma_steps=((0.2, 0.3),), trellis=True, rope_theta=5e5)
    pk = layout.pack(kv, p, 0)
    cap = (1 << 31) // (2 * 128) + 64  # layer 1 starts past 2**31 values (8.6 GB of bfloat16 in all)
    buf = torch.empty((2, 2, 1, cap, 128), dtype=torch.bfloat16, device="cuda")
    view = buf[:, :, :, cap - 40 :]
    monkeypatch.setenv("KVFETCHER_FUSED_UNPACK", "0")
    ref = layout.unpack(pk.frames.cuda(), pk.side.cuda(), tuple(kv.shape), kv.dtype, p, start=0)
    monkeypatch.setenv("KVFETCHER_FUSED_UNPACK", "1")
    view.fill_(float("nan"))
    layout.unpack(pk.frames.cuda(), pk.side.cuda(), tuple(kv.shape), kv.dtype, p, out=view, start=0)
    assert not torch.isnan(view).any()
    assert ((view.float() - ref.float()).abs() <= ref.float().abs() * 2**-7).all()  # within a last bit of bfloat16
    del buf
    torch.cuda.empty_cache()


def _compiled(kernel) -> int:
    """Variants of a Triton kernel compiled in this process, over all devices."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


@pytest.mark.gpu
@needs_triton
def test_a_prefixs_first_chunk_reuses_the_compiled_kernel(monkeypatch):
    """The first chunk keeps its sink token exact (body from row 1), later chunks do not (row 0):
    one compiled kernel must serve both, or the first fetch that reaches position 0 compiles
    another inside its time to first token (~1 s, seen on an H100)."""
    monkeypatch.setenv("KVFETCHER_FUSED_UNPACK", "1")
    kv = synthetic_kv(layers=2, heads=2, tokens=40, head_dim=128, dtype=torch.bfloat16, seed=6).cuda()
    sink = layout.LayoutParams(mode="quant", sigma_steps=((0.2, 0.3),), trellis=True, rope_theta=5e5)
    later = dataclasses.replace(sink, exact_tokens=0)  # as chunk.py encodes every chunk but the first

    def unpack(p: layout.LayoutParams, start: int) -> int:
        pk = layout.pack(kv, p, start)
        layout.unpack(pk.frames, pk.side, tuple(kv.shape), kv.dtype, p, start=start)
        torch.cuda.synchronize()
        return _compiled(fused_unpack._unpack_kernel)

    n = unpack(later, 40)
    assert n >= 1 and unpack(sink, 0) == n, "the first chunk compiled a kernel of its own"


@pytest.mark.gpu
@needs_triton
def test_the_kernel_gives_the_same_values_from_a_column_major_basis_and_hoisted_loads(monkeypatch):
    """``unpack_into`` takes the basis' inverse in either major order (``benchmarks/transform/unpack_variants.py``
    times both), and loading its blocks once per program changes no value."""
    ref = compare("cuda", (torch.float16,))
    row_major = basis.on_device
    monkeypatch.setattr(basis, "on_device", lambda n, d: (lambda e, dec, m: (e, dec.mT.contiguous().mT, m))(*row_major(n, d)))
    monkeypatch.setattr(fused_unpack, "HOIST_BASIS", True)
    assert compare("cuda", (torch.float16,)) == ref
