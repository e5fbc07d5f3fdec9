"""Restore into paged KV (vLLM's blocks) against a flat buffer: what the scatter into blocks costs.

Stores a prefix of an 8B-shaped model (bf16, synthetic values, a few distinct chunks cycled) in a
local directory, then times ``executor.fetch`` of it into four destinations on the GPU: a flat
buffer (the chunk's slots a plain view), vLLM FlashAttention's per-layer tensors (logical
``(blocks, kv_heads, block_size, 2 * head_dim)`` views of NHD memory, dims ``BHT(KD)``) and its
cross-layer tensor (``(blocks, layers, block_size, kv_heads, 2 * head_dim)``, dims ``BLTH(KD)``),
both with the prompt's blocks shuffled. ``raw`` takes the direct path (pinned host memory, a copy
to the device, then the scatter); a coded preset is decoded by decode worker processes that open
the paged tensors by CUDA IPC, unpack on the GPU and scatter. Every paged restore is checked
byte-identical to the flat one. Also times one chunk's scatter alone (``PagedKV.write`` of a
chunk already on the device). ``--neighbour-steps N`` runs the fetches beside another process that
steps on the same GPU N times a second as an idle vLLM engine does while a request waits for its KV
(each step waits for its last CUDA event and records a new one): whether another context's tiny GPU
work slows the restore. Prints and writes one JSON object.

    python -m benchmarks.paged_restore.paged_bench --out benchmarks/paged_restore/result_h100.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.lib.cpuload import busy_cores, cpu_jiffies
from benchmarks.lib import standin
from benchmarks.lib.fetchkit import FINGERPRINT, encode_objects, put_prefix
from kvfetcher import ipc, kvbuffer
from kvfetcher.eval.costmodel import SHAPES
from kvfetcher.fetch import executor
from kvfetcher.fetch.readers import ReadProcs, SharedStaging
from kvfetcher.fetch.workers import DecodeWorkers
from kvfetcher.format import mac
from kvfetcher.store.local import LocalStore


def destinations(shape, tokens: int, block_size: int, blocks: int, device: str):
    """name -> (tensors, layout or None, handle): a flat buffer and vLLM's two paged forms (with
    CUDA IPC handles for the decode workers on a GPU; none on a CPU, where threads decode)."""
    L, H, D = shape.layers, shape.kv_heads, shape.head_dim
    cuda = device == "cuda"
    flat = torch.zeros(L, 2, H, tokens, D, dtype=torch.bfloat16, device=device)
    per_layer = [torch.zeros(blocks, block_size, H, 2 * D, dtype=torch.bfloat16, device=device).permute(0, 2, 1, 3) for _ in range(L)]
    cross = torch.zeros(blocks, L, block_size, H, 2 * D, dtype=torch.bfloat16, device=device)
    out = {"flat": (flat, None, ipc.cuda_handle(flat) if cuda else None)}
    for name, tensors, dims in (("paged_per_layer", per_layer, "BHT(KD)"), ("paged_cross_layer", cross, "BLTH(KD)")):
        layout = kvbuffer.PagedLayout(dims, block_size)
        handles = [ipc.cuda_handle(t) for t in (tensors if isinstance(tensors, list) else [tensors])] if cuda else None
        out[name] = (tensors, layout, ipc.paged_handle(handles, layout) if cuda else None)
    return out


def restored(tensors, layout, block_ids, tokens: int) -> torch.Tensor:
    return tensors.clone() if layout is None else kvbuffer.read_blocks(tensors, layout, block_ids, 0, tokens)


def difference(got: torch.Tensor, ref: torch.Tensor) -> dict | None:
    """Where ``got`` ``[L, 2, H, T, D]`` differs from ``ref`` bit for bit (None: nowhere): the share
    of values, the tokens holding any (how many, the first), the (layer, k|v) pairs holding any, and
    the largest difference in units of the dtype's spacing at the reference value."""
    ne = got.view(torch.int16) != ref.view(torch.int16)
    if not ne.any():
        return None
    a, b = ref.float(), got.float()
    spacing = torch.finfo(ref.dtype).eps * a.abs().clamp_min(torch.finfo(ref.dtype).tiny)
    tokens = ne.any(dim=(0, 1, 2, 4)).nonzero().flatten().tolist()
    return {"values": float(f"{float(ne.float().mean()):.3g}"), "tokens": len(tokens), "first_token": tokens[0],
            "layer_kv": ne.any(dim=(2, 3, 4)).nonzero().tolist()[:8],
            "max_units": round(float(((a - b).abs() / spacing)[ne].max()), 1),
            "nan": bool(torch.isnan(b).any())}


