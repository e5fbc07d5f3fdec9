"""tp_bench: TTFT of a tensor-parallel Llama-3-70B-shaped model, recompute against kvfetcher raw,
balanced and auto, one sidecar per rank, every rank fetching over one shared node link.

What is real and what is emulated:
* Ranks: ``--world`` processes (``torch.multiprocessing``), one GPU each, NCCL (gloo on the CPU).
* Recompute: the 70B shape split by heads across the ranks (``tp_model``: two all-reduces a layer),
  random bf16 weights. The model does not fit, so two subset depths are timed and scaled to 80
  layers (``llama_shape.full_depth``), as ``auto_70b`` does.
* Fetch: each rank runs its own ``Sidecar`` (its decode worker processes on its GPU) into its own
  KV buffer (its KV heads, all 80 layers, registered by CUDA IPC), over an in-process store behind
  ONE emulated link that every rank's process shares (``linkstore.Link`` in shared memory, 2 ms
  latency). The sidecars share a link directory (``fetch.linkshare``) and plan with ``group_size`` =
  the world size. The ranks exchange plans and load replies with ``all_gather_object`` and decide
  with ``kvfetcher.fetch.group``: the decisions ``api.group.RankGroup`` makes over HTTP.
* KV: real SmolLM2 KV tiled into the 70B shape with ``--kvsrc`` (``benchmarks.lib.kvsource``), else
  synthetic (timing right, ``balanced``'s size not that of real KV); a few distinct chunks per rank
  stored under every chunk's name, in raw and balanced.
* TTFT: seconds until every rank's buffer holds the prefix (the first decode step is the same for
  all); when auto chooses recompute, its lookup plus the recompute. ``auto`` runs after the forced
  presets of its cell, so its estimator has seen this link and size (a serving sidecar's steady state).
A cell whose least possible time (stored bytes / link) exceeds its box (2x recompute) is not run.

    python -m benchmarks.tp.tp_bench --world 4 --out tp4.json [--kvsrc kvsrc.pt]
    python -m benchmarks.tp.tp_bench --dry --world 2 --out /tmp/tp.json    # CPU smoke run: gloo, tiny shape
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import random
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.lib import kvsource, linkstore, standin
from benchmarks.lib.linkserver import free_port
from benchmarks.tp.tp_model import recompute_seconds, shard
from kvfetcher import ipc, keys, service
from kvfetcher.eval.costmodel import SHAPES, TINY
from kvfetcher.fetch import group
from kvfetcher.fetch.plan import FetchOptions

CHUNK = 256
FINGERPRINT = "tp-bench"
STORED = ("raw", "balanced")
METHODS = ("raw", "balanced", "auto")  # auto last: it plans with what its cell's forced fetches taught


def _encode(job: tuple) -> bytes:
    kv, preset, start, theta = job
    return standin.encode_chunk(kv, preset, FINGERPRINT, start=start, rope_theta=theta)


def shard_objects(args, shape, rank: int, world: int) -> dict[str, list[bytes]]:
    """``args.distinct`` chunks of this rank's KV heads in every stored preset (encoded in parallel)."""
    h = shape.kv_heads // world
    if args.kvsrc:
        full = kvsource.real_chunks(torch.load(args.kvsrc), args.distinct, shape.layers)
        parts = [c[:, :, rank * h : (rank + 1) * h].contiguous() for c in full]
    else:
        parts = [kvsource.synthetic_kv(shape.layers, h, CHUNK, shape.head_dim, torch.bfloat16, seed=100 * rank + i)
                 for i in range(args.distinct)]
    jobs = [(c, p, i * CHUNK, shape.rope_theta) for p in STORED for i, c in enumerate(parts)]
    procs = max(1, min(len(jobs), (os.cpu_count() or 1) // world))
    if args.dry or procs == 1:
        done = [_encode(j) for j in jobs]
    else:
        with ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn")) as pool:
            done = list(pool.map(_encode, jobs))
    n = args.distinct
    return {p: done[k * n : (k + 1) * n] for k, p in enumerate(STORED)}


class Rank:
    """This process' rank: its sidecar (over the shared link), its KV buffer, its stored shard."""

    def __init__(self, args, shape, rank: int, world: int, link: linkstore.Link, device: torch.device, link_dir: str):
        self.rank, self.world, self.link = rank, world, link
        s = shard(shape, world)
        self.tokens = [random.Random(7).randrange(shape.vocab) for _ in range(max(args.contexts))]
        self.shared = ipc.allocate((s.layers, 2, s.kv_heads, max(args.contexts), s.head_dim), torch.bfloat16, device)
        cfg = service.Config(chunk_tokens=CHUNK, trust_store=True, presets=STORED, rope_theta=s.rope_theta, io_workers=32, window=16, link_dir=link_dir)
        cfg.decode_procs, cfg.device = (args.procs if device.type == "cuda" else 0), str(device)
        self.sidecar = service.Sidecar(linkstore.LinkStore(link), cfg)
        ns = self.sidecar.namespace(FINGERPRINT, "bfloat16", rank, (s.layers, s.kv_heads, s.head_dim))
        self.blobs = shard_objects(args, shape, rank, world)
        self.objects = {keys.object_name(k, p): b[i % len(b)] for i, k in enumerate(keys.chunk_keys(ns, self.tokens, CHUNK))
                        for p, b in self.blobs.items()}
        self.sidecar.buffers["b"] = service.Buffer(self.shared.tensor, ns, self.shared.handle)
        if self.sidecar.workers is not None:  # warmed as a serving sidecar is (Sidecar.start, .register)
            self.sidecar.workers.start()
            self.sidecar.warm_workers()
            self.sidecar.workers.open(self.shared.handle)
        self.sidecar.warm_buffer(self.sidecar.buffers["b"])

    def use_link(self, gbps: float) -> None:
        """Every rank on the link at ``gbps`` (its own endpoint name: the estimator learns each link apart)."""
        if self.rank == 0:
            self.link.Bps = gbps * 1e9 / 8
        store = linkstore.LinkStore(self.link, endpoint=f"link-{gbps:g}")
        store.objects = self.objects
        self.sidecar.objects = self.sidecar.catalog.objects = store  # the lookups list through the catalog
        dist.barrier()

    def gather(self, x) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, x)
        return out

    def fetch(self, ctx: int, preset: str | None, recompute_s: float, box: float) -> dict:
        """The group's fetch of the first ``ctx`` tokens: forced ``preset``, or (None) auto; seconds
        until every rank holds what the group loaded."""
        o = FetchOptions(group_size=self.world, refresh=True,  # the objects were placed behind the sidecar's back: list them
                         **({"presets": (preset,), "recompute_tokens_per_s": 1e-9} if preset else {"recompute_tokens_per_s": ctx / recompute_s}))
        tokens = self.tokens[:ctx]
        dist.barrier()
        t = time.perf_counter()
        g = group.agree(self.gather(asyncio.run(self.sidecar.lookup("b", tokens, o))))
        if isinstance(g, group.Retry):
            again = asyncio.run(self.sidecar.lookup("b", tokens[: g.tokens], dataclasses.replace(o, presets=(g.preset,))))
            g = group.agree(self.gather(again), retry=g)
        loads = bool(g.plans and g.loaded_tokens)
        reply = asyncio.run(self.sidecar.fetch("b", tokens[: g.tokens], g.plans[self.rank], options=FetchOptions(deadline_s=box))) if loads else None
        out = group.settle(g, self.gather(reply) if loads else [])
        s = time.perf_counter() - t
        cell = {"decision": g.preset, "predicted_s": g.predicted_s, "loaded_tokens": out.loaded_tokens, "error": out.error,
                "bytes_read": sum(r.bytes_read for r in out.replies if r)}
        if out.loaded_tokens == ctx:
            return cell | {"seconds": s}
        if preset is None and out.error is None:  # the group recomputes: the model prefills after the decision
            return cell | {"seconds": s + recompute_s * (ctx - out.loaded_tokens) / ctx, "decision_s": s}
        return cell | {"seconds": None, "detail": out.detail}


def measure(rank: int, world: int, args, link: linkstore.Link, link_dir: str) -> dict | None:
    """Every rank runs this; rank 0 returns the results."""
    cuda = torch.cuda.is_available() and not args.dry
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    shape = TINY if args.dry else SHAPES[args.shape]
    t0 = time.perf_counter()
    rec, sweep = recompute_seconds(shape, world, (1, 2) if args.dry else (4, 8), args.contexts, device, torch.bfloat16)
    r = Rank(args, shape, rank, world, link, device, link_dir)
    per_token = r.shared.tensor[:, :, :, :1].numel() * 2  # bytes of one token's KV on one rank
    sizes = {p: sum(map(len, b)) / len(b) for p, b in r.blobs.items()}
    res = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "shape": shape.name, "world": world, "stored": STORED, "contexts": args.contexts,
           "links_gbps": args.links, "prefill_s": {str(T): v for T, v in rec.items()},
           "prefill_subset": {str(k): {str(T): v for T, v in d.items()} for k, d in sweep.items()},
           "bytes_per_chunk_per_rank": sizes | {"kv_bf16": per_token * CHUNK}, "kv": "real (--kvsrc)" if args.kvsrc else "synthetic", "cells": []}
    r.use_link(100.0)
    for p in STORED:  # decoders, staging and the estimator's decode rates (a sidecar's first fetch of a format teaches nothing)
        for _ in range(2):
            r.fetch(min(2048, args.contexts[0]), p, 1.0, 60)
    for gbps in args.links:
        r.use_link(gbps)
        r.fetch(min(8 * CHUNK, args.contexts[0]), "raw", 1.0, 60)  # the sidecars measure this link, as serving ones would have
        for ctx in args.contexts:
            box = max(2.0, 2 * rec[ctx])
            cell = {"context": ctx, "gbps": gbps, "recompute_s": rec[ctx], "box_s": box}
            for m in METHODS:
                least = world * ctx // CHUNK * sizes.get(m, 0) / (gbps * 1e9 / 8)  # every rank's bytes over the one link
                if least > box:
                    cell[m] = {"seconds": None, "skipped": "bytes / link exceeds the box"}
                    continue
                cell[m] = r.fetch(ctx, None if m == "auto" else m, rec[ctx], box)
            res["cells"].append(cell)
            if rank == 0:
                print(json.dumps(cell), flush=True)
    if r.sidecar.workers is not None:
        r.sidecar.workers.close()
    r.shared.close()
    res["wall_s"] = time.perf_counter() - t0
    return res if rank == 0 else None


