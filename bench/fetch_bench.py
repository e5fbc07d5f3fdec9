"""Fetch pipeline throughput: N stored chunks -> KV buffer (CPU, or CUDA with NVDEC), per preset.

Stores KV of a model shape in a local directory (so the link is not the limit), then times
``pipeline.fetch`` into a buffer on the chosen device: decoding in threads (``--procs 0``) or
in decode worker processes that write through the buffer's IPC handle (``--procs N``), with
NVDEC utilisation sampled alongside. The KV is synthetic, or real KV (``--kv``: a saved
``[L, 2, H, T, D]`` tensor, e.g. SmolLM2-135M's) tiled into the model shape, so that
compression ratios and bitstream sizes are those of real KV. ``--distinct`` chunks are encoded
and stored under every chunk's name (encoding GBs on CPU would take minutes; decoding work is
the same). Prints and optionally writes one JSON object.

``raw-direct`` (a pseudo-preset) is the plain baseline of ``fetchkit.fetch_raw_direct``: each
chunk's KV bytes stored as they are (no container) and copied to the buffer as they arrive —
what the ``raw`` preset's direct path (``pipeline``: ranged GETs into pinned staging memory,
CRC per segment, one copy on a side stream) is compared with. ``--link-gbps`` puts the objects
behind an emulated link (``linkstore``) instead of a local directory.

    python bench/fetch_bench.py --device cuda --chunks 64 --shape 32,8,128 --kv real.pt --procs 0,8 --presets raw,raw-direct,q8,lean
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvsource  # noqa: E402
from kvtest import synthetic_kv  # noqa: E402
from nvdec_bench import NvmlSampler  # noqa: E402

from kvfetcher import ipc, pipeline  # noqa: E402
from kvfetcher.chunk import decode_chunk, encode_chunk  # noqa: E402
from kvfetcher.decode_workers import DecodeWorkers  # noqa: E402
from kvfetcher.store.local import LocalStore  # noqa: E402

ROPE_THETA = 500000.0  # Llama-3's; used by pre-RoPE presets


def tile_real(real: torch.Tensor, layers: int, heads: int, tokens: int, head_dim: int) -> torch.Tensor:
    """Real KV ``[L', 2, H', T', D']`` -> ``[layers, 2, heads, tokens, head_dim]`` by cycling its
    layers, heads, channels and tokens (copies shifted in tokens, so no two are identical)."""
    L, _, H, T, D = real.shape
    li = torch.arange(layers) % L
    hi = torch.arange(heads) % H
    di = torch.arange(head_dim) % D
    copy = (torch.arange(heads) // H)[:, None] * 7 + (torch.arange(head_dim) // D)[None, :] * 13  # [heads, dim]
    ti = (torch.arange(tokens)[None, None, :] + copy[:, :, None]) % T  # [heads, dim, tokens]
    x = real[li][:, :, hi][:, :, :, :, di]  # [layers, 2, heads, T, head_dim]
    idx = ti.permute(0, 2, 1)[None, None].expand(layers, 2, heads, tokens, head_dim)
    return torch.gather(x, 3, idx).contiguous()


RAW_DIRECT = "raw-direct"


def ceilings(kv_chunk: torch.Tensor, buf: torch.Tensor, repeats: int = 5) -> dict:
    """What bounds the direct path on this machine: CRC-32 (ISA-L) on one core, and one chunk's
    host-to-buffer copy (from pinned memory on a GPU) into a strided view of the buffer."""
    from kvfetcher.container import crc32

    host = kv_chunk.contiguous().view(torch.uint8).reshape(-1)
    host = host.pin_memory() if buf.is_cuda else host
    mem, T = memoryview(host.numpy()), kv_chunk.shape[3]
    view = buf[:, :, :, :T]
    src = host.view(kv_chunk.dtype).view(kv_chunk.shape)
    crc_s, copy_s = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        crc32(mem)
        crc_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        view.copy_(src, non_blocking=True)
        if buf.is_cuda:
            torch.cuda.synchronize()
        copy_s.append(time.perf_counter() - t)
    n = host.numel()
    return {"crc32_GB_s_one_core": round(n / min(crc_s) / 1e9, 2),
            ("h2d_pinned_GB_s" if buf.is_cuda else "host_copy_GB_s"): round(n / min(copy_s) / 1e9, 2)}


async def fetch_once(store, refs, buf, device, window, decode_workers, workers=None):
    with ThreadPoolExecutor(16) as io, ThreadPoolExecutor(decode_workers) as dec:
        dest = pipeline.Destination(buf.tensor, tokens=sum(r.tokens for r in refs), handle=buf.handle)
        return await pipeline.fetch(store, refs, dest, fingerprint="bench", io_pool=io, decode_pool=dec, device=device,
                                    window=window, workers=workers)


def restored_bit_exact(buf: torch.Tensor, chunk_of, args) -> bool:
    T = args.chunk_tokens
    return all(torch.equal(buf[:, :, :, i * T : (i + 1) * T].cpu().view(torch.uint8), chunk_of(i).contiguous().view(torch.uint8))
               for i in range(args.chunks))


def linked(gbps: float):
    """An in-memory store behind an emulated link of ``gbps`` (bench/linkstore.py; it has no ``get_into``)."""
    from linkstore import Link, LinkStore

    return LinkStore(Link(gbps * 1e9 / 8))


def raw_direct(store, chunk_of, args, buf, kv_bytes: int) -> dict:
    """The plain baseline: KV bytes stored as they are, ranged GETs copied into the buffer (fetchkit)."""
    from fetchkit import fetch_raw_direct

    objs = [chunk_of(i).contiguous().view(torch.uint8).numpy().tobytes() for i in range(args.distinct or args.chunks)]
    refs = []
    for i in range(args.chunks):
        name = f"kv/{i}/{RAW_DIRECT}.bin"
        store.put(name, objs[i % len(objs)])
        refs.append(pipeline.ChunkRef(name, len(objs[i % len(objs)]), i * args.chunk_tokens, args.chunk_tokens))
    with ThreadPoolExecutor(16) as io:
        fetch_raw_direct(store, refs[:2], buf.tensor, 0, io, args.window)  # warm-up
        buf.tensor.zero_()
        secs = [fetch_raw_direct(store, refs, buf.tensor, 0, io, args.window) for _ in range(args.repeats)]
    med = statistics.median(secs)
    run = {"procs": None, "fetch_s": round(med, 4), "kv_GB_per_s": round(kv_bytes / med / 1e9, 3)}
    print(RAW_DIRECT, json.dumps(run), flush=True)
    return {"stored_bytes": sum(r.size for r in refs), "ratio": 1.0, "runs": [run], "restored_bit_exact": restored_bit_exact(buf.tensor, chunk_of, args)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--shape", default="30,3,64", help="layers,kv_heads,head_dim (default: SmolLM2-135M)")
    ap.add_argument("--presets", default="raw,exact,q8")
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--decode-workers", type=int, default=2, help="decode threads when --procs is 0")
    ap.add_argument("--procs", default="0", help="comma-separated decode worker process counts to compare (0: threads)")
    ap.add_argument("--kv", help="real KV tensor (torch.save) to tile into the shape")
    ap.add_argument("--kvsrc", help="real KV saved by bench/kvsource.py, tiled as the TTFT benchmark does (8B heads)")
    ap.add_argument("--distinct", type=int, default=0, help="encode only this many distinct chunks (0: all)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--link-gbps", type=float, default=0.0, help="objects behind an emulated link of this speed (0: a local directory)")
    args = ap.parse_args()
    layers, heads, head_dim = (int(x) for x in args.shape.split(","))
    tokens = args.chunks * args.chunk_tokens
    distinct = args.distinct or args.chunks
    if args.kvsrc:
        kv = torch.cat(kvsource.real_chunks(torch.load(args.kvsrc), distinct, layers), 3)
    elif args.kv:
        kv = tile_real(torch.load(args.kv).half(), layers, heads, distinct * args.chunk_tokens, head_dim)
    else:
        kv = synthetic_kv(layers=layers, heads=heads, tokens=distinct * args.chunk_tokens, head_dim=head_dim)
    kv_bytes = layers * 2 * heads * tokens * head_dim * kv.element_size()
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "date": time.strftime("%Y-%m-%d"),
               "kv": f"real ({args.kvsrc or args.kv}) tiled" if args.kvsrc or args.kv else "synthetic", "kv_bytes": kv_bytes, "chunks": args.chunks,
               "distinct_chunks": distinct, "chunk_tokens": args.chunk_tokens, "shape": [layers, heads, head_dim], "presets": {}}
    procs = [int(p) for p in args.procs.split(",")]
    pools = {p: DecodeWorkers(p) for p in procs if p}
    for w in pools.values():
        w.start()
    buf = ipc.allocate((layers, 2, heads, tokens, head_dim), kv.dtype, args.device)  # one buffer, as a model has
    chunk_of = lambda i: kv[:, :, :, (i % distinct) * args.chunk_tokens : (i % distinct + 1) * args.chunk_tokens]  # noqa: E731
    results["ceilings"] = ceilings(chunk_of(0), buf.tensor)
    print("ceilings", json.dumps(results["ceilings"]), flush=True)
    with tempfile.TemporaryDirectory() as d:
        store = linked(args.link_gbps) if args.link_gbps else LocalStore(d)
        results["store"] = f"emulated link {args.link_gbps} Gbit/s" if args.link_gbps else "local directory"
        for preset in args.presets.split(","):
            if preset == RAW_DIRECT:
                results["presets"][preset] = raw_direct(store, chunk_of, args, buf, kv_bytes)
                continue
            refs, stored, t = [], 0, time.perf_counter()
            objs = [encode_chunk(kv[:, :, :, i * args.chunk_tokens : (i + 1) * args.chunk_tokens].contiguous(), preset, "bench",
                                 start=i * args.chunk_tokens, rope_theta=ROPE_THETA) for i in range(distinct)]
            encode_s = time.perf_counter() - t
            for i in range(args.chunks):
                obj = objs[i % distinct]
                name = f"kv/{i}/{preset}.kvfc"
                store.put(name, obj)
                stored += len(obj)
                refs.append(pipeline.ChunkRef(name, len(obj), i * args.chunk_tokens, args.chunk_tokens))
            row = results["presets"][preset] = {"stored_bytes": stored, "ratio": round(kv_bytes / stored, 3),
                                                "encode_MB_s": round(distinct * kv_bytes / args.chunks / encode_s / 1e6, 1), "runs": []}
            for p in procs:
                w = pools.get(p)
                if w is not None:
                    w.stats = dict.fromkeys(w.stats, 0.0)
                asyncio.run(fetch_once(store, refs[:2], buf, args.device, args.window, args.decode_workers, w))  # warm-up
                secs = []
                with NvmlSampler() as util:
                    for _ in range(args.repeats):
                        out = asyncio.run(fetch_once(store, refs, buf, args.device, args.window, args.decode_workers, w))
                        assert out.error is None, out
                        secs.append(out.seconds)
                med = statistics.median(secs)
                run = {"procs": p, "fetch_s": round(med, 4), "kv_GB_per_s": round(kv_bytes / med / 1e9, 3),
                       "decode_busy_s": round(out.decode_busy_s, 4), "read_busy_s": round(out.read_busy_s, 4),
                       "direct_chunks": out.direct_chunks} | util.result()
                if w is not None and w.stats["chunks"]:  # where the workers' time went, per chunk (raw never uses them)
                    run["worker_ms_per_chunk"] = {k[:-2]: round(1e3 * v / w.stats["chunks"], 2) for k, v in w.stats.items() if k != "chunks"}
                row["runs"].append(run)
                print(preset, json.dumps(run), flush=True)
            if args.device == "cuda" or preset == "raw":  # what was restored is what was stored
                ref = torch.cat([decode_chunk(objs[i % distinct], "bench", args.device) for i in range(min(args.chunks, distinct))], 3)
                row["restored_matches_decode"] = bool(torch.equal(buf.tensor[:, :, :, : ref.shape[3]], ref))
            if preset == "raw":
                row["restored_bit_exact"] = restored_bit_exact(buf.tensor, chunk_of, args)
    buf.close()
    for w in pools.values():
        w.close()
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
