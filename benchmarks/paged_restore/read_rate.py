"""How fast the sidecar's reader processes read whole objects from the link server, with no GPU and no decode.

A fetch of entropy-coded chunks reads each object whole, in one GET, into shared staging (the
executor's ``header`` stage in ``paged_bench``'s timeline; README.md says why it matters). This
times that stage alone, as the executor drives it: ``--window`` threads at once, each taking a staging buffer
(page-locked where there is CUDA), reading one object into it through
:class:`~kvfetcher.fetch.readers.ReadProcs` and giving the buffer back. The objects are
``--objects`` random objects of ``--object-mb`` MB, served unpaced by the link server in
``--server-procs`` processes. Each reader count in ``--procs`` is timed, and every read is checked
against what was written.

The report gives, per reader count: GB/s of stored bytes (median of ``--repeats``), the median and
p90 ms per read, and the cores busy on average (every process on the machine). A read's time runs
from the call to its return, including any wait for a free reader, as the executor's stage counts it.

    python -m benchmarks.paged_restore.read_rate --procs 2,4,8 --out $OUT/read_rate.json
    python -m benchmarks.paged_restore.read_rate --objects 8 --object-mb 1 --procs 1,2 --repeats 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.lib import linkserver
from benchmarks.lib.cpuload import busy_cores, cpu_jiffies
from kvfetcher.fetch.readers import ReadProcs, SharedStaging
from kvfetcher.store.s3 import S3Store

BUCKET = "kvbench"


def write_objects(root: Path, count: int, size: int) -> dict[str, int]:
    """``count`` objects of ``size`` random bytes in the bucket's directory: name -> CRC-32."""
    (root / BUCKET).mkdir(parents=True)
    crcs = {}
    for i in range(count):
        data = os.urandom(size)
        name = f"obj-{i:04d}"
        (root / BUCKET / name).write_bytes(data)
        crcs[name] = zlib.crc32(data)
    return crcs


def read_all(readers: ReadProcs, staging: SharedStaging, crcs: dict[str, int], size: int, window: int, pinned: bool) -> tuple[float, list[float]]:
    """Every object read once, ``window`` at a time: (seconds, seconds per read); raises on a wrong byte."""
    def one(name: str) -> float:
        buf = staging.take(size, pinned)
        try:
            t = time.perf_counter()
            n = readers.read_into(name, 0, memoryview(buf.numpy())[:size])
            dt = time.perf_counter() - t
            if n != size or zlib.crc32(memoryview(buf.numpy())[:size]) != crcs[name]:
                raise RuntimeError(f"{name}: read {n} bytes that do not match what was written")
            return dt
        finally:
            staging.give(buf, pinned)

    with ThreadPoolExecutor(window) as pool:
        t = time.perf_counter()
        each = list(pool.map(one, crcs))
        return time.perf_counter() - t, each


def run(procs: int, url: str, crcs: dict[str, int], size: int, window: int, repeats: int) -> dict:
    pinned = torch.cuda.is_available()
    staging = SharedStaging()
    readers = ReadProcs(S3Store(url, BUCKET, "bench", "bench", verify_tls=False).opener(), procs, staging)
    try:
        staging.reserve(size, pinned, window)
        read_all(readers, staging, crcs, size, window, pinned)  # warm-up: connections, buffers, mappings
        walls, each = [], []
        before = cpu_jiffies()
        for _ in range(repeats):
            wall, per = read_all(readers, staging, crcs, size, window, pinned)
            walls.append(wall)
            each += per
        cores = busy_cores(before, cpu_jiffies())
    finally:
        readers.close()
    each.sort()
    return {"procs": procs, "stored_GB_s": round(len(crcs) * size / statistics.median(walls) / 1e9, 2),
            "read_ms_median": round(statistics.median(each) * 1e3, 2), "read_ms_p90": round(each[int(0.9 * (len(each) - 1))] * 1e3, 2),
            "cpu_busy_cores": cores}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--objects", type=int, default=128, help="objects read a pass (a 32K-token prefix: 128 chunks)")
    ap.add_argument("--object-mb", type=float, default=6.5, help="MB an object (a transform-ans chunk of Llama-3-8B's 256 tokens: about 6.5)")
    ap.add_argument("--procs", default="4", help="reader processes, comma-separated: each is timed")
    ap.add_argument("--window", type=int, default=16, help="reads at once (the fetch's window)")
    ap.add_argument("--server-procs", type=int, help="the link server's processes (default: half the cores, at most 8)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    size, server_procs = int(args.object_mb * 1e6), args.server_procs or linkserver.default_procs()
    with tempfile.TemporaryDirectory() as d:
        crcs = write_objects(Path(d), args.objects, size)
        url, group = linkserver.start_process(d, 0.0, server_procs)
        try:
            rows = []
            for n in (int(p) for p in args.procs.split(",")):
                rows.append(run(n, url, crcs, size, args.window, args.repeats))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            group.terminate()
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "date": time.strftime("%Y-%m-%d"),
              "cores": os.cpu_count(), "objects": args.objects, "object_bytes": size, "window": args.window,
              "server_procs": server_procs, "page_locked": torch.cuda.is_available(), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
