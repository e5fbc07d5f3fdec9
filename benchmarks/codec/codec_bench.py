"""Codec benchmark on real KV (SmolLM2-135M, the shipped prompt set), CPU side.

Per preset: size ratio vs fp16 (headers and side information counted), encode and decode
throughput in fp16-equivalent MB/s on this machine's CPU, greedy agreement and NLL increase
over the shipped prompts. Beside the presets, the same quantised bytes through zstd -9 (the
lossless general-purpose baseline q8 has to beat). NVDEC figures come from
benchmarks/codec/nvdec_bench.py on a GPU machine and are merged in with ``--nvdec-json``.

    python -m benchmarks.codec.codec_bench [--tokens 512] [--export DIR] [--nvdec-json FILE]

Writes result_cpu.json and result_cpu.md beside it, and the package's presets_measured.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import zstandard

from kvfetcher.eval import accuracy, model
from kvfetcher.codec import layout
from kvfetcher.format import presets
from kvfetcher.chunk import encode_chunk
from kvfetcher.codec import tiling

OUT = Path(__file__).resolve().parent  # result_cpu.json / .md beside this file


def zstd_on_quantised(kvs: list[torch.Tensor], chunk_tokens: int) -> dict:
    """q8's exact quantised bytes (and side info) through zstd -9: the bar q8's HEVC must clear."""
    zc = zstandard.ZstdCompressor(level=9)
    p = presets.get("q8").layout
    fp16 = stored = 0
    t_enc = 0.0
    for kv in kvs:
        for s in range(0, kv.shape[3], chunk_tokens):
            piece = kv[:, :, :, s : s + chunk_tokens].contiguous()
            packed = layout.pack(piece, p)
            t = time.perf_counter()
            # the planes hold padding; zstd gets only the real values, in the same token-major order
            q = tiling.frames_to_tiles(packed.frames, packed.geometry, piece.shape[3], piece.shape[2] * piece.shape[4])
            z = zc.compress(q.contiguous().numpy().tobytes())
            t_enc += time.perf_counter() - t
            stored += len(z) + packed.side.numel() * packed.side.element_size()
            fp16 += piece.numel() * 2
    return {"ratio_vs_fp16": fp16 / stored, "encode_mb_s": fp16 / 1e6 / t_enc}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores (shared), torch {torch.__version__}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--presets", default=",".join(presets.PRESETS))
    ap.add_argument("--export", help="also write each prompt's stored chunks here (for the NVDEC bench)")
    ap.add_argument("--export-prompts", type=int, default=2)
    ap.add_argument("--nvdec-json", help="merge NVDEC results from benchmarks/codec/nvdec_bench.py")
    args = ap.parse_args()

    lm = model.load()
    results: dict = {
        "date": datetime.date.today().isoformat(),
        "device": machine(),
        "model": lm.fingerprint,
        "tokens_per_prompt": args.tokens,
        "chunk_tokens": args.chunk_tokens,
        "prompts": [f"{n}@{o}" for n, o in accuracy.PROMPTS],
        "presets": {},
    }
    for name in args.presets.split(","):
        t = time.perf_counter()
        s = accuracy.evaluate(name, tokens=args.tokens, chunk_tokens=args.chunk_tokens).summary()
        s["wall_s"] = time.perf_counter() - t
        results["presets"][name] = s
        print(f"{name}: ratio {s['ratio_vs_fp16']:.3f} agreement {s['greedy_agreement']:.3f} "
              f"nll +{100 * s['nll_increase']:.3f}% enc {s['encode_mb_s']:.1f} MB/s dec {s['decode_mb_s']:.1f} MB/s", flush=True)

    kvs = []
    for n, o in accuracy.PROMPTS:
        ids, _ = accuracy.prompt_ids(lm, n, o, args.tokens)
        kvs.append(model.prefill(lm, ids)[0].half())
    results["zstd_q8_bytes"] = zstd_on_quantised(kvs, args.chunk_tokens)
    print("zstd on q8 bytes:", results["zstd_q8_bytes"])

    if args.export:
        exp = Path(args.export)
        exp.mkdir(parents=True, exist_ok=True)
        for i, kv in enumerate(kvs[: args.export_prompts]):
            for name in ("exact", "q8"):
                for s in range(0, kv.shape[3], args.chunk_tokens):
                    obj = encode_chunk(kv[:, :, :, s : s + args.chunk_tokens].contiguous(), name, lm.fingerprint)
                    (exp / f"p{i}_{name}_{s:05d}.kvfc").write_bytes(obj)
    if args.nvdec_json:
        results["nvdec"] = json.loads(Path(args.nvdec_json).read_text())

    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "result_cpu.json").write_text(json.dumps(results, indent=2))
    (OUT / "result_cpu.md").write_text(render_md(results))
    measured = {
        k: {f: v[f] for f in ("ratio_vs_fp16", "greedy_agreement", "nll_increase", "encode_mb_s", "decode_mb_s")}
        | {"date": results["date"]}
        for k, v in results["presets"].items()
    }
    presets.MEASURED_FILE.write_text(json.dumps(measured, indent=2))
    print((OUT / "result_cpu.md").read_text())
    return 0


def render_md(r: dict) -> str:
    lines = [
        "# Codec benchmark (real KV)",
        "",
        f"Model {r['model']}, {len(r['prompts'])} prompts of {r['tokens_per_prompt']} tokens "
        f"({', '.join(r['prompts'])}), chunks of {r['chunk_tokens']} tokens, KV stored as fp16.",
        f"CPU figures: {r['device']}, {r['date']}. Throughput is fp16-equivalent MB/s of KV.",
        "",
        "| preset | ratio vs fp16 | bit-exact | greedy agreement (32 tok) | NLL increase | encode MB/s (CPU) | decode+restore MB/s (CPU) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in r["presets"].items():
        lines.append(
            f"| {name} | {s['ratio_vs_fp16']:.2f}x | {'yes' if s['bit_exact'] else 'no'} | {s['greedy_agreement']:.3f} | "
            f"{100 * s['nll_increase']:+.3f}% | {s['encode_mb_s']:.1f} | {s['decode_mb_s']:.1f} |"
        )
    z = r["zstd_q8_bytes"]
    lines.append(f"| zstd -9 on q8's quantised bytes | {z['ratio_vs_fp16']:.2f}x | no | (same values as q8) | | {z['encode_mb_s']:.1f} | |")
    if "nvdec" in r:
        n = r["nvdec"]
        lines += ["", f"## NVDEC ({n['device']}, {n['date']})", "", n.get("summary_md", ""), "",
                  "Each point ran well under a second, so its utilisation samples are sparse; "
                  "[nvdec_throughput.md](nvdec_throughput.md) has 3-second runs."]
    lines += ["", "Rerun: `python -m benchmarks.codec.codec_bench` (CPU) and `benchmarks/codec/nvdec_bench.py` on a GPU machine."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
