"""How fast can NVDEC restore KV? Feeding strategies x worker processes (run on the GPU machine).

A Llama-3-8B-shaped chunk (32 layers, 8 KV heads, head_dim 128, 256 tokens; random fp16
values, so timing only) is packed as q8 4:4:4 frames and encoded on the CPU once. Each worker
process then decodes it repeatedly for ``--seconds`` with NVDEC and unpacks into a GPU KV
buffer, either one call per segment (4 frames, one flush each) or with the segments of
``--batch`` chunks concatenated into one elementary stream (each segment starts with its own
parameter sets and IDR, so the concatenation is itself a valid stream: one flush per batch).

    python -m research.nvdec_throughput --out results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import torch

from kvfetcher.codec import layout
from kvfetcher.codec.base import CodecParams
from kvfetcher.codec.pyav import X265Encoder
from benchmarks.lib.nvml import run_workers

SHAPE = (32, 2, 8, 256, 128)
P = layout.LayoutParams(mode="quant")


def make_segments(seg_frames: int) -> tuple[list[bytes], torch.Tensor, tuple]:
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(*SHAPE, generator=g) * 2).half()
    packed = layout.pack(kv, P)
    f = packed.frames
    segs = [X265Encoder().encode(f[a : a + seg_frames], CodecParams()) for a in range(0, f.shape[0], seg_frames)]
    return segs, packed.side, tuple(f.shape)


def _worker(segs, side, fshape, seg_frames, batch, seconds, start, q):
    from kvfetcher.codec.nvidia import NvdecDecoder

    dec = NvdecDecoder(0)
    out = torch.empty(SHAPE, dtype=torch.float16, device="cuda")
    side = side.cuda()
    n, planes, h, w = fshape
    if batch == 0:  # one call per segment
        calls = [(s, (min(seg_frames, n - i * seg_frames), planes, h, w)) for i, s in enumerate(segs)]
        chunks_per_round = 1
    else:
        calls = [(b"".join(segs) * batch, (n * batch, planes, h, w))]
        chunks_per_round = batch

    def one_round():
        frames = [dec.decode(d, s, "cuda") for d, s in calls]
        allf = torch.cat(frames) if len(frames) > 1 else frames[0]
        for c in range(chunks_per_round):
            layout.unpack(allf[c * n : (c + 1) * n], side, SHAPE, torch.float16, P, out=out)

    one_round()
    torch.cuda.synchronize()
    start.wait()
    t0, done = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        one_round()
        done += chunks_per_round
    torch.cuda.synchronize()
    q.put((done, time.perf_counter() - t0))


def run(segs, side, fshape, seg_frames, batch, procs, seconds) -> dict:
    res, wall, util = run_workers(_worker, (segs, side, fshape, seg_frames, batch, seconds), procs)
    chunk_bytes = math.prod(SHAPE) * 2
    total = sum(d for d, _ in res) * chunk_bytes
    return {"batch": batch, "procs": procs, "gb_s": total / wall / 1e9, "wall_s": wall} | util


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--procs", default="1,4,8,12")
    ap.add_argument("--batches", default="0,8")
    ap.add_argument("--seg-frames", type=int, default=4)
    args = ap.parse_args()
    segs, side, fshape = make_segments(args.seg_frames)
    res = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(0), "shape": SHAPE,
           "frame_shape": fshape, "bitstream_bytes": sum(map(len, segs)), "runs": []}
    for b in [int(x) for x in args.batches.split(",")]:
        for p in [int(x) for x in args.procs.split(",")]:
            r = run(segs, side, fshape, args.seg_frames, b, p, args.seconds)
            res["runs"].append(r)
            print(json.dumps(r), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
