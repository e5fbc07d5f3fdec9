"""Why lossless HEVC loses to zstd at 8 bits: bits per value of q8's samples, three ways.

On real KV (the shipped prompts, 256-token chunks, the q8 layout): the per-channel empirical
entropy of the quantised values (plug-in, biased low with 255 samples per channel: see
q8_lossless.py for estimates a coder can reach), zstd -9 on the same
bytes, and libx265 lossless at several speed presets — all in bits per value, side
information excluded.

    python -m research.q8_entropy [--prompts 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import zstandard

ROOT = Path(__file__).resolve().parent.parent

from kvfetcher.eval import accuracy, model
from kvfetcher.codec import layout
from kvfetcher.format import presets
from kvfetcher.codec.base import CodecParams
from kvfetcher.codec.pyav import X265Encoder
from kvfetcher.codec import tiling


def channel_entropy(q: torch.Tensor) -> float:
    """Mean over columns of the empirical entropy (bits) of ``q`` ``[tokens, channels]``."""
    total = 0.0
    for j in range(q.shape[1]):
        _, counts = torch.unique(q[:, j], return_counts=True)
        p = counts.double() / counts.sum()
        total += float(-(p * p.log2()).sum())
    return total / q.shape[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--speeds", default="ultrafast,fast,slow")
    ap.add_argument("--out", default=str(ROOT / "research" / "results" / "q8_entropy.json"))
    args = ap.parse_args()
    lm = model.load()
    p = presets.get("q8").layout
    values = ent = zbits = 0.0
    hevc = {s: 0.0 for s in args.speeds.split(",")}
    zc = zstandard.ZstdCompressor(level=9)
    for name, offset in accuracy.PROMPTS[: args.prompts]:
        ids, _ = accuracy.prompt_ids(lm, name, offset, 512)
        kv = model.prefill(lm, ids)[0].half()
        for s in range(0, kv.shape[3], 256):
            piece = kv[:, :, :, s : s + 256].contiguous()
            packed = layout.pack(piece, p)
            tiles = tiling.frames_to_tiles(packed.frames, packed.geometry, piece.shape[3], piece.shape[2] * piece.shape[4])
            n = tiles.numel()
            values += n
            ent += n * sum(channel_entropy(t) for t in tiles) / len(tiles)
            zbits += 8 * len(zc.compress(tiles.contiguous().numpy().tobytes()))
            for speed in hevc:
                hevc[speed] += 8 * len(X265Encoder().encode(packed.frames, CodecParams(lossless=True, speed=speed)))
    res = {
        "date": datetime.date.today().isoformat(),
        "device": "CPU",
        "prompts": [f"{n}@{o}" for n, o in accuracy.PROMPTS[: args.prompts]],
        "bits_per_value": {
            "per_channel_entropy": ent / values,
            "zstd_-9": zbits / values,
            **{f"x265_lossless_{s}": b / values for s, b in hevc.items()},
        },
    }
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    t = time.time()
    rc = main()
    print(f"{time.time() - t:.0f}s")
    sys.exit(rc)
