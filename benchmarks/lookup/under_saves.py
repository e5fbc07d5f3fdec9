"""Lookups while the sidecar stores: the time the connector's scheduler waits for an answer.

vLLM's connector asks the sidecar how much of a prompt is stored before it schedules the prompt,
and waits ``wait_s`` (5 ms) for the answer: later, the request waits a step. Under load a sidecar
also stores every new prompt, so its writer (copy out, encode, object assembly, upload) runs in
threads beside the event loop that answers lookups, and any of that work holding the GIL delays
the answer. This starts ``kvfetcher serve`` in a process of its own (as in a pod; a local
directory as the store, ``raw`` written), registers a host buffer of ``--layers`` x 8 KV heads x
128 of 16K tokens, and for ``--seconds`` asks a lookup of a 16.5K-token prompt every 20 ms as the
connector does (``FetchOptions(wait_s=0.005)``), while a second client stores a new 16K-token
prompt every second (``--saves``) or not at all (``idle``).

Modes, alternating round by round in one run: ``idle``; ``saves`` (the library as it is); and
``saves-gil-join``, where the sidecar process first sets ``container.GIL_FREE_JOIN`` out of reach,
so each object is joined by ``bytes.join`` holding the GIL, as before. The client's
lookup times, p50 / p90 / p99 per mode, medians over rounds.

First, in this process: how late a thread's 1 ms sleeps wake while another thread joins a
chunk-sized object (``--layers``' chunk) 50 times, with ``bytes.join`` and with the container's join.

    python -m benchmarks.lookup.under_saves --rounds 3 --seconds 15 --out benchmarks/lookup/under_saves_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.lib.sidecar_proc import SidecarProcess
from kvfetcher import ipc
from kvfetcher.fetch.plan import FetchOptions

TOKENS, HEADS, HEAD_DIM, CHUNK = 16384, 8, 128, 256
MODES = {"idle": "", "saves": "", "saves-gil-join": "from kvfetcher.format import container; container.GIL_FREE_JOIN = 1 << 62"}


def one_round(mode: str, layers: int, seconds: float) -> dict:
    """One fresh sidecar: lookups for ``seconds``, beside a store a second unless ``idle``."""
    with tempfile.TemporaryDirectory(prefix="lookup-bench-") as d:
        sc = SidecarProcess(f"{d}/sidecar.sock", setup=MODES[mode], KVFETCHER_STORE_DIR=f"{d}/store", KVFETCHER_PRESET="raw",
                            KVFETCHER_CHUNK_TOKENS=str(CHUNK))
        try:
            c = sc.start(120).client()
            buf = ipc.allocate((layers, 2, HEADS, TOKENS, HEAD_DIM), torch.bfloat16, "cpu")
            buf.tensor.normal_()
            bid = c.register(buf.handle, "lookup-bench")
            stop, stored = threading.Event(), []

            def saves() -> None:
                s = sc.client()
                for i in range(1, 10**6):
                    if stop.is_set():
                        return
                    stored.append(s.store(bid, list(range(10**7 * i, 10**7 * i + TOKENS))).queued_chunks)
                    stop.wait(1.0)

            saver = threading.Thread(target=saves, daemon=True)
            if mode != "idle":
                saver.start()
            prompt, ms = list(range(5, 5 + TOKENS + 512)), []
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                t = time.perf_counter()
                c.lookup(bid, prompt, FetchOptions(wait_s=0.005))
                ms.append((time.perf_counter() - t) * 1e3)
                time.sleep(0.02)
            stop.set()
            if saver.is_alive():
                saver.join(60)
            buf.close()
        finally:
            sc.stop()
    ms.sort()
    at = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731
    return {"mode": mode, "lookups": len(ms), "p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99), "stored_chunks": sum(stored)}


def join_wakeups(nbytes: int, joins: int = 50) -> dict:
    """Per way of joining an object of ``nbytes``: ms per join, and the p50 / p99 ms of another
    thread's 1 ms sleeps meanwhile (late when the join holds the GIL)."""
    import numpy as np

    from kvfetcher.format import container

    parts = [bytes(100), memoryview(np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8))]
    out = {}
    for name, join in (("bytes.join", b"".join), ("container", container._join)):
        stop, late = threading.Event(), []

        def sleeper() -> None:
            while not stop.is_set():
                t = time.perf_counter()
                time.sleep(0.001)
                late.append((time.perf_counter() - t) * 1e3)

        th = threading.Thread(target=sleeper)
        th.start()
        t = time.perf_counter()
        for _ in range(joins):
            join(parts)
        per = (time.perf_counter() - t) / joins * 1e3
        stop.set()
        th.join()
        late.sort()
        out[name] = {"ms_per_join": round(per, 2), "sleep_1ms_p50_ms": round(late[len(late) // 2], 2),
                     "sleep_1ms_p99_ms": round(late[int(0.99 * len(late))], 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16, help="KV layers of the buffer (16: chunks of 16.8 MB; an 8B model has 32: 33.5 MB)")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every mode (0: only the join test)")
    ap.add_argument("--out")
    a = ap.parse_args()
    chunk_bytes = a.layers * 2 * HEADS * CHUNK * HEAD_DIM * 2
    joins = join_wakeups(chunk_bytes)
    print(json.dumps(joins), flush=True)
    rounds = []
    for i in range(a.rounds):
        for mode in (MODES if i % 2 == 0 else reversed(MODES)):
            r = one_round(mode, a.layers, a.seconds)
            rounds.append(r)
            print(json.dumps(r), flush=True)
    summary = {m: {k: round(statistics.median(r[k] for r in rounds if r["mode"] == m), 2)
                   for k in ("p50_ms", "p90_ms", "p99_ms", "stored_chunks")} for m in MODES} if rounds else {}
    res = {"device": "cpu", "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"), "layers": a.layers,
           "chunk_bytes": chunk_bytes, "seconds": a.seconds, "joins": joins, "summary": summary, "rounds": rounds}
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