def _rank_main(rank: int, world: int, args, link: linkstore.Link, port: int, link_dir: str) -> None:
    if torch.cuda.is_available() and not args.dry:
        torch.cuda.set_device(rank)
    backend = "nccl" if torch.cuda.is_available() and not args.dry else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        res = measure(rank, world, args, link, link_dir)
        if res is not None:
            Path(args.out).write_text(json.dumps(res, indent=1))
    finally:
        dist.destroy_process_group()


def _fmt(x) -> str:
    return "—" if x is None else f"{x:.2f}"


def report(res: dict) -> str:
    """A markdown table of the results."""
    rows = [f"# TP{res['world']} {res['shape']}, shared link ({res['device']}, {res['date']}, {res['kv']} KV)", "",
            "Seconds until every rank holds the prefix's KV (recompute: the TP prefill, scaled from two subset depths). "
            "`—`: not run (bytes / link past the box of 2x recompute) or failed.", "",
            "| context | link Gbit/s | recompute | raw | balanced | auto | auto chose | auto vs best of raw, recompute |",
            "|---|---|---|---|---|---|---|---|"]
    for c in res["cells"]:
        best = min(x for x in (c["raw"].get("seconds"), c["recompute_s"]) if x is not None)
        a = c["auto"].get("seconds")
        rows.append(f"| {c['context'] / 1024:g}K | {c['gbps']:g} | {c['recompute_s']:.2f} | {_fmt(c['raw'].get('seconds'))} | "
                    f"{_fmt(c['balanced'].get('seconds'))} | {_fmt(a)} | {c['auto'].get('decision')} | {f'{best / a:.2f}x' if a else '—'} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=max(1, torch.cuda.device_count()))
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", default=None, help="tokens, comma-separated (default 16K,32K,64K,128K; --dry: 512,1024)")
    ap.add_argument("--links", default=None, help="Gbit/s of the shared link, comma-separated (default 10,25,100; --dry: 1,10)")
    ap.add_argument("--kvsrc", default=None, help="real KV (python -m benchmarks.lib.kvsource); default synthetic")
    ap.add_argument("--distinct", type=int, default=2)
    ap.add_argument("--procs", type=int, default=8, help="decode worker processes per rank's sidecar (GPU)")
    ap.add_argument("--shape", default="llama3-70b", choices=sorted(SHAPES))
    ap.add_argument("--dry", action="store_true", help="CPU smoke run: gloo, the tiny shape, small contexts")
    a = ap.parse_args(argv)
    a.contexts = [int(x) for x in (a.contexts or ("512,1024" if a.dry else "16384,32768,65536,131072")).split(",")]
    a.links = [float(x) for x in (a.links or ("1,10" if a.dry else "10,25,100")).split(",")]
    link = linkstore.Link(100e9 / 8, latency_s=0.002)
    standin.ensure(FINGERPRINT)  # once, before the ranks plan and encode with it
    with tempfile.TemporaryDirectory(prefix="kvf-tp-link-") as link_dir:
        mp.spawn(_rank_main, args=(a.world, a, link, free_port(), link_dir), nprocs=a.world, join=True)
    print(report(json.loads(Path(a.out).read_text())))


if __name__ == "__main__":
    main()
