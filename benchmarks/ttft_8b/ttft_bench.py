"""Issue 5's race: time to first token, recompute vs fetch (kvfetcher presets, auto, peers).

One GPU, a Llama-3-8B-shaped model with random bf16 weights (timing only), contexts of 4K,
16K and 32K tokens, links of 1-100 Gbit/s emulated by ``linkserver`` (an S3-compatible
server on loopback, one token bucket shared by all connections). kvfetcher fetches through
the real sidecar (``service.Sidecar.fetch``: LIST lookup, cost model, ``pipeline.fetch`` over
``S3Store``); the peers (``peers``) through the same store and link. TTFT is the time until
the first output token's logits exist: a full prefill for recompute; for a fetch, the fetch
plus one decode step over the restored KV. ``auto`` is the sidecar's own choice with its
estimator's measured rates (fed by the fetches before it at that link) and the measured
prefill rate; when it picks recompute, the prefill runs and is counted.

The stored KV: a few distinct 8B-shaped chunks tiled from real SmolLM2 KV (``kvsource``),
encoded once per preset and stored under the names of every chunk of the context, so sizes
and decode work are those of real, distinct chunks. A cell slower than its time-box (a
multiple of recompute) is stopped at the box and reported as "> box".

    python -m benchmarks.ttft_8b.ttft_bench --kvsrc kvsrc.pt --out results/ [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

from benchmarks.lib import kvsource, linkserver, peers
from benchmarks.lib.llama8b import Config, Llama

from kvfetcher import ipc, keys, service
from kvfetcher.format import presets
from benchmarks.lib.standin import encode_chunk  # a stand-in calibration for random-weight shapes
from kvfetcher.store.s3 import S3Store
from kvfetcher.fetch.plan import FetchOptions

FINGERPRINT = "llama-3-8b-shape/random-bf16"
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the harness only


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()
BUCKET = "bench"
CHUNK = 256


def log(*a) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def kv_presets() -> list[str]:
    """Every preset main has except ``exact`` (it expands KV: never a contender)."""
    return [p for p in presets.PRESETS if p != "exact"]


def _encode(args) -> tuple[str, int, bytes, float]:
    preset, i, kv = args
    torch.set_num_threads(1)
    t = time.perf_counter()
    obj = encode_chunk(kv, preset, FINGERPRINT, start=0, rope_theta=kvsource.LLAMA3_THETA)
    return preset, i, obj, time.perf_counter() - t


def prepare(root: Path, distinct: list[torch.Tensor], tokens: list[int], n_chunks: int, workers: int, reuse: bool = False) -> dict:
    """Encode each distinct chunk once per preset and peer; link every chunk name to one of them."""
    info: dict = {"distinct_chunks": len(distinct), "objects": {}}
    store_dir = root / BUCKET
    ns = keys.Namespace(model=FINGERPRINT, dtype="bfloat16")
    ck = keys.chunk_keys(ns, tokens[: n_chunks * CHUNK], CHUNK)
    if reuse and (root / "prepared.json").exists():  # a dry run's second go: same objects
        return json.loads((root / "prepared.json").read_text()) | {"keys": ck}
    shutil.rmtree(root, ignore_errors=True)
    (store_dir / "blobs").mkdir(parents=True)
    kv_bytes = distinct[0].numel() * distinct[0].element_size()

    t = time.perf_counter()
    jobs = [(p, i, kv) for p in kv_presets() for i, kv in enumerate(distinct)]
    with mp.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
        done = pool.map(_encode, jobs)
    for p in kv_presets():
        blobs = [obj for q, i, obj, _ in sorted(done, key=lambda r: r[1]) if q == p]
        info["objects"][p] = publish(store_dir, p, blobs, lambda c, p=p: keys.object_name(ck[c], p), n_chunks, kv_bytes)
        info["objects"][p]["encode_s_per_chunk_one_core"] = statistics.mean(s for q, _, _, s in done if q == p)
    log(f"kvfetcher presets encoded in {time.perf_counter() - t:.1f} s:", {p: round(info['objects'][p]['ratio_vs_bf16'], 3) for p in kv_presets()})
    (root / "prepared.json").write_text(json.dumps(info))
    return info | {"keys": ck}


def publish(store_dir: Path, label: str, blobs: list[bytes], name_of, n_chunks: int, kv_bytes: int) -> dict:
    """Write the distinct objects once and hard-link them under every chunk's name; their sizes."""
    paths = []
    for i, b in enumerate(blobs):
        p = store_dir / "blobs" / f"{label}.{i}"
        p.write_bytes(b)
        paths.append(p)
    for c in range(n_chunks):
        dst = store_dir / name_of(c)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.unlink(missing_ok=True)
        os.link(paths[c % len(paths)], dst)
    mean = statistics.mean(len(b) for b in blobs)
    return {"bytes_per_chunk": mean, "ratio_vs_bf16": kv_bytes / mean}


