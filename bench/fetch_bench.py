"""Fetch pipeline throughput: N stored chunks -> KV buffer (CPU, or CUDA with NVDEC), per preset.

Stores synthetic KV of a model shape in a local directory (so the link is not the limit),
then times ``pipeline.fetch`` into a buffer on the chosen device. Prints one JSON object.

    python bench/fetch_bench.py --device cuda --chunks 16 --presets raw,exact,q8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kvtest import synthetic_kv  # noqa: E402

from kvfetcher import pipeline  # noqa: E402
from kvfetcher.chunk import encode_chunk  # noqa: E402
from kvfetcher.store.local import LocalStore  # noqa: E402


async def fetch_once(store, refs, buf, device, window, decode_workers):
    with ThreadPoolExecutor(16) as io, ThreadPoolExecutor(decode_workers) as dec:
        dest = pipeline.Destination(buf, tokens=sum(r.tokens for r in refs))
        return await pipeline.fetch(store, refs, dest, fingerprint="bench", io_pool=io, decode_pool=dec, device=device, window=window)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--shape", default="30,3,64", help="layers,kv_heads,head_dim (default: SmolLM2-135M)")
    ap.add_argument("--presets", default="raw,exact,q8")
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--decode-workers", type=int, default=2)
    args = ap.parse_args()
    layers, heads, head_dim = (int(x) for x in args.shape.split(","))
    tokens = args.chunks * args.chunk_tokens
    kv = synthetic_kv(layers=layers, heads=heads, tokens=tokens, head_dim=head_dim)
    kv_bytes = kv.numel() * kv.element_size()
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "kv_bytes": kv_bytes,
               "chunks": args.chunks, "chunk_tokens": args.chunk_tokens, "shape": [layers, heads, head_dim], "presets": {}}
    with tempfile.TemporaryDirectory() as d:
        store = LocalStore(d)
        for preset in args.presets.split(","):
            refs, stored, t = [], 0, time.perf_counter()
            for i in range(args.chunks):
                obj = encode_chunk(kv[:, :, :, i * args.chunk_tokens : (i + 1) * args.chunk_tokens].contiguous(), preset, "bench")
                name = f"kv/{i}/{preset}.kvfc"
                store.put(name, obj)
                stored += len(obj)
                refs.append(pipeline.ChunkRef(name, len(obj), i * args.chunk_tokens, args.chunk_tokens))
            encode_s = time.perf_counter() - t
            buf = torch.zeros((layers, 2, heads, tokens, head_dim), dtype=kv.dtype, device=args.device)
            asyncio.run(fetch_once(store, refs[:1], buf, args.device, args.window, args.decode_workers))  # warm-up
            out = asyncio.run(fetch_once(store, refs, buf, args.device, args.window, args.decode_workers))
            assert out.error is None, out
            results["presets"][preset] = {
                "stored_bytes": stored,
                "ratio": round(kv_bytes / stored, 3),
                "encode_s": round(encode_s, 3),
                "fetch_s": round(out.seconds, 4),
                "kv_GB_per_s": round(kv_bytes / out.seconds / 1e9, 3),
                "decode_busy_s": round(out.decode_busy_s, 4),
                "read_busy_s": round(out.read_busy_s, 4),
            }
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
