"""NVDEC decode + GPU restore benchmark (run on the GPU machine).

Inputs: stored chunk objects made on the CPU by ``benchmarks/codec/codec_bench.py --export DIR`` (real KV
of the shipped model) — and, for a serving-sized shape, a synthetic Llama-3-8B-shaped chunk
encoded here with libx265 (timing only: its values are random, its entropy like real q8).

For every object: NVDEC's restored KV must equal libavcodec's byte for byte. Then throughput of
decode + unpack into a preallocated GPU KV buffer, in fp16-equivalent GB/s, with 1..N worker
processes (threads of one process did not scale in the first probe), and NVDEC utilisation
sampled through NVML meanwhile.

    python -m benchmarks.codec.nvdec_bench --objects DIR --out results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.lib.nvml import run_workers

from kvfetcher.format import container
from kvfetcher.chunk import decode_chunk, encode_chunk


def _kv_bytes(obj: bytes) -> int:
    h = container.parse_header(obj)
    n = 1
    for s in h.shape:
        n *= s
    return n * 2


def _worker(objs: list[bytes], rounds: int, start, q):
    """Decode every object ``rounds`` times into a preallocated GPU buffer of its shape."""
    torch.cuda.init()
    buffers: dict[tuple, torch.Tensor] = {}
    dests = []
    for o in objs:  # outside the timed loop: one buffer per distinct chunk shape
        h = container.parse_header(o)
        key = (tuple(h.shape), h.torch_dtype)
        if key not in buffers:
            buffers[key] = torch.empty(h.shape, dtype=h.torch_dtype, device="cuda")
        dests.append(buffers[key])
    decode_chunk(objs[0], device="cuda", out=dests[0])  # warm-up
    torch.cuda.synchronize()
    start.wait()
    t = time.perf_counter()
    for _ in range(rounds):
        for o, out in zip(objs, dests):
            decode_chunk(o, device="cuda", out=out)
    torch.cuda.synchronize()
    q.put(time.perf_counter() - t)


def throughput(objs: list[bytes], procs: int, rounds: int) -> dict:
    times, wall, util = run_workers(_worker, (objs, rounds), procs)
    total = sum(_kv_bytes(o) for o in objs) * rounds * procs
    return {"procs": procs, "wall_s": wall, "gb_s": total / wall / 1e9, "slowest_worker_s": max(times)} | util


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--procs", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    files = sorted(Path(args.objects).glob("*.kvfc"))
    sets: dict[str, list[bytes]] = {}
    for f in files:
        sets.setdefault("real " + f.name.split("_")[1], []).append(f.read_bytes())

    # bit-exactness NVDEC vs CPU on every real object
    identical = total = 0
    for objs in sets.values():
        for o in objs:
            cpu = decode_chunk(o, backend="libavcodec")
            gpu = decode_chunk(o, device="cuda")
            identical += int(torch.equal(gpu.cpu().view(torch.uint8), cpu.view(torch.uint8)))
            total += 1

    # a serving-sized chunk: Llama-3-8B shape, 256 tokens, random values (timing only)
    g = torch.Generator().manual_seed(0)
    big = (torch.randn(32, 2, 8, 256, 128, generator=g) * 2).half()
    t = time.perf_counter()
    big_q8 = encode_chunk(big, "q8", "synthetic-llama3-8b")
    enc_s = time.perf_counter() - t
    sets["synthetic llama3-8b q8"] = [big_q8]

    res = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "nvdec_vs_cpu_identical": f"{identical}/{total}",
        "synthetic_encode_mb_s_cpu": big.numel() * 2 / 1e6 / enc_s,
        "runs": {},
    }
    for name, objs in sets.items():
        res["runs"][name] = {
            "objects": len(objs),
            "ratio_vs_fp16": sum(_kv_bytes(o) for o in objs) / sum(len(o) for o in objs),
            "by_procs": [throughput(objs, int(p), args.rounds) for p in args.procs.split(",")],
        }
        print(name, json.dumps(res["runs"][name]), flush=True)

    rows = ["| stream | ratio | procs | GB/s (fp16-equiv.) | NVDEC util mean / max % |", "|---|---|---|---|---|"]
    for name, r in res["runs"].items():
        for b in r["by_procs"]:
            rows.append(f"| {name} | {r['ratio_vs_fp16']:.2f}x | {b['procs']} | {b['gb_s']:.2f} | "
                        f"{b['nvdec_util_mean'] if b['nvdec_util_mean'] is None else round(b['nvdec_util_mean'])} / {b['nvdec_util_max']} |")
    res["summary_md"] = (f"NVDEC vs libavcodec restored KV identical for {identical}/{total} real objects.\n\n" + "\n".join(rows))
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(res["summary_md"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
