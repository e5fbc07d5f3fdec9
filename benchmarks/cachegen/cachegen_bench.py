"""CacheGen measured, not quoted: LMCache's own CacheGen CUDA kernels on the same real KV.

Builds the four CacheGen ops (``calculate_cdf``, ``encode_fast_new``, ``decode_fast_new``,
``decode_fast_prefsum``) from LMCache's PyPI source distribution with
``torch.utils.cpp_extension.load`` (a one-file pybind module of ours names them; the kernels are
LMCache's, unmodified), then runs CacheGen's scheme on the 8B-shaped real KV of
``benchmarks.lib.kvsource``: per-token symmetric quantisation of each layer's K and V over its
channels into the bins of LMCache's Llama-3.1-8B config (K: 32 bins for layers 0-9, 16 after;
V: 32 bins for layers 0-1, 16 after), a per-(layer, channel) CDF, and arithmetic coding on the GPU,
256 tokens per chunk (its maximum). Prints and writes JSON: ratio vs fp16 (bytestreams + CDFs +
per-token maxima counted as fp16), encode and decode GB/s of fp16 KV (decode includes the
dequantisation into a ``[layers, 2, kv_heads, tokens, head_dim]`` fp16 buffer, as a restore would),
and the restored KV's error against the original.

Run on the GPU machine (nvcc and the CUDA headers come with torch's CUDA build there)::

    python -m benchmarks.cachegen.cachegen_bench --sdist lmcache-0.5.6.tar.gz --kvsrc .bench/kvsrc.pt --out result.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.lib import kvsource, timing

BIND = """
#include "cachegen_kernels.cuh"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode_fast_new", &encode_cuda_new);
  m.def("decode_fast_new", &decode_cuda_new);
  m.def("decode_fast_prefsum", &decode_cuda_prefsum);
  m.def("calculate_cdf", &calculate_cdf);
}
"""
MAX_TOKENS = 256  # CacheGen's tokens per coded chunk (its kernels' limit)


def build_ops(sdist: Path, workdir: Path):
    """Compile LMCache's CacheGen kernels from its source distribution; returns the module."""
    from torch.utils.cpp_extension import load

    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/csrc/cuda/" in m.name and m.name.rsplit("/", 1)[-1]
                   in ("ac_enc.cu", "ac_dec.cu", "cal_cdf.cu", "cachegen_kernels.cuh")]
        tar.extractall(workdir, members=members, filter="data")
    src = next(workdir.rglob("csrc/cuda"))
    (src / "bind.cpp").write_text(BIND)
    return load(name="cachegen_ops", sources=[str(src / f) for f in ("bind.cpp", "ac_enc.cu", "ac_dec.cu", "cal_cdf.cu")],
                extra_include_paths=[str(src)], extra_cuda_cflags=["-O3"], verbose=False)


def bins_per_layer(layers: int, first: int, device) -> torch.Tensor:
    """LMCache's Llama-3.1-8B spec: 32 bins for the first ``first`` layers, 16 after."""
    b = torch.full((layers,), 16.0, device=device)
    b[:first] = 32
    return b


