"""auto_scale_bench: the sidecar's automatic choice, end to end, on Llama-3-70B-shaped KV.

``scale_bench`` found where fetching pays (70B, 5-10 Gbit/s links) by a model fed with
measured parts. This measures it: the real ``Sidecar.fetch`` (lookup, cost model, pipelined
fetch through decode worker processes into an IPC-registered GPU buffer) on 70B-shaped
contexts over emulated links, beside a forced raw fetch through the same sidecar, the plain
raw fetch (bytes straight into the buffer, ``fetchkit.fetch_raw_direct``) and recompute.

What is real and what is not:
* Recompute: a 70B model does not fit one GPU, so prefill is timed on 4 and 8 contiguous
  layers of the 70B shape (random bf16 weights) and scaled to 80 (``llama_shape.full_depth``)
  in this run. The auto choice is given that time as its recompute rate; when it picks
  recompute, its time is its lookup plus that prefill time.
* KV: real SmolLM2-135M KV tiled into the 70B shape (``kvsource.real_chunks``), a few distinct
  chunks stored under every chunk's name; stored presets raw, q8 and balanced (what a pool
  holding the accuracy-preserving presets would have).
* Link: ``linkstore`` (in-process store behind a paced FIFO link with 2 ms latency): loopback
  HTTP in Python delivers at most ~24 Gbit/s here (ttft_bench's link probe), this one delivers the set rate.
* TTFT here is the time to KV in the buffers (the first decode step is the same for all).
A cell whose least possible time (stored bytes / link) exceeds its box (2x recompute) is not run.

    python -m benchmarks.auto_70b.auto_scale_bench measure --kvsrc kvsrc.pt --out auto70b.json
    python -m benchmarks.auto_70b.auto_scale_bench report auto70b.json      # -> .md and .png beside it
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import multiprocessing as mp
import random
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks.lib import fetchkit, kvsource, linkstore
from benchmarks.lib.llama_shape import full_depth, sweep_prefill

from kvfetcher import ipc, keys, service
from benchmarks.lib.standin import encode_chunk  # a stand-in calibration for random-weight shapes
from kvfetcher.eval.costmodel import SHAPES, ModelShape
from kvfetcher import kvbuffer
from kvfetcher.fetch.plan import FetchOptions

CHUNK = 256
FINGERPRINT = "auto-scale-bench"
STORED = ("raw", "q8", "balanced")
METHODS = ("auto", "raw", "raw-direct", "balanced")  # per cell, beside recompute
#: a CPU dry run's shape: the 8B shape's KV heads and head size, little else
DRY = ModelShape("dry", 8, 1024, 8, 8, 128, 2048, 1000)


def _encode(args: tuple) -> bytes:
    kv, preset, start = args
    return encode_chunk(kv, preset, FINGERPRINT, start=start, rope_theta=kvsource.LLAMA3_THETA)


def stored_objects(kvsrc: str, distinct: int, layers: int) -> dict[str, list[bytes]]:
    """``distinct`` real-KV chunks of ``layers`` layers in every stored preset (encoded in parallel)."""
    parts = kvsource.real_chunks(torch.load(kvsrc), distinct, layers)
    jobs = [(c, p, i * CHUNK) for p in STORED for i, c in enumerate(parts)]
    with ProcessPoolExecutor(min(len(jobs), 12), mp_context=mp.get_context("spawn")) as pool:
        done = list(pool.map(_encode, jobs))
    return {p: done[k * distinct : (k + 1) * distinct] for k, p in enumerate(STORED)}


class Bench:
    """One sidecar (8 decode worker processes) over a store whose link is swapped per cell."""

    def __init__(self, shape, objs: dict[str, list[bytes]], contexts: list[int], procs: int, device: str):
        s = shape
        self.tokens = [random.Random(7).randrange(128000) for _ in range(max(contexts))]
        self.ns = keys.Namespace(model=FINGERPRINT, dtype="bfloat16")
        self.objects: dict[str, bytes] = {}
        for i, k in enumerate(keys.chunk_keys(self.ns, self.tokens, CHUNK)):
            for p, blobs in objs.items():
                self.objects[keys.object_name(k, p)] = blobs[i % len(blobs)]
        self.raw = fetchkit.raw_objects(s, CHUNK, distinct=2)  # the plain raw fetch's objects (bytes of KV)
        for i in range(max(contexts) // CHUNK):
            self.objects[f"raw-direct/{i}.kvfc"] = self.raw[i % 2]
        self.shared = ipc.allocate((s.layers, 2, s.kv_heads, max(contexts), s.head_dim), torch.bfloat16, device)
        cfg = service.Config(chunk_tokens=CHUNK, trust_store=True, presets=STORED, rope_theta=s.rope_theta, io_workers=32, window=16)
        cfg.decode_procs = procs
        self.sidecar = service.Sidecar(self.store(1.0), cfg)
        self.sidecar.buffers["b"] = service.Buffer(self.shared.tensor, self.ns, self.shared.handle)
        if self.sidecar.workers is not None:  # warmed as a serving sidecar is (Sidecar.start, .register)
            self.sidecar.workers.start()
            self.sidecar.warm_workers()
            self.sidecar.workers.open(self.shared.handle)
        self.sidecar.warm_buffer(self.sidecar.buffers["b"])
        self.io = ThreadPoolExecutor(16)
        self.journal = journal(self.sidecar.estimator)

    def store(self, gbps: float) -> linkstore.LinkStore:
        st = linkstore.LinkStore(linkstore.Link(gbps * 1e9 / 8, latency_s=0.002), endpoint=f"link-{gbps:g}")
        st.objects = self.objects
        return st

    def kvfetcher(self, ctx: int, preset: str | None, recompute_s: float, box: float) -> dict:
        """Forced ``preset`` or (None) the automatic choice; seconds until the KV is in the buffer."""
        kw = {"presets": (preset,), "recompute_tokens_per_s": 1e-9} if preset else {"recompute_tokens_per_s": ctx / recompute_s}
        t = time.perf_counter()
        r = dataclasses.asdict(asyncio.run(self.sidecar.fetch("b", self.tokens[:ctx], options=FetchOptions(deadline_s=box, **kw))))
        s = time.perf_counter() - t
        d = r.get("decision") or {}
        out = {"decision": d.get("preset"), "predicted_s": d.get("predicted_s"), "bytes_read": r.get("bytes_read", 0),
               "options": d.get("options"), "lookup_s": r.get("lookup_s")}
        self.journal.append(["fetch", ctx, preset, self.sidecar.objects.endpoint, s, out["decision"]])
        if r["loaded_tokens"] == ctx:
            return out | {"seconds": s}
        if preset is None and not r.get("error"):  # chose recompute: the model prefills after the decision
            return out | {"seconds": s + recompute_s, "decision_s": s}
        return out | {"seconds": None, "error": r.get("error"), "detail": r.get("detail")}

    def raw_direct(self, ctx: int) -> float:
        refs = [kvbuffer.ChunkRef(f"raw-direct/{i}.kvfc", len(self.raw[i % 2]), i * CHUNK, CHUNK) for i in range(ctx // CHUNK)]
        return fetchkit.fetch_raw_direct(self.sidecar.objects, refs, self.shared.tensor, 0, self.io, window=16)


def journal(est) -> list:
    """Record every observation the sidecar's estimator receives (and, from ``Bench``, every fetch), so
    that another estimator can be replayed offline on the same run."""
    log: list = []
    for name in ("observe_read", "observe_latency", "observe_decode", "observe_lookup", "observe_fit"):
        def record(*a, _f=getattr(est, name), _n=name, **kw):
            log.append([_n, *a, kw] if kw else [_n, *a])
            return _f(*a, **kw)
        setattr(est, name, record)
    return log


def measure(args) -> None:
    contexts = [int(x) for x in args.contexts.split(",")]
    links = [float(x) for x in args.links.split(",")]
    shape = DRY if args.shape == "dry" else SHAPES[args.shape]
    dev = args.device
    res: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "date": datetime.date.today().isoformat(),
                 "torch": torch.__version__, "shape": shape.name, "stored": STORED, "contexts": contexts, "links_gbps": links, "cells": []}
    t0 = time.perf_counter()
    sweep = sweep_prefill(shape, [4, 8], contexts, dev)
    rec = {T: s for T, s in full_depth(shape, sweep).items()}
    res["prefill_s"] = {str(T): s for T, s in rec.items()}
    res["prefill_subset"] = {str(k): {str(T): s for T, s in v.items()} for k, v in sweep.items()}
    if dev == "cuda":
        torch.cuda.empty_cache()
    objs = stored_objects(args.kvsrc, args.distinct, shape.layers)
    kv_chunk = shape.layers * 2 * shape.kv_heads * CHUNK * shape.head_dim * 2
    res["bytes_per_chunk"] = {p: sum(map(len, b)) / len(b) for p, b in objs.items()} | {"kv_bf16": kv_chunk}
    print(f"prefill {res['prefill_s']}, objects {res['bytes_per_chunk']} after {time.perf_counter() - t0:.0f} s", flush=True)
    b = Bench(shape, objs, contexts, args.procs if dev == "cuda" else 0, dev)
    for p in STORED:  # warm decoders and the estimator's decode rates
        b.sidecar.objects = b.sidecar.catalog.objects = b.store(100.0)  # the lookups list through the catalog
        b.kvfetcher(min(4096, contexts[0]), p, 1.0, 60)
    for gbps in links:
        b.sidecar.objects = b.sidecar.catalog.objects = b.store(gbps)
        b.kvfetcher(2 * CHUNK, "raw", 1.0, 60)  # the estimator measures this link, as a sidecar on it would have
        for ctx in contexts:
            box = max(2.0, 2 * rec[ctx])
            cell = {"context": ctx, "gbps": gbps, "recompute_s": rec[ctx], "box_s": box}
            least = {"raw": ctx // CHUNK * kv_chunk, "raw-direct": ctx // CHUNK * kv_chunk,
                     "balanced": ctx // CHUNK * res["bytes_per_chunk"]["balanced"]}
            for m in METHODS:
                if m not in args.methods:
                    cell[m] = {"seconds": None, "skipped": "not asked for (--methods)"}
                    continue
                if m != "auto" and least[m] / (gbps * 1e9 / 8) > box:
                    cell[m] = {"seconds": None, "skipped": "bytes / link exceeds the box"}
                    continue
                if m == "raw-direct":
                    cell[m] = {"seconds": b.raw_direct(ctx)}
                else:
                    cell[m] = b.kvfetcher(ctx, None if m == "auto" else m, rec[ctx], box)
            res["cells"].append(cell)
            res["estimator_journal"] = b.journal
            print(json.dumps(cell), flush=True)
            Path(args.out).write_text(json.dumps(res, indent=1))
    if b.sidecar.workers is not None:
        b.sidecar.workers.close()
    b.shared.close()
    res["wall_s"] = time.perf_counter() - t0
    Path(args.out).write_text(json.dumps(res, indent=1))


def _fmt(x) -> str:
    return "—" if x is None else f"{x:.2f}"


def report(args) -> None:
    res = json.loads(Path(args.json).read_text())
    rows = [f"# Automatic choice on {res['shape']}-shaped KV, end to end ({res['device']}, {res['date']})", "",
            "Produced by `benchmarks/auto_70b/auto_scale_bench.py` (what is real and what is emulated: its docstring and below). "
            "Seconds until the prefix's KV is in the GPU buffers; recompute is the 70B prefill, timed on 4 and 8 "
            "of its layers in this run and scaled to 80. `auto` is the real sidecar choosing among recompute and the "
            "stored presets " + ", ".join(res["stored"]) + "; its time includes the lookup. `—`: not run (the link "
            "alone would take longer than the box of 2x recompute) or past the box.", "",
            "| context | link Gbit/s | recompute | raw (sidecar) | raw direct | balanced | auto | auto chose | auto vs best of raw, recompute |",
            "|---|---|---|---|---|---|---|---|---|"]
    for c in res["cells"]:
        raw_best = min((c[m]["seconds"] for m in ("raw", "raw-direct") if c[m].get("seconds")), default=None)
        best = min(x for x in (raw_best, c["recompute_s"]) if x is not None)
        a = c["auto"].get("seconds")
        gain = f"{best / a:.2f}x" if a else "—"
        rows.append(f"| {c['context'] // 1024}K | {c['gbps']:g} | {c['recompute_s']:.2f} | {_fmt(c['raw'].get('seconds'))} | "
                    f"{_fmt(c['raw-direct'].get('seconds'))} | {_fmt(c['balanced'].get('seconds'))} | {_fmt(a)} | "
                    f"{c['auto'].get('decision')} | {gain} |")
    md = Path(args.json).with_suffix(".md")
    md.write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ctxs = sorted({c["context"] for c in res["cells"]})
    fig, axes = plt.subplots(1, len(ctxs), figsize=(4.2 * len(ctxs), 3.6), squeeze=False)
    for ax, T in zip(axes[0], ctxs):
        cs = [c for c in res["cells"] if c["context"] == T]
        xs = [c["gbps"] for c in cs]
        for m, style in (("raw", "s--"), ("raw-direct", "d:"), ("balanced", "^-"), ("auto", "o-")):
            ax.plot(xs, [c[m].get("seconds") or float("nan") for c in cs], style, label=m)
        ax.axhline(cs[0]["recompute_s"], color="k", lw=1, label="recompute")
        ax.set_xscale("log"), ax.set_yscale("log"), ax.set_title(f"{res['shape']}, {T // 1024}K tokens"), ax.set_xlabel("link Gbit/s")
    axes[0][0].set_ylabel("seconds to KV in buffers"), axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{res['device']}, {res['date']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(md.with_suffix(".png"), dpi=110)


def _methods(value: str) -> list[str]:
    names = value.split(",")
    if unknown := [n for n in names if n not in METHODS]:
        raise argparse.ArgumentTypeError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--kvsrc", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--contexts", default="4096,16384,32768")
    m.add_argument("--links", default="100,25,10,5,1")
    m.add_argument("--distinct", type=int, default=3)
    m.add_argument("--methods", type=_methods, default=list(METHODS), help=f"which of {', '.join(METHODS)} to run (recompute is always timed)")
    m.add_argument("--procs", type=int, default=8)
    m.add_argument("--shape", default="llama3-70b", choices=[*sorted(SHAPES), "dry"])
    m.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    r = sub.add_parser("report")
    r.add_argument("json")
    a = ap.parse_args()
    measure(a) if a.cmd == "measure" else report(a)


if __name__ == "__main__":
    main()
