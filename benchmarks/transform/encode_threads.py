"""The store-time encode in N threads at once, and nothing else: the process to profile from outside.

One Llama-3-8B-shaped chunk of real KV (``--kvsrc``) and the stand-in calibration, as ``pack_graph``,
the pack replayed from CUDA graphs (``KVFETCHER_ENCODE_GRAPHS=8``); after three warm-up encodes,
``--threads`` threads call ``chunk.encode_chunk`` in a loop for ``--seconds`` (each count in turn) and
the rate is printed, GB/s of KV. Run it under py-spy, and read the profile with ``lib/spy_shares``:

    py-spy record --gil -r 200 -f raw -o $OUT/spy_gil.txt -- python -m benchmarks.transform.encode_threads --threads 8
    python -m benchmarks.lib.spy_shares spy_gil.txt --within "calls_per_s.<locals>.loop"
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("KVFETCHER_ENCODE_GRAPHS", "8")

from benchmarks.lib import kvsource, standin, timing  # noqa: E402 (after the graphs' setting)
from kvfetcher import chunk  # noqa: E402
from kvfetcher.format import presets  # noqa: E402

FP = "transform-bench/8b"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvsrc", default=".bench/kvsrc.pt")
    ap.add_argument("--preset", default="transform-ans")
    ap.add_argument("--threads", default="8", help="thread counts, comma-separated, each timed in turn")
    ap.add_argument("--seconds", type=float, default=6.0)
    args = ap.parse_args()
    kvs, _ = kvsource.gpu_chunks(args.kvsrc, 2)
    standin.ensure(FP, tuple(kvs[0].shape))
    kv, start = kvs[1], kvs[0].shape[3]
    p = presets.get(args.preset, FP)

    def one(_: int) -> bytes:
        return chunk.encode_chunk(kv, p, FP, start=start, rope_theta=kvsource.LLAMA3_THETA)

    for _ in range(3):
        one(0)
    for n in [int(x) for x in args.threads.split(",") if x]:
        rate = timing.calls_per_s(n, one, args.seconds)
        print(json.dumps({"threads": n, "chunks_per_s": round(rate, 1), "GB_s": round(rate * kv.numel() * kv.element_size() / 1e9, 2)}), flush=True)


if __name__ == "__main__":
    main()
