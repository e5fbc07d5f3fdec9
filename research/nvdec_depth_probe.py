"""Does NVDEC decode HEVC 4:4:4 12-bit (two 6-bit KV values per sample) bit-exactly, and how fast?

Decode time on NVDEC follows samples, not bits (FACTS.md), so packing two 6-bit values into
each 12-bit sample could double the values restored per second. This probe encodes the same
real quantised KV values (a ``.npy`` of 6-bit tiles) both ways — 8-bit samples holding one
value, 12-bit samples holding two — as lossless 4:4:4 1024x1024 frames, checks NVDEC's output
against the source, and times decoding in N worker processes (NVML utilisation alongside).

    python -m research.nvdec_depth_probe --tiles q6_tiles.npy --out depth.json
"""

from __future__ import annotations

import argparse
import datetime
import fractions
import json
import sys
import time
from pathlib import Path

import av
import numpy as np
import torch

from benchmarks.lib.nvml import run_workers

SIDE = 1024


def frames_from(values: np.ndarray, depth: int) -> np.ndarray:
    """Flat 6-bit values -> [n, 3, SIDE, SIDE] samples (uint16 for 12-bit: hi<<6 | lo)."""
    per_frame = 3 * SIDE * SIDE * (2 if depth == 12 else 1)
    n = len(values) // per_frame
    v = values[: n * per_frame].astype(np.uint16)
    if depth == 12:
        v = v.reshape(n, 2, 3, SIDE, SIDE)
        return (v[:, 0] << 6) | v[:, 1]
    return v.reshape(n, 3, SIDE, SIDE).astype(np.uint8)


def encode(frames: np.ndarray, depth: int) -> bytes:
    fmt = "yuv444p12le" if depth == 12 else "yuv444p"
    ctx = av.CodecContext.create("libx265", "w")
    ctx.width = ctx.height = SIDE
    ctx.pix_fmt = fmt
    ctx.time_base = fractions.Fraction(1, 25)
    ctx.options = {"preset": "fast", "x265-params": "log-level=error:lossless=1:repeat-headers=1:keyint=1000:bframes=0"}
    out = bytearray()
    for i, f in enumerate(frames):
        vf = av.VideoFrame(SIDE, SIDE, fmt)
        for p in range(3):
            vf.planes[p].update(np.ascontiguousarray(f[p]).tobytes())
        vf.pts = i
        out += b"".join(bytes(p) for p in ctx.encode(vf))
    out += b"".join(bytes(p) for p in ctx.encode(None))
    return bytes(out)


def decode_all(data: bytes, dec, n: int) -> list[torch.Tensor]:
    import PyNvVideoCodec as nvc

    buf = np.frombuffer(data, np.uint8)
    pkt = nvc.PacketData()
    pkt.bsl_data, pkt.bsl = buf.ctypes.data, buf.size
    eos = nvc.PacketData()
    eos.bsl_data, eos.bsl = 0, 0
    out = [torch.from_dlpack(f).clone() for f in dec.Decode(pkt)]
    out += [torch.from_dlpack(f).clone() for f in dec.Decode(eos)]
    return out


def make_decoder():
    import PyNvVideoCodec as nvc

    return nvc.CreateDecoder(gpuid=0, codec=nvc.cudaVideoCodec.HEVC, cudacontext=0,
                             cudastream=torch.cuda.current_stream().cuda_stream, usedevicememory=True,
                             outputColorType=nvc.OutputColorType.NATIVE)


def _worker(data, n, seconds, start, q):
    import PyNvVideoCodec as nvc

    dec = make_decoder()
    buf = np.frombuffer(data, np.uint8)
    eos = nvc.PacketData()
    eos.bsl_data, eos.bsl = 0, 0

    def once():
        pkt = nvc.PacketData()
        pkt.bsl_data, pkt.bsl = buf.ctypes.data, buf.size
        got = 0
        for f in list(dec.Decode(pkt)) + list(dec.Decode(eos)):
            torch.from_dlpack(f)  # touch it as the restore would
            got += 1
        assert got == n, got

    once()
    torch.cuda.synchronize()
    start.wait()
    t0, rounds = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        once()
        rounds += 1
    torch.cuda.synchronize()
    q.put(rounds)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--procs", default="1,8")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeat", type=int, default=8)
    args = ap.parse_args()
    tiles = np.load(args.tiles)  # [n_tiles, tokens, channels] of 6-bit values
    rng = np.random.default_rng(0)  # more frames: the same tiles in other orders (no repeats to copy)
    values = np.concatenate([tiles[rng.permutation(len(tiles))].reshape(-1) for _ in range(args.repeat)])
    res = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(0), "runs": []}
    for depth in (8, 12):
        frames = frames_from(values, depth)
        n = len(frames)
        t = time.perf_counter()
        data = encode(frames, depth)
        enc_s = time.perf_counter() - t
        nvals = frames.size * (2 if depth == 12 else 1)
        got = decode_all(data, make_decoder(), n)
        info = {"depth": depth, "frames": n, "values": nvals, "bits_per_value": len(data) * 8 / nvals,
                "encode_s": enc_s, "out_dtype": str(got[0].dtype), "out_shape": list(got[0].shape)}
        src = torch.from_numpy(frames.astype(np.int32)).cuda()
        dec = torch.stack([g.reshape(g.shape[0], -1) for g in got])
        if dec.dtype == torch.uint8 and depth == 12:  # bytes of little-endian uint16
            dec = dec.view(torch.int16)
        dec = dec.to(torch.int32).reshape(n, 3, SIDE, -1)[..., :SIDE]
        for shift in (0, 4):
            if torch.equal((dec >> shift) & 0xFFF, src):
                info["exact_shift"] = shift
        print(json.dumps(info), flush=True)
        for p in [int(x) for x in args.procs.split(",")]:
            rounds, wall, util = run_workers(_worker, (data, n, args.seconds), p)
            r = {"depth": depth, "procs": p, "values_per_s": sum(rounds) * nvals / wall,
                 "fp16_GB_s": sum(rounds) * nvals * 2 / wall / 1e9} | util
            res["runs"].append(info | r)
            print(json.dumps(r), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
