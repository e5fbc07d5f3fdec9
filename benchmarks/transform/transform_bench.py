"""The transform family's speed on a GPU: store-time encode and end-to-end restore, GB/s of fp16 KV.

Llama-3-8B-shaped chunks (32 layers, 8 KV heads, head_dim 128, 256 tokens: 33.5 MB of fp16) of
real KV tiled from SmolLM2's (``benchmarks.lib.kvsource``, ``--kvsrc``; without it synthetic KV,
whose ratios mean nothing). The model is given a stand-in calibration (the shipped model's step
tables) with a random orthogonal basis per (layer, K|V, head), so the pack and the restore do all
of a calibrated model's work: basis, pre-RoPE keys, trellis, sparse corrections, the components'
sort. For ``transform-ans`` and ``balanced-ans`` (the same quantisation, planes in tile order):

* encode: ``chunk.encode_chunk`` of chunks already on the GPU (pack, nvCOMP ANS, coded bytes to
  the host, the container), one after another in one thread, and in ``--encode-threads`` threads
  (a writer with several chunks queued); the pack alone too; with ``--encode-procs``, in that many
  processes at once, each encoding its own copy of the chunks (how far processes scale);
* restore: ``executor.fetch`` of a ``--chunks``-chunk prefix from an in-memory store into a GPU
  KV buffer (verify, nvCOMP decode, the sort undone, the fused unpack), every chunk checked bit
  for bit against its own object's decode; ``raw``'s direct path through the same executor for
  reference.

Medians of ``--repeats`` after a warm-up. Prints one JSON line per row; ``--out`` writes the result.

    python -m benchmarks.transform.transform_bench --kvsrc .bench/kvsrc.pt --out $OUT/transform_h200.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.entropy.entropy_bench import bit_exact, restore, timed
from benchmarks.lib import kvsource, standin
from kvfetcher import chunk
from kvfetcher.codec import layout, nvcomp
from kvfetcher.format import container

FP = "transform-bench/8b"
THETA = kvsource.LLAMA3_THETA


def encode_rate(kvs: list[torch.Tensor], name: str, threads: int, repeats: int) -> tuple[float, list[bytes]]:
    T = kvs[0].shape[3]

    def one(i: int) -> bytes:
        return chunk.encode_chunk(kvs[i], name, FP, start=i * T, rope_theta=THETA)

    def all_of() -> list[bytes]:
        if threads == 1:
            return [one(i) for i in range(len(kvs))]
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(one, range(len(kvs))))

    sec, objs = timed(lambda: (all_of(), torch.cuda.synchronize())[0], repeats)
    return sum(k.numel() * 2 for k in kvs) / sec / 1e9, objs


def _encode_proc(kvsrc: str, distinct: int, name: str, rounds: int, barrier, out) -> None:
    """One encode process: its own chunks on the GPU, one warm-up round, then ``rounds`` rounds
    started together with the other processes; puts (first start, last end, KV bytes)."""
    kvs, _ = kvsource.gpu_chunks(kvsrc, distinct)
    T = kvs[0].shape[3]
    for i, kv in enumerate(kvs):
        chunk.encode_chunk(kv, name, FP, start=i * T, rope_theta=THETA)
    torch.cuda.synchronize()
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(rounds):
        for i, kv in enumerate(kvs):
            chunk.encode_chunk(kv, name, FP, start=i * T, rope_theta=THETA)
    torch.cuda.synchronize()
    out.put((t0, time.perf_counter(), rounds * sum(k.numel() * 2 for k in kvs)))


def encode_procs_rate(kvsrc: str, distinct: int, name: str, procs: int, rounds: int = 4) -> float:
    """GB/s of KV that ``procs`` processes encode together (each a GIL and a CUDA context of its own,
    as the sidecar's decode workers restore), from the first start to the last end."""
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_encode_proc, args=(kvsrc, distinct, name, rounds, barrier, out)) for _ in range(procs)]
    for p in ps:
        p.start()
    got = [out.get(timeout=600) for _ in ps]
    for p in ps:
        p.join()
    return sum(n for _, _, n in got) / (max(e for _, e, _ in got) - min(s for s, _, _ in got)) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvsrc", default=".bench/kvsrc.pt")
    ap.add_argument("--presets", default="transform-ans,balanced-ans")
    ap.add_argument("--distinct", type=int, default=8, help="distinct chunks encoded (and cycled along the restored prefix)")
    ap.add_argument("--chunks", type=int, default=64, help="chunks of the restored prefix (64: 16K tokens, 2.1 GB)")
    ap.add_argument("--encode-threads", type=int, default=4)
    ap.add_argument("--encode-procs", default="", help="also encode in this many processes at once, comma-separated (e.g. 2,4,8)")
    ap.add_argument("--decode-threads", type=int, default=4)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not nvcomp.available():
        raise SystemExit("needs a CUDA GPU and nvCOMP (pip install nvidia-nvcomp-cu13 nvidia-libnvcomp-cu13)")
    kvs, kv_desc = kvsource.gpu_chunks(args.kvsrc, args.distinct)
    standin.ensure(FP, tuple(kvs[0].shape))
    L, _, H, T, D = kvs[0].shape
    buf = torch.zeros(L, 2, H, args.chunks * T, D, dtype=torch.float16, device="cuda")
    kv_bytes = sum(k.numel() * 2 for k in kvs)
    rows = []
    for name in ["raw", *args.presets.split(",")]:
        row = {"preset": name}
        row["encode_GB_s_1_thread"], objs = encode_rate(kvs, name, 1, args.repeats)
        if name != "raw":
            row[f"encode_GB_s_{args.encode_threads}_threads"], _ = encode_rate(kvs, name, args.encode_threads, args.repeats)
            lps = [container.parse_header(o).layout for o in objs]
            pack_s, _ = timed(lambda: ([layout.pack(k, lp, i * T) for i, (k, lp) in enumerate(zip(kvs, lps))], torch.cuda.synchronize()),
                              args.repeats)
            row["pack_GB_s"] = kv_bytes / pack_s / 1e9
            for n in filter(None, args.encode_procs.split(",")):
                row[f"encode_GB_s_{n}_procs"] = encode_procs_rate(args.kvsrc, args.distinct, name, int(n))
        row["ratio"] = kv_bytes / sum(len(o) for o in objs)
        sec, each = restore(objs, args.chunks, buf, args.decode_threads, args.window, args.repeats, fingerprint=FP)
        row.update(restore_GB_s=buf.numel() * 2 / sec / 1e9, restore_s_each=[round(s, 4) for s in each],
                   restored_bit_exact=bit_exact(objs, args.chunks, buf, fingerprint=FP))
        row = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "kv": kv_desc, "chunk_shape": [L, 2, H, T, D],
              "prefix_tokens": args.chunks * T, "decode_threads": args.decode_threads, "window": args.window,
              "encode_threads": args.encode_threads, "rows": rows}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
