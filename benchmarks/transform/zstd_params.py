"""The CPU zstd encoder's parameters on real quantised planes: size and speed per setting.

For each zstd preset (``q8``, ``balanced``, ``compact``, ``transform``; the transform also at every
step times 2.2, a point nearer the gate at long prefixes) on each model's held-out texts of the five
genres (``--tokens`` per prefix, 256-token chunks): the planes its layout makes, coded in 64 KiB
blocks by zstd level 3 (the encoder's setting before), level 19, and ``entropy.LITERAL_PARAMS``
(matches of at least 7 bytes, a tiny match table: almost only Huffman literals), against the
blocks' order-0 entropy (what an ideal order-0 coder such as ANS approaches). Bits per sample,
and encode / decode MB/s of planes in one CPU thread. Writes ``zstd_params.json`` and
``zstd_params.md`` beside this file.

    python -m benchmarks.transform.zstd_params --tokens 512
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

from benchmarks.accuracy import accuracy_bench as ab
from benchmarks.transform.coder_ratio import TEXTS, order0_bytes
from kvfetcher.codec import entropy, layout, rope
from kvfetcher.eval import model
from kvfetcher.format import presets

OUT = Path(__file__).resolve().parent
BLOCK = entropy.DEFAULT_BLOCK
CODERS = {"level 3": lambda: zstandard.ZstdCompressor(level=3), "level 19": lambda: zstandard.ZstdCompressor(level=19),
          "literals": lambda: entropy.compressor(None)}
POINTS = (("q8", 1.0), ("balanced", 1.0), ("compact", 1.0), ("transform", 1.0), ("transform", 2.2))


def planes(lm: model.LoadedModel, name: str, factor: float, kvs: list[torch.Tensor]) -> np.ndarray:
    """The planes preset ``name``'s layout (steps times ``factor``) makes of every 256-token chunk, concatenated."""
    p = presets.get(f"{name}-zstd", lm.fingerprint)
    lp = p.layout
    if lp.sigma_steps is not None:
        lp = dataclasses.replace(lp, sigma_steps=presets.scaled(lp.sigma_steps, factor))
    if p.pre_rope and lp.rope_theta is None:
        lp = dataclasses.replace(lp, rope_theta=rope.compact(rope.per_layer(model.rope_theta(lm), kvs[0].shape[0])))
    out = []
    for kv in kvs:
        for s in range(0, kv.shape[3] - 255, 256):
            chunk_lp = lp if s == 0 or not p.sink_exact_only else dataclasses.replace(lp, exact_tokens=0)
            out.append(layout.pack(kv[:, :, :, s : s + 256].contiguous(), chunk_lp, s).frames.reshape(-1).numpy())
    return np.concatenate(out)


def code(data: np.ndarray, cctx: zstandard.ZstdCompressor) -> tuple[int, float, float]:
    """(coded bytes, encode s, decode s) of ``data`` in 64 KiB blocks."""
    t = time.perf_counter()
    blocks = [cctx.compress(data[a : a + BLOCK].tobytes()) for a in range(0, data.size, BLOCK)]
    enc = time.perf_counter() - t
    dctx = zstandard.ZstdDecompressor()
    t = time.perf_counter()
    for b in blocks:
        dctx.decompress(b)
    return sum(map(len, blocks)), enc, time.perf_counter() - t


def measure(key: str, tokens: int) -> dict:
    lm = model.load(ab.FILES.get(key) or ab.MODELS[key]())
    kvs = [model.prefill(lm, model.tokenize(lm, model.sample_text(n))[:tokens])[0].half() for n in TEXTS]
    rows = {}
    for name, factor in POINTS:
        data = planes(lm, name, factor, kvs)
        row = {"order-0 per block": 8 * order0_bytes(torch.from_numpy(data)) / data.size}
        for coder, make in CODERS.items():
            size, enc, dec = code(data, make())
            row[coder] = {"bits_per_sample": 8 * size / data.size, "encode_mb_s": data.size / enc / 1e6, "decode_mb_s": data.size / dec / 1e6}
        rows[f"{name} x{factor:g}"] = row
    return {"fingerprint": lm.fingerprint, "tokens": tokens, "texts": list(TEXTS), "planes": rows}


def render(res: dict) -> str:
    lines = [f"Bits per sample of the zstd presets' planes under each CPU zstd setting ({res['date']}, {res['device']}; held-out texts of "
             f"five genres, {res['tokens']}-token prefixes, 256-token chunks, 64 KiB blocks; encode / decode MB/s of planes in one "
             "thread; `python -m benchmarks.transform.zstd_params`). `literals` is `entropy.LITERAL_PARAMS`, the encoder's "
             "setting when a preset names no level; `x2.2`: every step times 2.2.", "",
             "| model | planes | order-0 per block | level 3 | level 19 | literals | literals vs level 3 |", "|---|---|---|---|---|---|---|"]
    for key, m in res["models"].items():
        for pts, row in m["planes"].items():
            cell = lambda c: f"{row[c]['bits_per_sample']:.3f} ({row[c]['encode_mb_s']:.0f} / {row[c]['decode_mb_s']:.0f} MB/s)"  # noqa: E731
            gain = row["literals"]["bits_per_sample"] / row["level 3"]["bits_per_sample"] - 1
            lines.append(f"| {key} | {pts} | {row['order-0 per block']:.3f} | {cell('level 3')} | {cell('level 19')} | {cell('literals')} | {100 * gain:+.1f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    res = {"date": datetime.date.today().isoformat(), "device": ab.device(), "tokens": args.tokens,
           "models": {k: measure(k, args.tokens) for k in args.models.split(",")}}
    (OUT / "zstd_params.json").write_text(json.dumps(res, indent=1) + "\n")
    (OUT / "zstd_params.md").write_text(render(res))
    print(render(res))


if __name__ == "__main__":
    main()