def make_peers(distinct: list[torch.Tensor], root: Path, n_chunks: int, info: dict, names: Sequence[str] = ("q8zstd", "nvcomp", "cachegen")) -> dict:
    """Build each peer (a broken one is reported, not faked) and store its objects."""
    made, blocked = {}, {}
    for name in names:
        try:
            t = time.perf_counter()
            if name == "q8zstd":
                peer = peers.Q8Zstd()
            elif name == "nvcomp":
                peer, trials = peers.pick_nvcomp(distinct[0])
                info["nvcomp_trials"] = trials
            else:
                peer = peers.CacheGen()
            blobs = [peer.encode(kv.to(DEV)) for kv in distinct]
            kvb = distinct[0].numel() * distinct[0].element_size()
            info["objects"][name] = publish(root / BUCKET, name, blobs, lambda c, name=name: f"peers/{name}/{c}.obj", n_chunks, kvb)
            info["objects"][name]["encode_s"] = (time.perf_counter() - t) / len(blobs)
            if name == "nvcomp":
                info["objects"][name]["codec"] = peer.label
            if name == "cachegen":
                info["objects"][name]["impl"] = peer.impl
                info["objects"][name]["notes"] = peer.notes
            made[name] = peer
            # check the round trip once: a peer that restores garbage is not a peer
            buf = torch.zeros(distinct[0].shape, dtype=torch.bfloat16, device=DEV)
            h, base = peers.parse_head(blobs[0])
            side = peer.side(h, blobs[0][base : base + h["side"]], buf.device) if h["side"] else None
            for part in h["parts"]:
                peer.decode_part(h, side, part, blobs[0][base + part["off"] : base + part["off"] + part["len"]], buf)
            ref = distinct[0].to(DEV).float()
            err = (buf.float() - ref).abs().mean() / ref.abs().mean()
            info["objects"][name]["rel_mean_abs_error"] = float(err)
            log(f"peer {name}: ratio {info['objects'][name]['ratio_vs_bf16']:.3f}, rel. error {float(err):.4f}", info["objects"][name].get("codec", ""), info["objects"][name].get("impl", ""))
        except Exception as e:
            blocked[name] = f"{type(e).__name__}: {e}"[:500]
            log(f"peer {name} BLOCKED: {blocked[name]}")
    info["blocked"] = blocked
    return made


class DryModel:
    """No GPU (a dry run of the harness on a CPU machine): the model's steps become short sleeps."""

    cfg = Config()

    def kv_buffer(self, capacity: int) -> torch.Tensor:
        c = self.cfg
        return torch.zeros((c.layers, 2, c.kv_heads, capacity, c.head_dim), dtype=torch.bfloat16)

    def prefill(self, ids, kv) -> None:
        time.sleep(1e-5 * len(ids))

    def first_token(self, kv, ctx) -> None:
        time.sleep(0.01)


def time_gpu(fn, reps: int = 3) -> list[float]:
    out = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return out


