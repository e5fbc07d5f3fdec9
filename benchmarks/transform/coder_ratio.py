"""Ratio of the transform family's planes and balanced's under each coder, on the same real KV (CPU).

For ``balanced`` and ``transform`` (the same quantisation, so the same restored KV) on each model's
held-out texts of the five genres (``--tokens`` per prefix, 256-token chunks): the stored object
through lossless HEVC (x265, ``balanced`` only: the transform's order is not for video), through
zstd (``-zstd``: what a CPU stores), and the order-0 entropy of each 64 KiB block of the planes
plus the object's other bytes (a bound an ANS coder such as nvCOMP's approaches from below). Writes
``coder_ratio.json`` and ``coder_ratio.md`` beside this file.

    python -m benchmarks.transform.coder_ratio --tokens 1024
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch

from benchmarks.accuracy import accuracy_bench as ab
from kvfetcher import chunk
from kvfetcher.eval import model
from kvfetcher.format import container

OUT = Path(__file__).resolve().parent
TEXTS = ("heldout/legal.txt", "heldout/prose.txt", "heldout/code.txt", "heldout/tables.txt", "heldout/dialogue.txt")
BLOCK = 1 << 16


def order0_bytes(planes: torch.Tensor) -> float:
    """Sum over 64 KiB blocks of each block's order-0 entropy, in bytes."""
    flat, total = planes.reshape(-1), 0.0
    for a in range(0, flat.numel(), BLOCK):
        c = torch.bincount(flat[a : a + BLOCK].long(), minlength=256).double()
        p = c[c > 0] / c.sum()
        total += float(-(p * p.log2()).sum()) * c.sum().item() / 8
    return total


def measure(key: str, tokens: int) -> dict:
    lm = model.load(ab.FILES.get(key) or ab.MODELS[key]())
    theta = model.rope_theta(lm)
    sums = {n: 0.0 for n in ("balanced (HEVC)", "balanced-zstd", "balanced, order-0 per block", "transform-zstd", "transform, order-0 per block")}
    fp16 = 0
    for name in TEXTS:
        kv = model.prefill(lm, model.tokenize(lm, model.sample_text(name))[:tokens])[0].half()
        fp16 += kv.numel() * 2
        for s in range(0, kv.shape[3] - 255, 256):
            piece = kv[:, :, :, s : s + 256].contiguous()
            enc = lambda p: chunk.encode_chunk(piece, p, lm.fingerprint, start=s, rope_theta=theta)  # noqa: E731
            sums["balanced (HEVC)"] += len(enc("balanced"))
            for base in ("balanced", "transform"):
                obj = enc(f"{base}-zstd")
                sums[f"{base}-zstd"] += len(obj)
                h = container.parse_header(obj)
                frames = chunk.decode_verified(h, *_parts(obj, h)).frames
                coded = sum(seg.length for seg in h.segments)
                sums[f"{base}, order-0 per block"] += len(obj) - coded + order0_bytes(frames)
    return {"fingerprint": lm.fingerprint, "tokens": tokens, "texts": list(TEXTS), "ratio_vs_fp16": {n: fp16 / v for n, v in sums.items()}}


def _parts(obj: bytes, h):
    mem = memoryview(obj)
    part = lambda s: mem[h.header_size + s.offset : h.header_size + s.offset + s.length]  # noqa: E731
    return (part(h.side) if h.side else None), [part(s) for s in h.segments]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    res = {"date": datetime.date.today().isoformat(), "device": ab.device(), "models": {k: measure(k, args.tokens) for k in args.models.split(",")}}
    (OUT / "coder_ratio.json").write_text(json.dumps(res, indent=1) + "\n")
    names = list(next(iter(res["models"].values()))["ratio_vs_fp16"])
    rows = [f"Ratio vs fp16 per coder on the same planes ({res['date']}, {res['device']}; held-out texts of five genres, "
            f"{args.tokens}-token prefixes, 256-token chunks; `python -m benchmarks.transform.coder_ratio`):", "",
            "| model | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for k, m in res["models"].items():
        rows.append(f"| {k} | " + " | ".join(f"{m['ratio_vs_fp16'][n]:.2f}x" for n in names) + " |")
    (OUT / "coder_ratio.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