def quantise(x: torch.Tensor, bins: torch.Tensor):
    """CacheGen's per-token quantisation of ``x`` [layers, tokens, channels] into ``bins`` per layer."""
    m = (bins // 2 - 1)[:, None, None]
    mx = x.abs().amax(-1, keepdim=True).clamp_min(1e-8)
    return torch.round(x * (m / mx) + m).to(torch.int8), mx


def encode(ops, kv: torch.Tensor, kbins, vbins):
    """One chunk [L, 2, H, T, D] -> (bytes on GPU, prefix sums, cdf, maxima), CacheGen's format."""
    L, _, H, T, D = kv.shape
    k = kv[:, 0].permute(0, 2, 1, 3).reshape(L, T, H * D).float()
    v = kv[:, 1].permute(0, 2, 1, 3).reshape(L, T, H * D).float()
    qk, mk = quantise(k, kbins)
    qv, mv = quantise(v, vbins)
    cdf = torch.cat([ops.calculate_cdf(qk, int(kbins.max())), ops.calculate_cdf(qv, int(vbins.max()))])
    sym = torch.cat([qk, qv])
    buf = torch.zeros((2 * L, H * D, MAX_TOKENS), dtype=torch.uint8, device=kv.device)
    lengths = torch.zeros((2 * L, H * D), dtype=torch.int32, device=kv.device)
    ops.encode_fast_new(cdf, sym, buf, lengths)
    keep = torch.arange(MAX_TOKENS, device=kv.device) < lengths[..., None]
    return buf[keep], lengths.long().flatten().cumsum(0).reshape(lengths.shape), cdf, (mk, mv), sym


def decode(ops, data, prefsum, cdf, maxima, kbins, vbins, out: torch.Tensor):
    """CacheGen's decode and dequantisation, written into ``out`` [L, 2, H, T, D] (fp16)."""
    L, _, H, T, D = out.shape
    sym = torch.empty((2 * L, T, H * D), dtype=torch.uint8, device=out.device)
    ops.decode_fast_prefsum(cdf, data, prefsum, sym)
    for i, (bins, mx) in enumerate(((kbins, maxima[0]), (vbins, maxima[1]))):
        c = (bins // 2 - 1)[:, None, None]
        x = (sym[i * L:(i + 1) * L].float() - c) / c * mx
        out[:, i].copy_(x.reshape(L, T, H, D).permute(0, 2, 1, 3))
    return sym


def timed(fn, reps: int) -> float:
    return timing.median_s(fn, reps, warmup=0)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sdist", type=Path, required=True, help="lmcache-0.5.6.tar.gz")
    ap.add_argument("--kvsrc", type=Path, default=Path(".bench/kvsrc.pt"))
    ap.add_argument("--chunks", type=int, default=32, help="256-token chunks of 8B-shaped KV per pass")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/cachegen/result.json"))
    a = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    ops = build_ops(a.sdist, Path(tempfile.mkdtemp()))
    build_s = time.perf_counter() - t0
    src = torch.load(a.kvsrc)
    kvs = [c.to(dev, torch.float16) for c in kvsource.chunks(src, a.chunks, dtype=torch.float16)]
    L = kvs[0].shape[0]
    kbins, vbins = bins_per_layer(L, 10, dev), bins_per_layer(L, 2, dev)
    coded = [encode(ops, kv, kbins, vbins) for kv in kvs]
    fp16_bytes = sum(kv.numel() * 2 for kv in kvs)
    stored = sum(d.numel() + c.numel() * 2 + (m[0].numel() + m[1].numel()) * 2 for d, _, c, m, _ in coded)
    out = torch.empty_like(kvs[0])
    lossless, err = True, []
    for kv, (d, p, c, m, sym) in zip(kvs, coded):
        got = decode(ops, d, p, c, m, kbins, vbins, out)
        lossless &= torch.equal(got.view(torch.int8), sym)
        err.append(((out.float() - kv.float()).norm() / kv.float().norm()).item())
    enc_s = timed(lambda: [encode(ops, kv, kbins, vbins) for kv in kvs], a.reps)
    dec_s = timed(lambda: [decode(ops, d, p, c, m, kbins, vbins, out) for d, p, c, m, _ in coded], a.reps)
    res = {
        "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "lmcache_sdist": a.sdist.name, "build_s": round(build_s, 1), "chunks": a.chunks, "chunk_shape": list(kvs[0].shape),
        "fp16_bytes": fp16_bytes, "stored_bytes": stored, "ratio_vs_fp16": round(fp16_bytes / stored, 3),
        "encode_GBps": round(fp16_bytes / enc_s / 1e9, 2), "decode_GBps": round(fp16_bytes / dec_s / 1e9, 2),
        "symbols_lossless": lossless, "rel_rms_error_median": round(statistics.median(err), 5),
    }
    print(json.dumps(res, indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