class Race:
    """Everything one TTFT cell needs: model, sidecar, peers, buffers, pools."""

    def __init__(self, model: Llama, url: str, tokens: list[int], contexts: list[int], peer_objs: dict, decode_workers: int,
                 decode_procs: int | None = None, shared_buffer: bool = False, auto_presets: Sequence[str] | None = None):
        self.model, self.tokens, self.peers = model, tokens, peer_objs
        self.store = S3Store(url, BUCKET, "bench", "bench", pool=64, read_timeout_s=120)
        cfg = service.Config(chunk_tokens=CHUNK, trust_store=True, presets=tuple(kv_presets()), rope_theta=kvsource.LLAMA3_THETA,
                             decode_workers=decode_workers, io_workers=32, window=4)
        self.auto_presets = list(auto_presets) if auto_presets else None  # what auto may choose among
        if decode_procs is not None and hasattr(cfg, "decode_procs"):
            cfg.decode_procs = decode_procs
        self.sidecar = service.Sidecar(self.store, cfg)
        self.bufs, self.bids = {}, {}
        # decode worker processes (when main has them) write through the buffer's CUDA IPC handle
        with_handle = "handle" in {f.name for f in dataclasses.fields(service.Buffer)}
        one = model.kv_buffer(max(contexts) + 1) if shared_buffer else None  # one registered buffer for all contexts
        for ctx in contexts:
            buf = one if one is not None else model.kv_buffer(ctx + 1)
            self.bufs[ctx] = buf
            bid = f"ctx{ctx}"
            ns = keys.Namespace(model=FINGERPRINT, dtype="bfloat16")
            self.sidecar.buffers[bid] = service.Buffer(buf, ns, ipc.cuda_handle(buf)) if with_handle and buf.is_cuda else service.Buffer(buf, ns)
            self.bids[ctx] = bid
        self.decode_procs = 0
        distinct = list({id(b.tensor): b for b in self.sidecar.buffers.values()}.values())  # one, with --shared-buffer
        if getattr(self.sidecar, "workers", None) is not None:
            self.sidecar.workers.start()
            self.decode_procs = self.sidecar.workers.procs
            for buf in distinct:
                if buf.handle is not None:
                    self.sidecar.workers.open(buf.handle)
        for buf in distinct:  # as Sidecar.register does
            self.sidecar.warm_buffer(buf)
        self.peer_io = ThreadPoolExecutor(32)
        self.peer_dec = ThreadPoolExecutor(decode_workers * 2)

    def fresh_io(self) -> None:
        """After a time-boxed fetch, GETs and decodes still in flight finish in their threads:
        wait for them (they would eat the next cell's link and GPU) and start new pools."""
        for obj, attr in ((self.sidecar, "io_pool"), (self, "peer_io"), (self.sidecar, "decode_pool"), (self, "peer_dec")):
            old = getattr(obj, attr)
            setattr(obj, attr, ThreadPoolExecutor(old._max_workers))
            old.shutdown(wait=True)
        for w in getattr(getattr(self.sidecar, "workers", None), "_workers", []):  # chunks still in decode workers
            with w.lock:
                pass

    def first_token(self, ctx: int) -> float:
        t = time.perf_counter()
        self.model.first_token(self.bufs[ctx], ctx)
        sync()
        return time.perf_counter() - t

    def recompute(self, ctx: int) -> float:
        ids = torch.tensor(self.tokens[:ctx], device=DEV) % self.model.cfg.vocab
        sync()
        t = time.perf_counter()
        self.model.prefill(ids, self.bufs[ctx])
        sync()
        return time.perf_counter() - t

    async def kvfetcher(self, ctx: int, preset: str | None, box: float, recompute_tps: float) -> dict:
        """``preset`` forced (recompute never chosen), or None: the sidecar's automatic choice."""
        t0 = time.perf_counter()
        kw = {"presets": (preset,), "recompute_tokens_per_s": 1e-9} if preset else {"recompute_tokens_per_s": recompute_tps, "presets": self.auto_presets}
        r = dataclasses.asdict(await self.sidecar.fetch(self.bids[ctx], self.tokens[:ctx], options=FetchOptions(deadline_s=box, **kw)))
        fetch_s = time.perf_counter() - t0
        rec = {"fetch_s": fetch_s, "bytes_read": r.get("bytes_read", 0), "decision": r.get("decision"), "error": r.get("error"),
               "lookup_s": r.get("lookup_s")}
        if r["loaded_tokens"] == ctx and not r.get("error"):
            rec["step_s"] = self.first_token(ctx)
            rec["ttft_s"] = time.perf_counter() - t0
        elif preset is None:  # auto chose recompute (or its fetch failed): the model prefills, counted
            if r.get("error"):
                self.fresh_io()
            rec["prefill_s"] = self.recompute(ctx)
            rec["ttft_s"] = time.perf_counter() - t0
        else:  # past the box (a deadline is checked between steps: the overrun is recorded in fetch_s)
            self.fresh_io()
            rec["ttft_s"] = None
        return rec

    async def peer(self, ctx: int, name: str, box: float, n_chunks: int | None = None) -> dict:
        names = [f"peers/{name}/{c}.obj" for c in range(n_chunks or ctx // CHUNK)]
        t0 = time.perf_counter()
        r = await peers.fetch(self.store, names, self.peers[name], self.bufs[ctx], chunk_tokens=CHUNK,
                              io_pool=self.peer_io, decode_pool=self.peer_dec, deadline_s=box)
        rec = {"fetch_s": time.perf_counter() - t0, "bytes_read": r["bytes_read"], "error": r["error"],
               "read_busy_s": r["read_busy_s"], "decode_busy_s": r["decode_busy_s"]}
        if r["error"] is None and n_chunks is None:
            rec["step_s"] = self.first_token(ctx)
            rec["ttft_s"] = time.perf_counter() - t0
        elif r["error"] is not None:
            self.fresh_io()
            rec["ttft_s"] = None
        return rec

    async def warm_estimator(self, ctx: int, chunks: int = 4) -> None:
        """A sidecar on a steady link has measured it: one small fetch (the smallest preset) at
        each new link rate, so ``auto`` decides with this link's measured bandwidth."""
        smallest = min(kv_presets(), key=lambda p: self.sizes.get(p, 1e18))
        n = min(chunks, ctx // CHUNK) * CHUNK
        await self.sidecar.fetch(self.bids[ctx], self.tokens[:n], options=FetchOptions(deadline_s=60, presets=[smallest], recompute_tokens_per_s=1e-9))


def link_probe(url: str, root: Path, rate_Bps: float, seconds: float = 0.5) -> dict:
    """What the emulated link delivers to the S3 client: parallel 8 MB ranged GETs of raw objects."""
    s = S3Store(url, BUCKET, "bench", "bench", pool=64)
    names = sorted(p.name for p in (root / BUCKET / "blobs").glob("raw.*"))
    n = int(min(256, max(8, rate_Bps * seconds / 8e6))) if rate_Bps else 128
    jobs = [(f"blobs/{names[i % len(names)]}", (i * 8_000_000) % 24_000_000, 8_000_000) for i in range(n)]
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda j: s.get(*j), jobs[:8]))  # connections up
        t = time.perf_counter()
        got = sum(len(b) for b in ex.map(lambda j: s.get(*j), jobs))
        dt = time.perf_counter() - t
    return {"set_Gbps": rate_Bps * 8 / 1e9, "delivered_Gbps": got * 8 / dt / 1e9, "bytes": got, "seconds": dt}


LINK_ROOT = "/tmp/kvbench"


def median(xs):
    return statistics.median(xs) if xs else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvsrc", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--links", default="100,40,25,10,5,1", help="Gbit/s, fastest first (see the skip rule)")
    ap.add_argument("--distinct", type=int, default=4)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--decode-workers", type=int, default=4)
    ap.add_argument("--box-factor", type=float, default=2.0, help="time-box: this many times recompute ...")
    ap.add_argument("--box-min", type=float, default=1.5, help="... but at least this many seconds")
    ap.add_argument("--cheap-s", type=float, default=0.5, help="cells faster than this are run 3 times (median)")
    ap.add_argument("--methods", default="", help="comma list to restrict (default: all)")
    ap.add_argument("--link-root", default=LINK_ROOT, help="where the stored objects are written")
    ap.add_argument("--reuse-objects", action="store_true", help="keep the kvfetcher objects a previous run encoded there")
    ap.add_argument("--decode-procs", type=int, default=None, help="sidecar decode worker processes (default: main's)")
    ap.add_argument("--peers", default="q8zstd,nvcomp,cachegen")
    ap.add_argument("--auto-presets", type=lambda v: v.split(","), default=["raw", "q8", "balanced"],
                    help="what auto may choose among: the accuracy-preserving presets (compression.md)")
    ap.add_argument("--shared-buffer", action="store_true", help="one registered KV buffer for all contexts")
    ap.add_argument("--check-workers", action="store_true", help="fall back to decode threads if workers fail on the largest context")
    ap.add_argument("--interference", action="store_true", help="then measure interference (interference.py) on the same store")
    ap.add_argument("--interference-ctx", type=int, default=16384)
    ap.add_argument("--interference-link", type=float, default=100.0)
    ap.add_argument("--interference-s", type=float, default=4.0)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    contexts = [int(x) for x in a.contexts.split(",")]
    links = [float(x) for x in a.links.split(",")]
    t_start = time.perf_counter()

    res: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "model": "Llama-3-8B shape (32 layers, 32 heads, 8 KV heads, head_dim 128, hidden 4096, inter 14336, vocab 128256), random bf16 weights, SDPA",
        "kv": "bf16; 8B-shaped chunks tiled from real SmolLM2-135M KV (benchmarks/lib/kvsource.py), a few distinct chunks stored under every chunk name",
        "link": "benchmarks/lib/linkserver.py: S3-compatible server on loopback, one token bucket shared by all connections, no added latency",
        "contexts": contexts, "links_gbps": links, "chunk_tokens": CHUNK, "presets_on_main": list(presets.PRESETS),
        "decode_workers": a.decode_workers, "cheap_s": a.cheap_s,
    }
    src = torch.load(a.kvsrc)
    distinct = kvsource.chunks(src, a.distinct)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128000, (max(contexts),), generator=g).tolist()
    root = Path(a.link_root)
    info = prepare(root, distinct, tokens, max(contexts) // CHUNK, a.workers, reuse=a.reuse_objects)
    peer_objs = make_peers(distinct, root, max(contexts) // CHUNK, info, [p for p in a.peers.split(",") if p])
    info.pop("keys")
    res["setup"] = info
    url, server = linkserver.start_process(root)
    log("link server at", url)

    model = Llama() if DEV == "cuda" else DryModel()
    race = Race(model, url, tokens, contexts, peer_objs, a.decode_workers, a.decode_procs, a.shared_buffer, a.auto_presets)
    race.sizes = {k: v["bytes_per_chunk"] for k, v in info["objects"].items()}
    res["decode_procs"] = race.decode_procs  # 0: NVDEC in the sidecar's threads
    rec_s = {}
    for ctx in contexts:
        race.recompute(ctx)  # warm-up
        xs = [race.recompute(ctx) for _ in range(3)]
        rec_s[ctx] = median(xs)
        log(f"recompute {ctx}: {[round(x, 4) for x in xs]}")
    res["recompute_s"] = rec_s
    res["first_token_step_s"] = {ctx: median([race.first_token(ctx) for _ in range(3)]) for ctx in contexts}

    methods = ["recompute", *kv_presets(), "auto", *peer_objs]
    if a.methods:
        keep = a.methods.split(",")
        methods = [m for m in methods if m in keep]
    res["methods"], res["auto_presets"] = methods, a.auto_presets
    res["probes"], res["cells"] = [], []
    # warm every path once (decoder creation, CUDA contexts, connections) at an unlimited link
    for m in methods:
        if m in presets.PRESETS:
            asyncio.run(race.kvfetcher(contexts[0], m, 60, 1e15))
        elif m in peer_objs:
            asyncio.run(race.peer(contexts[0], m, 60, n_chunks=1))
    if race.decode_procs and a.check_workers:  # main's decode worker processes: do they restore the largest context?
        chk = asyncio.run(race.kvfetcher(contexts[-1], "lean", 60, 0))
        if chk["ttft_s"] is None:
            res["worker_path_error"] = chk.get("error")
            log(f"decode workers failed on {contexts[-1]} tokens ({chk.get('error')}): falling back to decode threads")
            race.sidecar.workers.close()
            race = Race(model, url, tokens, contexts, peer_objs, a.decode_workers, 0, a.shared_buffer, a.auto_presets)
            race.sizes = {k: v["bytes_per_chunk"] for k, v in info["objects"].items()}
            res["decode_procs"] = 0
            for m in methods:
                if m in presets.PRESETS:
                    asyncio.run(race.kvfetcher(contexts[0], m, 60, 0))
    log(f"setup done at {time.perf_counter() - t_start:.0f} s")

    censored: dict[str, list[tuple[float, int]]] = {m: [] for m in methods}
    for gbps in links:
        rate = gbps * 1e9 / 8
        linkserver.set_rate(url, rate)
        probe = link_probe(url, root, rate)
        res["probes"].append(probe)
        log(f"link {gbps:g} Gbit/s delivers {probe['delivered_Gbps']:.2f} Gbit/s")
        asyncio.run(race.warm_estimator(contexts[0]))
        for ctx in contexts:
            box = max(a.box_min, a.box_factor * rec_s[ctx])
            for m in methods:
                # Skip rule: a method past its box at a faster link and a context no longer than
                # this one is past it here too (fetch time grows with bytes and falls with rate).
                if any(g >= gbps and c <= ctx for g, c in censored[m]):
                    res["cells"].append({"link_gbps": gbps, "ctx": ctx, "method": m, "box_s": box, "ttft_s": None,
                                         "censored": True, "skipped": True, "runs": []})
                    log(f"  {gbps:g}G ctx {ctx} {m}: >{box:.1f}s (skipped: past its box at a faster link / shorter context)")
                    continue
                runs = []
                while True:
                    if m == "recompute":
                        r = {"ttft_s": race.recompute(ctx)}
                    elif m == "auto":
                        r = asyncio.run(race.kvfetcher(ctx, None, box, ctx / rec_s[ctx]))
                    elif m in presets.PRESETS:
                        r = asyncio.run(race.kvfetcher(ctx, m, box, 0))
                    else:
                        r = asyncio.run(race.peer(ctx, m, box))
                    runs.append(r)
                    if r["ttft_s"] is None or r["ttft_s"] > a.cheap_s or len(runs) == 3:
                        break
                ok = [r["ttft_s"] for r in runs if r["ttft_s"] is not None]
                cell = {"link_gbps": gbps, "ctx": ctx, "method": m, "box_s": box, "ttft_s": median(ok) if len(ok) == len(runs) else None,
                        "censored": len(ok) < len(runs), "runs": runs}
                fr = [r for r in runs if r.get("bytes_read") and r.get("fetch_s")]
                if fr:
                    cell["effective_Gbps"] = median([r["bytes_read"] * 8 / r["fetch_s"] / 1e9 for r in fr])
                if m == "auto":
                    cell["chose"] = [(r.get("decision") or {}).get("preset") for r in runs]
                res["cells"].append(cell)
                if cell["censored"]:
                    censored[m].append((gbps, ctx))
                shown = f"{cell['ttft_s']:.3f}s" if cell["ttft_s"] is not None else f">{box:.1f}s"
                log(f"  {gbps:g}G ctx {ctx} {m}: {shown}" + (f" chose {cell['chose']}" if m == "auto" else ""))
        (out / "ttft.json").write_text(json.dumps(res, indent=1, default=str))
    res["wall_s"] = time.perf_counter() - t_start
    (out / "ttft.json").write_text(json.dumps(res, indent=1, default=str))
    log(f"TTFT done in {res['wall_s']:.0f} s")

    if a.interference:
        from benchmarks.ttft_8b import interference

        del race.bufs
        if getattr(race.sidecar, "workers", None) is not None:
            race.sidecar.workers.close()
        if DEV == "cuda":
            torch.cuda.empty_cache()
        linkserver.set_rate(url, a.interference_link * 1e9 / 8)
        ires = interference.run(model, url, tokens, a.interference_ctx, peer_objs, methods, a.decode_workers, a.interference_s,
                                      decode_procs=res["decode_procs"], shared_buffer=a.shared_buffer)
        ires |= {k: res[k] for k in ("date", "device", "torch", "model", "kv", "link")}
        ires["link_gbps"] = a.interference_link
        (out / "interference.json").write_text(json.dumps(ires, indent=1, default=str))
    server.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
