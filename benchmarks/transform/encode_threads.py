"""The store-time encode in N threads at once, and nothing else: the process to profile from outside.

One Llama-3-8B-shaped chunk of real KV (``--kvsrc``) and the stand-in calibration, as ``pack_graph``,
the pack replayed from CUDA graphs (``KVFETCHER_ENCODE_GRAPHS=8``). For each ``--batch`` size, after
three warm-up calls, ``--threads`` threads call ``chunk.encode_chunks`` of that many chunks in a loop
for ``--seconds`` (each count in turn); printed: the object's SHA-256 (to compare trees by), then per
count GB/s of KV and the process' minor page faults a chunk (memory touched for the first time).
Run it under py-spy, and read the profile with ``lib/spy_shares``:

    py-spy record --gil -r 200 -f raw -o $OUT/spy_gil.txt -- python -m benchmarks.transform.encode_threads --threads 8
    python -m benchmarks.lib.spy_shares spy_gil.txt --within "calls_per_s.<locals>.loop"
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource

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
    ap.add_argument("--batch", default="1", help="chunks a call codes together (chunk.encode_chunks), comma-separated, each in turn")
    args = ap.parse_args()
    kvs, _ = kvsource.gpu_chunks(args.kvsrc, 2)
    standin.ensure(FP, tuple(kvs[0].shape))
    kv, start = kvs[1], kvs[0].shape[3]
    p = presets.get(args.preset, FP)

    for b in [int(x) for x in args.batch.split(",") if x]:
        todo = [chunk.ToEncode(kv, start) for _ in range(b)]

        def one(_: int) -> list[bytes]:
            return chunk.encode_chunks(todo, p, FP, rope_theta=kvsource.LLAMA3_THETA)

        for _ in range(3):
            obj = one(0)[-1]
        print(json.dumps({"batch": b, "object_bytes": len(obj), "object_sha256": hashlib.sha256(obj).hexdigest()}), flush=True)
        for n in [int(x) for x in args.threads.split(",") if x]:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            rate = timing.calls_per_s(n, one, args.seconds) * b
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            print(json.dumps({"batch": b, "threads": n, "chunks_per_s": round(rate, 1), "GB_s": round(rate * kv.numel() * kv.element_size() / 1e9, 2),
                              "page_faults_per_chunk": round(faults / (rate * args.seconds))}), flush=True)


if __name__ == "__main__":
    main()
