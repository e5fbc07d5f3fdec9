"""Fetch pipeline throughput: N stored chunks -> KV buffer (CPU, or CUDA with NVDEC), per preset.

Stores KV of a model shape in a local directory (so the link is not the limit), then times
``executor.fetch`` into a buffer on the chosen device: decoding in threads (``--procs 0``) or
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

``--kvsrc`` at the source model's own shape (``--shape 30,3,64``: SmolLM2-135M) stores its real
KV as that model's server would (``kvsource.own_chunks``: keys rotated with its own RoPE base);
with ``--fingerprint`` naming the model (``smollm2-135m...``) the presets' shipped basis is kept,
which every other run drops (``chunk.encode_chunk``). Each preset row records the stored
header's basis and frame shape. Before timing, each preset is fetched once whole, so every decode
worker process has started its CUDA context and decoders; worker statistics count the timed
repeats only.

    python -m benchmarks.restore_rate.fetch_bench --device cuda --chunks 64 --shape 32,8,128 --kv real.pt --procs 0,8 --presets raw,raw-direct,q8,lean
    python -m benchmarks.restore_rate.fetch_bench --device cuda --chunks 64 --shape 30,3,64 --kvsrc kvsrc.pt --distinct 2 \
        --fingerprint smollm2-135m-instruct-q4_1/float32 --procs 8 --presets balanced,compact --max-rows 4096
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.lib import kvsource
from benchmarks.lib.fetchkit import fetch_once
from benchmarks.lib.kvsource import synthetic_kv
from benchmarks.lib.nvml import NvmlSampler

from kvfetcher.format import container, presets
from kvfetcher import ipc
from kvfetcher import kvbuffer
from kvfetcher.fetch import executor
from kvfetcher.chunk import decode_chunk
from benchmarks.lib.standin import encode_chunk  # a stand-in calibration for random-weight shapes
from kvfetcher.fetch.workers import DecodeWorkers
from kvfetcher.store.local import LocalStore

ROPE_THETA = kvsource.LLAMA3_THETA  # of the tiled and synthetic KV; used by pre-RoPE presets


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
    from kvfetcher.format.container import crc32

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


def preset_with(name: str, max_rows: int | None) -> presets.Preset:
    """A preset, its planes ``max_rows`` tall if given (the header stores the layout, so decoding needs nothing else)."""
    p = presets.get(name)
    if max_rows is None or p.layout.mode == "native":
        return p
    return dataclasses.replace(p, layout=dataclasses.replace(p.layout, max_rows=max_rows))


def check_basis(p: presets.Preset, h: container.Header, fingerprint: str) -> None:
    """Stop if the fingerprint names the preset basis' model but the stored chunk dropped the
    basis (its shape does not fit): the run would not measure what was asked for."""
    if p.layout.basis and fingerprint.startswith(p.layout.basis.rsplit("-", 1)[0]) and h.layout.basis is None:
        raise SystemExit(f"{p.name}: basis {p.layout.basis} dropped for KV of shape {list(h.shape)}")


def restored_bit_exact(buf: torch.Tensor, chunk_of, args) -> bool:
    T = args.chunk_tokens
    return all(torch.equal(buf[:, :, :, i * T : (i + 1) * T].cpu().view(torch.uint8), chunk_of(i).contiguous().view(torch.uint8))
               for i in range(args.chunks))


def linked(gbps: float):
    """An in-memory store behind an emulated link of ``gbps`` (benchmarks/lib/linkstore.py; it has no ``get_into``)."""
    from benchmarks.lib.linkstore import Link, LinkStore

    return LinkStore(Link(gbps * 1e9 / 8))


def raw_direct(store, chunk_of, args, buf, kv_bytes: int) -> dict:
    """The plain baseline: KV bytes stored as they are, ranged GETs copied into the buffer (fetchkit)."""
    from benchmarks.lib.fetchkit import fetch_raw_direct

    objs = [chunk_of(i).contiguous().view(torch.uint8).numpy().tobytes() for i in range(args.distinct or args.chunks)]
    refs = []
    for i in range(args.chunks):
        name = f"kv/{i}/{RAW_DIRECT}.bin"
        store.put(name, objs[i % len(objs)])
        refs.append(kvbuffer.ChunkRef(name, len(objs[i % len(objs)]), i * args.chunk_tokens, args.chunk_tokens))
    with ThreadPoolExecutor(16) as io:
        fetch_raw_direct(store, refs, buf.tensor, 0, io, args.window)  # warm-up
        buf.tensor.zero_()
        secs = [fetch_raw_direct(store, refs, buf.tensor, 0, io, args.window) for _ in range(args.repeats)]
    med = statistics.median(secs)
    run = {"procs": None, "fetch_s": round(med, 4), "fetch_s_each": [round(x, 4) for x in secs], "kv_GB_per_s": round(kv_bytes / med / 1e9, 3)}
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
    ap.add_argument("--kv", help="real KV tensor (torch.save) to tile into the shape (pre-RoPE presets take its keys "
                    "as rotated with Llama-3's base; a model's own KV at its shape: --kvsrc)")
    ap.add_argument("--kvsrc", help="real KV saved by benchmarks/lib/kvsource.py: at its own shape as it is, at 8B heads tiled as the TTFT benchmark does")
    ap.add_argument("--fingerprint", default="bench", help="the chunks' model fingerprint; one starting with a shipped basis' "
                    "model tag (smollm2-135m) keeps the basis where the KV's shape fits it")
    ap.add_argument("--max-rows", type=int, help="stack tiles until a plane is this tall (default: each preset's layout)")
    ap.add_argument("--distinct", type=int, default=0, help="encode only this many distinct chunks (0: all)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--link-gbps", type=float, default=0.0, help="objects behind an emulated link of this speed (0: a local directory)")
    args = ap.parse_args()
    layers, heads, head_dim = (int(x) for x in args.shape.split(","))
    tokens = args.chunks * args.chunk_tokens
    distinct = args.distinct or args.chunks
    rope_theta, kv_desc = ROPE_THETA, "synthetic"
    if args.kvsrc:
        src = torch.load(args.kvsrc)
        own = tuple(src["kv"].shape[i] for i in (1, 3, 5))
        if (layers, heads, head_dim) == own:
            kv = torch.cat(kvsource.own_chunks(src, distinct, args.chunk_tokens), 3)
            rope_theta, kv_desc = src["source_theta"], f"real ({args.kvsrc}) at its own shape"
        else:
            kv = torch.cat(kvsource.real_chunks(src, distinct, layers), 3)
            kv_desc = f"real ({args.kvsrc}) tiled"
    elif args.kv:
        kv = tile_real(torch.load(args.kv).half(), layers, heads, distinct * args.chunk_tokens, head_dim)
        kv_desc = f"real ({args.kv}) tiled"
    else:
        kv = synthetic_kv(layers=layers, heads=heads, tokens=distinct * args.chunk_tokens, head_dim=head_dim)
    kv_bytes = layers * 2 * heads * tokens * head_dim * kv.element_size()
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "date": time.strftime("%Y-%m-%d"),
               "kv": kv_desc, "kv_bytes": kv_bytes, "chunks": args.chunks, "distinct_chunks": distinct, "chunk_tokens": args.chunk_tokens,
               "shape": [layers, heads, head_dim], "fingerprint": args.fingerprint, "rope_theta": rope_theta, "max_rows": args.max_rows,
               "presets": {}}
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
            p = preset_with(preset, args.max_rows)
            refs, stored, t = [], 0, time.perf_counter()
            objs = [encode_chunk(kv[:, :, :, i * args.chunk_tokens : (i + 1) * args.chunk_tokens].contiguous(), p, args.fingerprint,
                                 start=i * args.chunk_tokens, rope_theta=rope_theta) for i in range(distinct)]
            encode_s = time.perf_counter() - t
            h = container.parse_header(objs[0])
            check_basis(p, h, args.fingerprint)
            for i in range(args.chunks):
                obj = objs[i % distinct]
                name = f"kv/{i}/{preset}.kvfc"
                store.put(name, obj)
                stored += len(obj)
                refs.append(kvbuffer.ChunkRef(name, len(obj), i * args.chunk_tokens, args.chunk_tokens))
            row = results["presets"][preset] = {"stored_bytes": stored, "ratio": round(kv_bytes / stored, 3),
                                                "encode_MB_s": round(distinct * kv_bytes / args.chunks / encode_s / 1e6, 1),
                                                "basis": h.layout.basis, "frame_shape": list(h.frame_shape), "runs": []}
            print(preset, "basis", row["basis"], "frames", row["frame_shape"], flush=True)
            for n in procs:
                w = pools.get(n)
                fetch_args = (store, refs, buf, args.device, args.window, args.decode_workers, w, args.fingerprint)
                out = asyncio.run(fetch_once(*fetch_args))  # warm-up: every chunk once, so every worker process has decoded
                assert out.error is None, out
                if w is not None:
                    w.stats = dict.fromkeys(w.stats, 0.0)
                secs = []
                with NvmlSampler() as util:
                    for _ in range(args.repeats):
                        out = asyncio.run(fetch_once(*fetch_args))
                        assert out.error is None, out
                        secs.append(out.seconds)
                med = statistics.median(secs)
                run = {"procs": n, "fetch_s": round(med, 4), "fetch_s_each": [round(x, 4) for x in secs], "kv_GB_per_s": round(kv_bytes / med / 1e9, 3),
                       "decode_busy_s": round(out.decode_busy_s, 4), "read_busy_s": round(out.read_busy_s, 4),
                       "direct_chunks": out.direct_chunks} | util.result()
                if w is not None and w.stats["chunks"]:  # where the workers' time went, per chunk (raw never uses them)
                    run["worker_ms_per_chunk"] = {k[:-2]: round(1e3 * v / w.stats["chunks"], 2) for k, v in w.stats.items() if k != "chunks"}
                row["runs"].append(run)
                print(preset, json.dumps(run), flush=True)
            if args.device == "cuda" or preset == "raw":  # what was restored is what was stored
                ref = torch.cat([decode_chunk(objs[i % distinct], args.fingerprint, args.device) for i in range(min(args.chunks, distinct))], 3)
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
