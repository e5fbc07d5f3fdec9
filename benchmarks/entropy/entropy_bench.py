"""GPU entropy coding of the presets' planes: ratio, encode rate and restore rate, per preset, format
(``ans``, ``zstd``) and nvCOMP block size, against the raw direct path, on real KV.

Each configuration is the preset's own layout (``presets.entropy_variant``) coded on the GPU:

* ratio: fp16 KV bytes over stored object bytes (headers and side information counted);
* encode: ``chunk.encode_chunk`` of a chunk already on the GPU (pack, entropy code, the coded
  bytes copied to the host, the container built), GB/s of fp16 KV, and the pack alone;
* restore: ``executor.fetch`` of a prefix from an in-memory store (no link: the restore path is
  the limit) into a GPU buffer, decode threads in this process (verify, copy to the GPU, nvCOMP
  decode, fused unpack), GB/s of fp16 KV, checked bit for bit against each object's own decode;
  ``raw`` is the direct path through the same executor, the baseline without a codec.

KV: Llama-3-8B-shaped chunks tiled from the real SmolLM2 KV saved by ``benchmarks.lib.kvsource``
(``--kvsrc``), ``--distinct`` of them cycled along the prefix (objects of equal content decode in
equal time). NVDEC (``balanced``, ``compact``) restores through ``benchmarks.restore_rate`` on
the same machine. Prints one line per configuration and one JSON object (``--out`` too).

    python -m benchmarks.entropy.entropy_bench --kvsrc .bench/kvsrc.pt --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks.lib import kvsource, timing
from benchmarks.lib.linkstore import LinkStore
from kvfetcher import chunk, kvbuffer
from kvfetcher.codec import layout, nvcomp
from kvfetcher.fetch import executor
from kvfetcher.format import container, presets

FP = "entropy-bench"
THETA = kvsource.LLAMA3_THETA


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of ``repeats`` calls of ``fn`` (after one warm-up) and its last result."""
    return timing.median_s(fn, repeats, warmup=1)


def encode_all(kvs: list[torch.Tensor], p: presets.Preset) -> list[bytes]:
    T = kvs[0].shape[3]
    return [chunk.encode_chunk(kv, p, FP, start=i * T, rope_theta=THETA) for i, kv in enumerate(kvs)]


def pack_all(kvs: list[torch.Tensor], objs: list[bytes]) -> None:
    T = kvs[0].shape[3]
    for i, (kv, obj) in enumerate(zip(kvs, objs)):
        layout.pack(kv, container.parse_header(obj).layout, i * T)


def restore(objs: list[bytes], chunks: int, buf: torch.Tensor, threads: int, window: int, repeats: int,
            fingerprint: str = FP) -> tuple[float, list[float]]:
    """Median seconds of fetching a prefix of ``chunks`` chunks (cycling over ``objs``, encoded for
    ``fingerprint``) into ``buf``."""
    store, refs, T = LinkStore(None), [], buf.shape[3] // chunks
    for i in range(chunks):
        obj = objs[i % len(objs)]
        store.put(f"kv/{i}.kvfc", obj)
        refs.append(kvbuffer.ChunkRef(f"kv/{i}.kvfc", len(obj), i * T, T))

    async def once() -> float:
        with ThreadPoolExecutor(16) as io, ThreadPoolExecutor(threads) as dec:
            out = await executor.fetch(store, refs, kvbuffer.Destination(buf, tokens=chunks * T), fingerprint=fingerprint, io_pool=io,
                                       decode_pool=dec, device=buf.device, window=window)
        if out.error:
            raise SystemExit(f"fetch failed: {out.error}: {out.detail}")
        return out.seconds

    asyncio.run(once())  # warm-up: decoders, codecs, kernels, staging
    secs = [asyncio.run(once()) for _ in range(repeats)]
    return statistics.median(secs), secs


def bit_exact(objs: list[bytes], chunks: int, buf: torch.Tensor, fingerprint: str = FP) -> bool:
    T = buf.shape[3] // chunks
    want = [chunk.decode_chunk(o, fingerprint, device=buf.device) for o in objs]
    return all(torch.equal(buf[:, :, :, i * T : (i + 1) * T], want[i % len(objs)]) for i in range(chunks))


def run_config(name: str, p: presets.Preset, kvs: list[torch.Tensor], buf: torch.Tensor, args) -> dict:
    kv_bytes = sum(k.numel() * 2 for k in kvs)
    enc_s, objs = timed(lambda: encode_all(kvs, p), args.repeats)
    row = {"preset": name, "format": p.codec.format, "block_bytes": p.codec.block_bytes or None,
           "ratio": round(kv_bytes / sum(len(o) for o in objs), 3), "encode_GB_s": round(kv_bytes / enc_s / 1e9, 2)}
    if p.layout.mode != "native":
        pack_s, _ = timed(lambda: pack_all(kvs, objs), args.repeats)
        row["pack_GB_s"] = round(kv_bytes / pack_s / 1e9, 2)
    sec, each = restore(objs, args.chunks, buf, args.decode_threads, args.window, args.repeats)
    prefix_bytes = buf.numel() * buf.element_size()
    row.update(restore_GB_s=round(prefix_bytes / sec / 1e9, 2), restore_s_each=[round(s, 4) for s in each],
               restored_bit_exact=bit_exact(objs, args.chunks, buf))
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvsrc", default=".bench/kvsrc.pt", help="real KV from benchmarks.lib.kvsource (absent: synthetic KV, ratios meaningless)")
    ap.add_argument("--presets", default="q8,balanced,compact")
    ap.add_argument("--formats", default="ans,zstd")
    ap.add_argument("--blocks", default="16384,65536,262144", help="nvCOMP block sizes (bytes of planes) to compare")
    ap.add_argument("--distinct", type=int, default=4, help="distinct 8B-shaped chunks (256 tokens, 33.5 MB of fp16 each)")
    ap.add_argument("--chunks", type=int, default=64, help="chunks of the restored prefix (64: 16K tokens, 2.1 GB)")
    ap.add_argument("--decode-threads", type=int, default=4)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not nvcomp.available():
        raise SystemExit("needs a CUDA GPU and nvCOMP (pip install nvidia-nvcomp-cu13 nvidia-libnvcomp-cu13)")
    kvs, kv_desc = kvsource.gpu_chunks(args.kvsrc, args.distinct)
    L, _, H, T, D = kvs[0].shape
    buf = torch.zeros(L, 2, H, args.chunks * T, D, dtype=torch.float16, device="cuda")
    rows = [run_config("raw", presets.get("raw"), kvs, buf, args)]
    for base in args.presets.split(","):
        for fmt in args.formats.split(","):
            for block in (int(b) for b in args.blocks.split(",")):
                rows.append(run_config(f"{base}-{fmt}", presets.entropy_variant(presets.get(base), fmt, block), kvs, buf, args))
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "kv": kv_desc,
              "chunk_shape": [L, 2, H, T, D], "prefix_tokens": args.chunks * T, "nvcomp": getattr(nvcomp._nvcomp(), "__version__", "?"),
              "decode_threads": args.decode_threads, "window": args.window, "rows": rows}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
