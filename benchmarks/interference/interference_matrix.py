"""Interference against restore rate: decode worker count x preset, one decode loop, one run.

``interference_bench`` measured each method once at main's default (8 decode worker
processes) and found the NVDEC path slowing a decoding model by 24-36%. This asks the
question a platform team tunes by: how does the slowdown of a busy model's decode loop grow
with the restore rate, as the sidecar's worker count (``KVFETCHER_DECODE_PROCS``) varies?
Run it twice, once plainly (the GPU time-slices the model's CUDA context with every worker's)
and once with CUDA MPS started beforehand (``--label mps``; all contexts become one MPS
server's clients and run side by side), to see what time-slicing costs.

The loop is ``interference_bench``'s engine (Llama-3-8B shape, random bf16 weights, batch 16 of
2048 cached tokens, one CUDA-graph replay and sync per step) in its own process. This process
plays the sidecar: for each (workers, preset) it restores a 16K-token 8B-shaped context from a
local store in tmpfs (no link limit) into an IPC-registered buffer, over and over, for
``--seconds``. The KV is real SmolLM2 KV tiled into the shape (``kvsource``).

    python -m benchmarks.interference.interference_matrix measure --kvsrc kvsrc.pt --procs 1,4,8 --presets lean,balanced --out ts.json
    benchmarks/lib/with_mps.sh python -m benchmarks.interference.interference_matrix measure --kvsrc kvsrc.pt --label mps --out mps.json
    benchmarks/lib/with_mps.sh python -m benchmarks.interference.interference_matrix measure --kvsrc kvsrc.pt --label mps --sm-percent 10 --out mps10.json
    python -m benchmarks.interference.interference_matrix report ts.json mps.json mps10.json --out research/results/interference_matrix_h100.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from benchmarks.lib import kvsource
from benchmarks.lib.fetchkit import fetch_once
from benchmarks.lib.interference import decode_loop, stats

from kvfetcher import ipc
from kvfetcher import kvbuffer
from kvfetcher.fetch import executor
from benchmarks.lib.standin import encode_chunk  # a stand-in calibration for random-weight shapes
from kvfetcher.fetch.workers import DecodeWorkers
from kvfetcher.store.local import LocalStore

CHUNK = 256


def _encode(args: tuple) -> bytes:
    kv, preset, start = args
    return encode_chunk(kv, preset, "bench", start=start, rope_theta=kvsource.LLAMA3_THETA)


def objects(kvsrc: str, preset: str, distinct: int) -> list[bytes]:
    """``distinct`` stored 8B-shaped chunks in ``preset``, tiled from real KV (``kvsource``)."""
    jobs = [(c, preset, i * CHUNK) for i, c in enumerate(kvsource.real_chunks(torch.load(kvsrc), distinct))]
    with ProcessPoolExecutor(distinct, mp_context=mp.get_context("spawn")) as pool:
        return list(pool.map(_encode, jobs))


def measure(args) -> None:
    ctx = mp.get_context("spawn")
    ready, stop, q = ctx.Event(), ctx.Event(), ctx.Queue()
    loop = ctx.Process(target=decode_loop, args=(16, 2048, ready, stop, q), daemon=True)
    loop.start()
    L, _, H, _, D = kvsource.SHAPE
    chunks = args.context // CHUNK
    buf = ipc.allocate((L, 2, H, args.context, D), torch.bfloat16, "cuda")
    kv_bytes = buf.tensor.numel() * 2
    tmp = tempfile.TemporaryDirectory(dir="/dev/shm")
    store = LocalStore(tmp.name)
    refs = {}
    for preset in args.presets.split(","):
        objs = objects(args.kvsrc, preset, args.distinct)
        refs[preset] = []
        for i in range(chunks):
            obj = objs[i % len(objs)]
            store.put(f"{preset}/{i}.kvfc", obj)
            refs[preset].append(kvbuffer.ChunkRef(f"{preset}/{i}.kvfc", len(obj), i * CHUNK, CHUNK))
    if not ready.wait(600):
        raise RuntimeError("decode loop did not start")
    phases: list[dict] = []

    def phase(name: str, procs: int, body) -> None:
        time.sleep(0.3)  # let the loop settle between phases
        t0, n, kvb = time.perf_counter(), 0, 0
        while time.perf_counter() - t0 < args.seconds:
            kvb += body()
            n += 1
        phases.append({"method": name, "procs": procs, "t0": t0, "t1": time.perf_counter(), "fetches": n, "kv_bytes": kvb})
        print(f"phase {name} procs={procs}: {n} fetches", flush=True)

    def fetch(preset: str, workers: DecodeWorkers) -> int:
        out = asyncio.run(fetch_once(store, refs[preset], buf, "cuda", 2 * workers.procs, 1, workers))
        if out.error is not None:
            raise RuntimeError(f"{preset} fetch failed: {out.error} {out.detail}")
        return kv_bytes

    phase("none", 0, lambda: (time.sleep(0.05), 0)[1])
    if args.sm_percent:  # inherited by the workers spawned below only: the loop and this process have their contexts
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(args.sm_percent)
    for p in (int(x) for x in args.procs.split(",")):
        workers = DecodeWorkers(p)
        workers.start()
        for preset in refs:
            fetch(preset, workers)  # warm: decoders open, buffer mapped in every worker
            phase(preset, p, lambda preset=preset, w=workers: fetch(preset, w))
        workers.close()
        phase("none", 0, lambda: (time.sleep(0.05), 0)[1])
    stop.set()
    starts, durs = q.get(timeout=120)
    loop.join(30)
    buf.close()
    tmp.cleanup()

    rows, base = [], None
    idle = [d for p in phases if p["method"] == "none" for s, d in zip(starts, durs) if p["t0"] <= s and s + d <= p["t1"]]
    base = statistics.median(idle)
    base_p90 = sorted(idle)[int(0.9 * (len(idle) - 1))]
    for p in phases:
        xs = [d for s, d in zip(starts, durs) if p["t0"] <= s and s + d <= p["t1"]]
        st = stats(xs) | {k: p[k] for k in ("method", "procs", "fetches")}
        st["restore_GBps"] = round(p["kv_bytes"] / (p["t1"] - p["t0"]) / 1e9, 3)
        if xs:
            st["slowdown_median_pct"] = round(100 * (st["median_ms"] / 1e3 / base - 1), 1)
            st["slowdown_p90_pct"] = round(100 * (st["p90_ms"] / 1e3 / base_p90 - 1), 1)
        rows.append(st)
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "sharing": args.label, "sm_percent": args.sm_percent,
              "context": args.context, "distinct_chunks": args.distinct, "phase_s": args.seconds,
              "decode_loop": "Llama-3-8B shape, random bf16 weights, batch 16 x 2048 cached tokens, CUDA graph, sync per step",
              "idle_tpot_median_ms": round(1e3 * base, 3), "idle_tpot_p90_ms": round(1e3 * base_p90, 3), "phases": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    for r in rows:
        print(json.dumps(r), flush=True)


def report(args) -> None:
    """Markdown table (and a plot: slowdown against restore rate) of one or more runs."""
    runs = [json.loads(Path(p).read_text()) for p in args.json]
    label = lambda r: r["sharing"] + (f", workers at {r['sm_percent']}% of SMs" if r.get("sm_percent") else "")  # noqa: E731
    r0 = runs[0]
    rows = [f"# Interference against restore rate ({r0['device']}, {r0['date']})", "",
            "Produced by `benchmarks/interference/interference_matrix.py` (its docstring says how). A decode loop "
            f"({r0['decode_loop']}) runs in its own process while this process restores a {r0['context'] // 1024}K-token "
            "8B-shaped context (real SmolLM2 KV tiled into the shape) over and over through N decode worker "
            f"processes, {r0['phase_s']} s per phase. Slowdown = the loop's time per step against its idle phases, "
            "same run. `mps`: all processes were clients of one CUDA MPS server (contexts run side by side instead "
            "of time-sliced).", "",
            "| GPU sharing | preset | workers | restore GB/s | TPOT median ms | slowdown median | slowdown p90 |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        rows.append(f"| {label(r)} | (idle) | 0 | — | {r['idle_tpot_median_ms']:.2f} | — | — |")
        for ph in r["phases"]:
            if ph["method"] != "none" and "median_ms" in ph:
                rows.append(f"| {label(r)} | {ph['method']} | {ph['procs']} | {ph['restore_GBps']:.2f} | {ph['median_ms']:.2f} | "
                            f"{ph['slowdown_median_pct']:+.1f}% | {ph['slowdown_p90_pct']:+.1f}% |")
    md = Path(args.out)
    md.write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        pts = sorted((ph["restore_GBps"], ph["slowdown_median_pct"]) for ph in r["phases"] if ph["method"] != "none" and "median_ms" in ph)
        ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=label(r))
    ax.axhline(5, color="k", lw=0.8, ls="--", label="5% target")
    ax.set_xlabel("restore rate, GB/s of bf16 KV"), ax.set_ylabel("decode loop slowdown, median %")
    ax.set_title(f"{r0['device']}, {r0['date']}", fontsize=8), ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(md.with_suffix(".png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--kvsrc", required=True, help="real KV saved by benchmarks/lib/kvsource.py")
    m.add_argument("--procs", default="1,4,8")
    m.add_argument("--presets", default="lean,balanced")
    m.add_argument("--context", type=int, default=16384)
    m.add_argument("--distinct", type=int, default=4)
    m.add_argument("--seconds", type=float, default=2.5)
    m.add_argument("--label", default="time-sliced", help="what this run's GPU sharing is (e.g. mps)")
    m.add_argument("--sm-percent", type=int, help="decode workers' MPS share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)")
    m.add_argument("--out", required=True)
    r = sub.add_parser("report")
    r.add_argument("json", nargs="+")
    r.add_argument("--out", required=True, help="the .md to write (a .png beside it)")
    a = ap.parse_args()
    measure(a) if a.cmd == "measure" else report(a)


if __name__ == "__main__":
    main()
