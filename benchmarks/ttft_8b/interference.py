"""Interference per method: how much each way of getting a context's KV slows a decode loop.

The loop (:func:`benchmarks.lib.interference.decode_loop`) plays the serving engine in its own
process. This process plays the sidecar (kvfetcher runs beside the model in its own container):
for a few seconds per method it fetches the same context over and over through the link server
(``ttft_bench.Race``), and for ``recompute`` it runs that context's prefill over and over (what a
recomputing engine would put on the GPU instead). Time per output token while each method runs,
against the loop alone, is the interference. Run through ``ttft_bench --interference`` (it
reuses that run's store and link server).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

from benchmarks.lib.interference import decode_loop, stats
from benchmarks.lib.llama8b import Llama
from benchmarks.ttft_8b.ttft_bench import Race, log

from kvfetcher.format import presets


def run(model: Llama, url: str, tokens: list[int], ctx: int, peer_objs: dict, methods: list[str], decode_workers: int,
        seconds: float = 4.0, batch: int = 16, decode_ctx: int = 2048, decode_procs: int | None = None, shared_buffer: bool = False) -> dict:
    ctxm = mp.get_context("spawn")
    ready, stop, q = ctxm.Event(), ctxm.Event(), ctxm.Queue()
    proc = ctxm.Process(target=decode_loop, args=(batch, decode_ctx, ready, stop, q), daemon=True)
    proc.start()
    warm_ctx = 4096
    race = Race(model, url, tokens, [warm_ctx, ctx], peer_objs, decode_workers, decode_procs, shared_buffer)
    # warm each path (decoders, connections) before the decode loop starts timing
    for m in methods:
        if m in presets.PRESETS:
            asyncio.run(race.kvfetcher(warm_ctx, m, 60, 0))
        elif m in peer_objs:
            asyncio.run(race.peer(warm_ctx, m, 60, n_chunks=1))
    if not ready.wait(600):
        raise RuntimeError("decode loop did not start")
    phases = []

    def phase(name: str, body) -> None:
        time.sleep(0.3)
        t0, n, kvb = time.perf_counter(), 0, 0
        while time.perf_counter() - t0 < seconds:
            kvb += body()
            n += 1
        phases.append({"method": name, "t0": t0, "t1": time.perf_counter(), "iterations": n, "kv_bytes": kvb})
        log(f"interference phase {name}: {n} iterations")

    kv_bytes = race.bufs[ctx][:, :, :, :ctx].numel() * 2
    phase("none", lambda: (time.sleep(0.05), 0)[1])
    for m in methods:
        if m == "auto":
            continue
        if m == "recompute":
            phase(m, lambda: (race.recompute(ctx), kv_bytes)[1])
        elif m in presets.PRESETS:
            phase(m, lambda m=m: kv_bytes if asyncio.run(race.kvfetcher(ctx, m, seconds, 0))["ttft_s"] else 0)
        else:
            phase(m, lambda m=m: kv_bytes if asyncio.run(race.peer(ctx, m, seconds))["ttft_s"] else 0)
    phase("none_after", lambda: (time.sleep(0.05), 0)[1])
    stop.set()
    starts, durs = q.get(timeout=120)
    proc.join(30)
    out = {"decode_procs": race.decode_procs, "decode_batch": batch, "decode_ctx": decode_ctx, "fetch_ctx": ctx, "phase_s": seconds, "phases": []}
    base = None
    for p in phases:
        xs = [d for s, d in zip(starts, durs) if p["t0"] <= s and s + d <= p["t1"]]
        st = stats(xs) | {"method": p["method"], "fetches": p["iterations"],
                           "fetch_GBps": p["kv_bytes"] / (p["t1"] - p["t0"]) / 1e9}
        if p["method"] == "none":
            base = st
        if base and st.get("median_ms") and base.get("median_ms"):
            st["slowdown_median_pct"] = 100 * (st["median_ms"] / base["median_ms"] - 1)
            st["slowdown_p90_pct"] = 100 * (st["p90_ms"] / base["p90_ms"] - 1)
        out["phases"].append(st)
    return out
