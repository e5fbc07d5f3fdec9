"""Where a ``transform-ans`` chunk's store-time encode goes, on a GPU, step by step.

One Llama-3-8B-shaped chunk of real KV (``--kvsrc``) on the GPU, the stand-in calibration with a
random orthogonal basis (``transform_bench``'s), encoded as ``chunk.encode_chunk`` does it:

* wall ms (median) of the whole encode, of ``layout.pack``, of the nvCOMP encode of its planes and
  of ``container.build``;
* the GPU kernels one pack and one nvCOMP encode launch (count, summed GPU ms, the longest);
* the heaviest Python functions of the whole encode by own time (cProfile).

Runs against an older tree too (put it first on PYTHONPATH), for a before/after in one call.

    python -m benchmarks.transform.encode_steps --kvsrc .bench/kvsrc.pt --out $OUT/encode_steps.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.entropy.profile_chunk import ms, top
from benchmarks.lib import kvsource, standin
from benchmarks.pack.pack_bench import kernels
from kvfetcher import chunk, codec
from kvfetcher.codec import layout
from kvfetcher.format import container, presets

FP = "transform-bench/8b"
THETA = kvsource.LLAMA3_THETA


def steps(name: str, kv: torch.Tensor, start: int, repeats: int) -> dict:
    p = presets.get(name, FP)
    obj = chunk.encode_chunk(kv, p, FP, start=start, rope_theta=THETA)
    h = container.parse_header(obj)
    packed = layout.pack(kv, h.layout, start)
    enc = codec.encoder(h.codec.format, "cuda")
    segs = [((0, packed.frames.shape[0]), enc.encode(packed.frames, h.codec))]
    fields = {"fingerprint": FP, "dtype": "float16", "shape": list(kv.shape), "preset": name, "layout": h.layout.to_dict(),
              "start": start, "codec": h.codec.to_dict(), "frame_shape": list(h.frame_shape), "meta": {}}
    whole = lambda: chunk.encode_chunk(kv, p, FP, start=start, rope_theta=THETA)  # noqa: E731
    r = {"preset": name, "kv_MB": round(kv.numel() * 2 / 1e6, 2), "object_MB": round(len(obj) / 1e6, 3),
         "side_MB": round(h.side.length / 1e6, 3) if h.side else 0.0,
         "encode_chunk_ms": ms(whole, repeats), "pack_ms": ms(lambda: layout.pack(kv, h.layout, start), repeats),
         "nvcomp_encode_ms": ms(lambda: enc.encode(packed.frames, h.codec), repeats),
         "container_build_ms": ms(lambda: container.build(fields, container.side_bytes(packed.side), segs), repeats)}
    r["encode_GB_s"] = round(kv.numel() * 2 / r["encode_chunk_ms"] / 1e6, 2)
    r["pack_kernels"] = kernels(lambda: layout.pack(kv, h.layout, start))
    r["nvcomp_kernels"] = kernels(lambda: enc.encode(packed.frames, h.codec))
    r["profile_encode"] = top(whole)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvsrc", default=".bench/kvsrc.pt")
    ap.add_argument("--presets", default="transform-ans")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    kvs, kv_desc = kvsource.gpu_chunks(args.kvsrc, 2)
    standin.ensure(FP, tuple(kvs[0].shape))
    T = kvs[0].shape[3]
    rows = []
    for name in args.presets.split(","):
        rows.append(steps(name, kvs[1], T, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "kv": kv_desc,
              "chunk_shape": list(kvs[0].shape), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
