"""What does the scheduler's lookup cost, per request, against a real sidecar process?

A `kvfetcher serve` process on a Unix socket with a local store and one registered (small, flat,
Llama-3-8B-shaped) buffer; the client is the connector's (`KVClient.lookup` by namespace, as vLLM's
scheduler asks it). Prompts of 8K and 128K tokens; per case, `--reps` timed lookups after one
untimed one:

* `miss`: nothing stored; the first chunk is known absent after the first lookup;
* `hit`: every chunk stored (tiny placeholder objects under the real names: a lookup lists, it never
  reads them) and known to the sidecar's index;
* `miss (store asked)`: the same miss with `refresh`, which lists the unknown chunks before
  answering (what the lookup cost before the index; a fetch that looks up still pays it).

Reported: p50 / p99 milliseconds of the client's call (packing, the socket, the sidecar's answer),
and the store requests the timed lookups issued (the store counts them).

    python -m benchmarks.lookup.lookup_bench --out benchmarks/lookup
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.lib.sidecar_proc import SidecarProcess
from kvfetcher import ipc, keys
from kvfetcher.fetch.plan import FetchOptions

MODEL, CHUNK = "lookup-bench/llama-3-8b-shape", 256
SHAPE = (32, 8, 128)  # layers, kv_heads, head_dim


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def stored_placeholders(root: Path, tokens: list[int]) -> None:
    """A `raw` object of every chunk of ``tokens`` under its real name in a local store at ``root``."""
    ns = keys.Namespace(model=MODEL, dtype="float16", shape=SHAPE)
    for k in keys.chunk_keys(ns, tokens, CHUNK):
        p = root / keys.object_name(k, "raw")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")


def timed(client, tokens: list[int], reps: int, options: FetchOptions) -> list[float]:
    ask = lambda: client.lookup(None, tokens, options, model=MODEL, dtype="float16")  # noqa: E731
    ask()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        ask()
        out.append(time.perf_counter() - t)
    return out


def listings(client) -> float:
    text = client.metrics()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvfetcher_listing_seconds_count"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--contexts", default="8192,131072")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "store"
        root.mkdir()
        contexts = [int(c) for c in a.contexts.split(",")]
        hits = {n: list(range(1, n + 1)) for n in contexts}
        for n in contexts:
            stored_placeholders(root, hits[n])
        sc = SidecarProcess(Path(tmp) / "kvf.sock", KVFETCHER_STORE_DIR=str(root), KVFETCHER_PRESET="raw", KVFETCHER_CHUNK_TOKENS=str(CHUNK),
                            KVFETCHER_DECODE_PROCS="0", KVFETCHER_WARM_UP="0", KVFETCHER_MAX_REQUEST_TOKENS=str(max(contexts) + 1)).start()
        try:
            c = sc.client()
            buf = ipc.allocate((SHAPE[0], 2, SHAPE[1], CHUNK, SHAPE[2]), torch.float16)  # the namespace's geometry, for the cost model
            c.register(buf.handle, MODEL)
            for n in contexts:
                miss = list(range(10**6, 10**6 + n))
                c.lookup(None, hits[n], FetchOptions(refresh=True, recompute_tokens_per_s=1.0), model=MODEL, dtype="float16")  # the index learns the run
                slow = dict(recompute_tokens_per_s=1.0)  # a load always could pay: the index and the cost model both run
                for case, tokens, o in (("miss", miss, FetchOptions(**slow)), ("hit", hits[n], FetchOptions(**slow)),
                                        ("miss (store asked)", miss, FetchOptions(**slow, refresh=True, deadline_s=30))):
                    if o.refresh:  # every timed lookup must list: the absence it found expires at once
                        sc.stop()
                        env = {k: v for k, v in sc.env.items() if k.startswith("KVFETCHER_")} | {"KVFETCHER_NEGATIVE_TTL_S": "0"}
                        sc = SidecarProcess(sc.socket, **env).start()
                        c = sc.client()
                        c.register(buf.handle, MODEL)
                    before = listings(c)
                    s = timed(c, tokens, a.reps, o)
                    rows.append({"context": n, "case": case, "p50_ms": 1e3 * statistics.median(s), "p99_ms": 1e3 * percentile(s, 0.99),
                                 "listings_per_lookup": (listings(c) - before) / (a.reps + 1)})
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            sc.stop()
    report = {"device": platform.processor() or platform.machine(), "cpus": __import__("os").cpu_count(),
              "date": datetime.date.today().isoformat(), "reps": a.reps, "rows": rows}
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        tag = a.out / f"result_{'gpu' if Path('/dev/nvidia0').exists() else 'cpu'}"
        tag.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        md = ["| context | lookup | p50 ms | p99 ms | store listings per lookup |", "|---|---|---|---|---|"]
        md += [f"| {r['context']} | {r['case']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['listings_per_lookup']:.2f} |" for r in rows]
        tag.with_suffix(".md").write_text(f"Lookup cost, {report['cpus']} CPUs, {report['date']}, {a.reps} lookups each\n\n" + "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