def scatter_s(tensors, layout, block_ids, chunk: torch.Tensor, repeats: int = 20) -> float:
    """Seconds of one chunk's scatter into its blocks (device to device), median of ``repeats``."""
    kv = kvbuffer.PagedKV(tensors, layout)
    blocks = block_ids[: chunk.shape[3] // layout.block_size]
    times = []
    for _ in range(repeats):
        sync(chunk.device)
        t = time.perf_counter()
        kv.write(blocks, chunk)
        sync(chunk.device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def fetch(store, refs, dest, workers, io, dec, window: int, reads: int, readers=None, object_key=None):
    return await executor.fetch(store, refs, dest, fingerprint=FINGERPRINT, io_pool=io, decode_pool=dec, device=dest.device,
                                window=window, io_concurrency=reads, workers=workers, readers=readers, object_key=object_key)


def _step(rate: float, stop, steps) -> None:
    """An idle engine's steps on the GPU, ``rate`` a second (0: as fast as it can), until ``stop``."""
    event, gap = torch.cuda.Event(blocking=True), 1.0 / rate if rate > 0 else 0.0
    event.record()
    due = time.perf_counter()
    while not stop.is_set():
        event.synchronize()
        event.record()
        steps.value += 1
        due += gap
        time.sleep(max(0.0, due - time.perf_counter()))


@contextlib.contextmanager
def neighbour(rate: float | None):
    """Another process stepping on this GPU ``rate`` times a second while the block runs (None: none);
    yields a dict that gets its achieved ``steps_per_s``."""
    out: dict = {}
    if rate is None:
        yield out
        return
    ctx = multiprocessing.get_context("spawn")
    stop, steps = ctx.Event(), ctx.Value("q", 0)
    proc = ctx.Process(target=_step, args=(rate, stop, steps), daemon=True)
    proc.start()
    time.sleep(5)  # its CUDA context up and stepping
    t, n = time.perf_counter(), steps.value
    try:
        yield out
    finally:
        out["steps_per_s"] = round((steps.value - n) / (time.perf_counter() - t))
        stop.set()
        proc.join(10)


def tunings(text: str) -> list[tuple[int, int, int, int]]:
    """``"8x8x4,4x8x2x8"`` -> [(window, reads, decode threads, reader processes), ...] (reader
    processes 0 unless a fourth number gives them: ``KVFETCHER_READ_PROCS``)."""
    out = []
    for t in text.split(","):
        v = [int(x) for x in t.split("x")]
        if len(v) not in (3, 4):
            raise ValueError(f"a tuning is window x reads x decode threads [x reader processes], not {t!r}")
        out.append((*v, 0) if len(v) == 3 else tuple(v))
    return out


@contextlib.contextmanager
def reader_procs(store, procs: int):
    """``procs`` reader processes over ``store`` (:mod:`kvfetcher.fetch.readers`), or None for 0."""
    if not procs:
        yield None
        return
    readers = ReadProcs(store.opener(), procs, SharedStaging())
    try:
        yield readers
    finally:
        readers.close()


@contextlib.contextmanager
def object_store(source: str, root: str, server_procs: int | None = None):
    """(where objects are written, where they are read): a local directory, or the same objects read
    over S3 from the link server serving it (unpaced: the sidecar's own read path is measured, not a
    link) in ``server_procs`` processes (None: ``linkserver.default_procs()``)."""
    bucket = Path(root) / "kvbench"
    bucket.mkdir()
    if source == "local":
        yield LocalStore(bucket), LocalStore(bucket)
        return
    from benchmarks.lib import linkserver
    from kvfetcher.store.s3 import S3Store

    url, group = linkserver.start_process(root, 0.0, server_procs or linkserver.default_procs())
    try:
        yield LocalStore(bucket), S3Store(url, "kvbench", "bench", "bench", verify_tls=False)
    finally:
        group.terminate()


def fetch_all(dests, tokens, kv_bytes, block_ids, repeats, store, refs, workers, io, dec, window, reads, key, readers=None,
              object_key=None) -> dict:
    """Each destination: median fetch seconds of ``repeats`` after a warm-up, and whether it restored
    what the first one (the flat buffer, when timed) did."""
    row, first = {}, None
    for name, (tensors, layout, handle) in dests.items():
        dest = kvbuffer.destination(tensors if layout is None else kvbuffer.PagedKV(tensors, layout), tokens,
                                    block_ids=None if layout is None else block_ids, handle=handle)
        def run():
            out = asyncio.run(fetch(store, refs, dest, workers, io, dec, window, reads, readers, object_key))
            assert out.error is None and out.loaded_tokens == tokens, out
            return out

        run()  # warms workers, decoders and staging
        cpu0 = cpu_jiffies()
        outs = [run() for _ in range(repeats)]
        cpu = busy_cores(cpu0, cpu_jiffies())
        mid = sorted(outs, key=lambda o: o.seconds)[len(outs) // 2]  # the median run (the upper one of an even count)
        med = statistics.median(o.seconds for o in outs)
        got = restored(tensors, layout, block_ids, tokens)
        first = got if first is None else first
        differing = difference(got, first)
        row[name] = {"fetch_s": round(med, 4), "kv_GB_s": round(kv_bytes / med / 1e9, 2),
                     "identical_to_flat": differing is None, "differing_from_flat": differing,
                     "stages": executor.stage_summary(mid.timeline, mid.seconds), "cpu_busy_cores": cpu}
        print(key, name, json.dumps(row[name]), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu: a smoke run (threads decode)")
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--chunks", type=int, default=32, help="chunks of the prefix")
    ap.add_argument("--chunk-tokens", type=int, default=256, help="tokens a chunk (a store's KVFETCHER_CHUNK_TOKENS)")
    ap.add_argument("--presets", default="raw,balanced")
    ap.add_argument("--procs", type=int, default=8, help="decode worker processes for coded presets")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dests", default="flat,paged_per_layer,paged_cross_layer", help="destinations timed (flat first: the reference)")
    ap.add_argument("--tunings", default="8x8x4", help="window x reads x decode threads [x reader processes], comma-separated: each is timed")
    ap.add_argument("--source", default="local", choices=["local", "s3"], help="s3: the same objects over the link server, unpaced")
    ap.add_argument("--server-procs", type=int, help="s3: the link server's processes (default: half the cores, at most 8); "
                    "they share this machine's cores with the sidecar's, which remote storage would not")
    ap.add_argument("--neighbour-steps", type=float, help="another process steps on the GPU this many times a second "
                    "during the fetches, as an idle vLLM engine does (0: as fast as it can; unset: no neighbour)")
    ap.add_argument("--whole-bytes", help="the executor's WHOLE_OBJECT_BYTES, comma-separated: each is timed (0: an "
                    "entropy-coded chunk's header and parts read apart)")
    ap.add_argument("--basis", action="store_true", help="the stand-in calibration has a random orthogonal basis, so the "
                    "calibrated presets pack and restore through one (and the sparse corrections) as a calibrated model's do")
    ap.add_argument("--object-key", default="", help="a pool's object key (any secret): objects are tagged as a keyed "
                    "writer tags them and every part's tag is verified at fetch (format.mac)")
    ap.add_argument("--out")
    args = ap.parse_args()
    object_key = mac.key_from(args.object_key)
    shape, T = SHAPES[args.shape], args.chunk_tokens
    if args.basis:
        standin.ensure(FINGERPRINT, (shape.layers, 2, shape.kv_heads, T, shape.head_dim))
    tokens = args.chunks * T
    blocks = tokens // args.block_size + 64
    block_ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(0))[: tokens // args.block_size].tolist()
    kv_bytes = shape.kv_bytes_per_token() * tokens
    dests = destinations(shape, tokens, args.block_size, blocks, args.device)
    chunk = torch.randn(shape.layers, 2, shape.kv_heads, T, shape.head_dim, device=args.device).to(torch.bfloat16)
    cuda = args.device == "cuda"
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "date": time.strftime("%Y-%m-%d"), "shape": args.shape, "tokens": tokens,
              "kv_bytes": kv_bytes, "chunk_tokens": T, "block_size": args.block_size, "procs": args.procs, "source": args.source, "server_procs": args.server_procs, "basis": args.basis, "keyed": object_key is not None, "scatter_one_chunk": {},
              "fetch": {}}
    dests = {k: v for k, v in dests.items() if k in args.dests.split(",")}
    for name, (tensors, layout, _) in dests.items():
        if layout is not None:
            s = scatter_s(tensors, layout, block_ids, chunk)
            result["scatter_one_chunk"][name] = {"ms": round(s * 1e3, 3), "GB_s": round(chunk.numel() * 2 / s / 1e9, 1)}
    print("scatter", json.dumps(result["scatter_one_chunk"]), flush=True)
    wholes = [int(w) for w in args.whole_bytes.split(",")] if args.whole_bytes else [executor.WHOLE_OBJECT_BYTES]
    workers = DecodeWorkers(args.procs) if cuda and args.procs else None
    if workers is not None:
        workers.start()
    try:
        with (tempfile.TemporaryDirectory() as d, object_store(args.source, d, args.server_procs) as (writer, store), ThreadPoolExecutor(32) as io,
              neighbour(args.neighbour_steps if cuda else None) as beside):
            for preset in args.presets.split(","):
                refs = put_prefix(writer, preset, encode_objects(shape, preset, T, distinct=4, gpu=cuda), args.chunks, T, preset=preset,
                                  object_key=object_key)
                for (window, reads, threads, procs), whole in itertools.product(tunings(args.tunings), wholes):
                    key = preset if "," not in args.tunings else f"{preset} {window}x{reads}x{threads}" + (f"x{procs}" if procs else "")
                    key += f" whole<={whole}" if len(wholes) > 1 else ""
                    executor.WHOLE_OBJECT_BYTES = whole
                    with ThreadPoolExecutor(threads) as dec, reader_procs(store, procs) as readers:
                        result["fetch"][key] = fetch_all(dests, tokens, kv_bytes, block_ids, args.repeats, store, refs,
                                                         None if preset == "raw" else workers, io, dec, window, reads, key, readers,
                                                         object_key)
    finally:
        if workers is not None:
            workers.close()
    if beside:
        result["neighbour"] = beside
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
