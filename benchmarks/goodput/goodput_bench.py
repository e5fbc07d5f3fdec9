"""goodput_bench: serving on a busy GPU, where a recomputed prefix stalls everyone and a fetch does not.

One GPU serves a Llama-3-8B shape: ``--background`` requests decode continuously (batched decode
steps over per-request KV caches) while new requests arrive (Poisson, ``rate`` per second), each
with a long prefix shared by all (no local prefix cache: as if it were evicted or on another
replica) and a short unique suffix, and generate ``--output`` tokens. Per new request:

* ``recompute``: prefill of prefix + suffix on the GPU, between decode steps (the decode batch waits);
* ``raw`` / ``cachegen`` / kvfetcher's ``auto``: the prefix is fetched by a sidecar process (as the
  real sidecar is one) into that request's cache — kvfetcher's ``pipeline.fetch`` for raw and its
  presets, LMCache's CacheGen GPU decoder for the peer — while decoding goes on; then the GPU
  prefills only the suffix. ``auto`` decides per request with ``choice.choose``, fed with the
  sidecar's calibrated restore rates, the link speed shared by the fetches in flight and the
  prefill time times the prefills queued ahead (load-aware rates; the cost model itself is the
  sidecar's), and a TTFT budget (``--auto-budget``): a fetch predicted within it is taken even where
  recomputing would be faster, since it leaves the GPU to the running requests.

The link is emulated (``linkstore``: a shared FIFO pipe of the set speed plus 2 ms first-byte
latency), objects are synthetic (timing only). Goodput = requests meeting the TTFT and TPOT
SLOs per second of the arrival window.

    python -m benchmarks.goodput.goodput_bench measure --out benchmarks/goodput/result_h100.json
    python -m benchmarks.goodput.goodput_bench report benchmarks/goodput/result_h100.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

from benchmarks.lib import fetchkit, linkstore
from benchmarks.lib.llama_shape import LlamaShape

from kvfetcher.fetch import choice
from kvfetcher.fetch.prefill import PrefillModel
from kvfetcher.eval import costmodel
from kvfetcher import ipc
from kvfetcher.fetch.workers import DecodeWorkers

CHUNK = 256
AUTO_SET = ("raw", "q8")  # kvfetcher presets auto may pick (greedy agreement 1.000)


# -- the sidecar process ------------------------------------------------------------------------


def sidecar_main(pool: torch.Tensor, handles: list[dict] | None, shape_name: str, prefix: int, methods: list[str], requests: mp.Queue,
                 replies: mp.Queue, decode_workers: int, window: int, procs: int) -> None:
    """Holds the stored prefix per method and fetches it into ``pool[slot]`` on request; kvfetcher's
    fetches decode in ``procs`` worker processes that open ``handles[slot]`` (main's NVDEC path)."""
    torch.set_num_threads(4)
    shape = costmodel.SHAPES[shape_name]
    dev = pool.device
    chunks = prefix // CHUNK
    store = linkstore.LinkStore()
    refs: dict[str, list] = {}
    codec = None
    for m in methods:
        if m == "cachegen":
            try:
                codec = fetchkit.CacheGen(shape, str(dev))
                objs = [codec.encode(fetchkit.synthetic_kv(shape.layers, shape.kv_heads, CHUNK, shape.head_dim, torch.bfloat16, s)) for s in range(4)]
            except Exception as e:
                replies.put(("error", m, f"{type(e).__name__}: {e}"))
                continue
        elif m == "raw-direct":
            objs = fetchkit.raw_objects(shape, CHUNK)
        else:
            objs = fetchkit.encode_objects(shape, m, CHUNK, distinct=4, workers=8)
        refs[m] = fetchkit.put_prefix(store, m, objs, chunks)
    workers = DecodeWorkers(procs) if procs and handles else None
    if workers:
        workers.start()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    io, dec = ThreadPoolExecutor(32), ThreadPoolExecutor(decode_workers)
    kv_bytes = costmodel.kv_bytes(shape, chunks * CHUNK)

    def fetch(method: str, slot: int) -> float:
        if method == "cachegen":
            return fetchkit.fetch_cachegen(store, refs[method], pool[slot], 0, codec, io, window)
        if method == "raw-direct":
            return fetchkit.fetch_raw_direct(store, refs[method], pool[slot], 0, io, window)
        h = handles[slot] if workers else None
        o = asyncio.run_coroutine_threadsafe(fetchkit.fetch_kvfetcher(store, refs[method], pool[slot], 0, io, dec, window, workers, h), loop).result()
        if o.error:
            raise RuntimeError(f"{o.error}: {o.detail}")
        return o.seconds

    # Calibrate: the restore rate of each path with downloads free (what the estimator would hold).
    store.link = None
    rates = {}
    for m in refs:
        fetch(m, 0)
        rates[m] = kv_bytes / min(fetch(m, 0) for _ in range(2))
    sizes = {m: sum(r.size for r in refs[m]) for m in refs}
    replies.put(("ready", rates, sizes))

    def serve(run: int, rid: int, method: str, slot: int) -> None:
        t = time.perf_counter()
        try:
            fetch(method, slot)
            replies.put(("done", run, rid, time.perf_counter() - t, None))
        except Exception as e:  # the model recomputes
            replies.put(("done", run, rid, time.perf_counter() - t, f"{type(e).__name__}: {e}"))

    fetchers = ThreadPoolExecutor(64)
    while True:
        msg = requests.get()
        if msg[0] == "link":
            store.link = linkstore.Link(msg[1], latency_s=0.002) if msg[1] else None
            replies.put(("link-set",))
        elif msg[0] == "fetch":
            fetchers.submit(serve, *msg[1:])
        elif msg[0] == "stop":
            break
    if workers:
        workers.close()


# -- the serving loop ---------------------------------------------------------------------------


@dataclass
class Req:
    rid: int
    arrival: float
    slot: int = -1
    method: str = ""
    background: bool = False
    length: int = 0  # tokens in its cache
    token: int = 0
    start: float = 0.0  # admitted (slot taken)
    fetched: float = 0.0
    first: float = 0.0
    token_times: list[float] = field(default_factory=list)
    fetch_s: float = 0.0
    fallback: bool = False


class Server:
    def __init__(self, args, model: LlamaShape, pool: torch.Tensor, requests: mp.Queue, replies: mp.Queue, rates: dict, sizes: dict):
        self.args, self.model, self.pool = args, model, pool
        self.requests, self.replies = requests, replies
        self.restore_Bps, self.sizes = rates, sizes
        self.dev = model.device
        self.prefill_s = 1.0  # of the whole prefix on an idle GPU: measured at warm-up
        self.run_id = 0  # tags fetch requests, so a late reply from an earlier run is not taken for this one's

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def warm(self) -> None:
        a = self.args
        ids = torch.randint(0, self.model.shape.vocab, (a.prefix + a.suffix,), device=self.dev)
        for _ in range(2):  # the second round is the one timed (allocator and kernels warm)
            self.sync()
            t = time.perf_counter()
            self.model.prefill(ids, self.pool[0])
            self.sync()
            self.prefill_s = time.perf_counter() - t
            t = time.perf_counter()
            self.model.prefill(ids[a.prefix :], self.pool[0], start=a.prefix)
            self.sync()
            self.suffix_s = time.perf_counter() - t

    def decide(self, method: str, fetching: int, prefills_queued: int) -> str:
        """``auto``: the sidecar's choice with the TTFT budget; ``auto-fastest``: without (least predicted TTFT)."""
        if method not in ("auto", "auto-fastest"):
            return method
        a = self.args
        shape = self.model.shape
        n = a.prefix // CHUNK
        link = a.link_gbps * 1e9 / 8 / (1 + fetching)
        decode = {m: r / (1 + fetching) for m, r in self.restore_Bps.items() if m in AUTO_SET}
        rates = choice.Rates(link, 0.002, decode, PrefillModel.linear(a.prefix / (self.prefill_s * (1 + prefills_queued))))
        stored = [{m: self.sizes[m] // n for m in decode}] * n
        budget = None if method == "auto-fastest" else a.auto_budget if a.auto_budget is not None else 0.75 * a.ttft_slo
        d = choice.choose(stored, CHUNK, costmodel.kv_bytes(shape, CHUNK), {m: "raw" if m == "raw" else "hevc" for m in decode}, rates,
                          budget_s=budget or None)
        return d.preset

    def run(self, method: str, rate: float, seed: int) -> dict:
        a = self.args
        self.run_id += 1
        rng = np.random.default_rng(seed)
        arrivals = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * a.duration * 3) + 10))
        arrivals = arrivals[arrivals < a.duration]
        S = self.pool.shape[0]
        free = list(range(S))
        bg = []
        for i in range(a.background):  # the busy GPU: requests already decoding, caches full-length
            r = Req(-1 - i, 0.0, slot=free.pop(0), background=True, length=a.prefix + a.suffix, token=1)
            bg.append(r)
        news = [Req(i, float(t)) for i, t in enumerate(arrivals)]
        waiting: list[Req] = []  # arrived, no slot yet
        prefill_q: list[Req] = []  # recompute (whole) or suffix after fetch
        fetching: dict[int, Req] = {}
        running: list[Req] = list(bg)
        done: list[Req] = []
        nxt = 0
        suffix_ids = torch.randint(0, self.model.shape.vocab, (a.suffix,), device=self.dev)
        prefix_ids = torch.randint(0, self.model.shape.vocab, (a.prefix,), device=self.dev)
        full_ids = torch.cat([prefix_ids, suffix_ids])
        t0 = time.perf_counter()
        steps, stalls = 0, []
        last_step = None
        while True:
            now = time.perf_counter() - t0
            while nxt < len(news) and news[nxt].arrival <= now:
                waiting.append(news[nxt])
                nxt += 1
            while waiting and free:
                r = waiting.pop(0)
                free.sort()  # lowest slot first: the decode step's span of slots stays compact
                r.slot, r.start = free.pop(0), now
                queued = sum(1 for q in prefill_q if q.method == "recompute")
                r.method = self.decide(method, len(fetching), queued)
                if r.method == "recompute":
                    prefill_q.append(r)
                else:
                    fetching[r.rid] = r
                    self.requests.put(("fetch", self.run_id, r.rid, r.method, r.slot))
            while True:
                try:
                    msg = self.replies.get_nowait()
                except queue.Empty:
                    break
                if msg[0] == "done" and msg[1] == self.run_id and msg[2] in fetching:
                    r = fetching.pop(msg[2])
                    r.fetch_s, r.fetched = msg[3], time.perf_counter() - t0
                    if msg[4]:
                        r.fallback, r.method = True, "recompute"
                    prefill_q.append(r)
            if prefill_q:  # one prefill, then a decode step: the batch waits for it
                r = prefill_q.pop(0)
                if r.method == "recompute":
                    tok = self.model.prefill(full_ids, self.pool[r.slot])
                else:
                    tok = self.model.prefill(suffix_ids, self.pool[r.slot], start=a.prefix)
                r.token, r.length = int(tok), a.prefix + a.suffix
                r.first = time.perf_counter() - t0
                r.token_times.append(r.first)
                running.append(r)
            if running:
                slots = torch.tensor([r.slot for r in running], device=self.dev)
                lengths = torch.tensor([r.length for r in running], device=self.dev)
                toks = torch.tensor([r.token for r in running], device=self.dev)
                out = self.model.decode_step(toks, self.pool, slots, lengths).tolist()
                t = time.perf_counter() - t0
                if last_step is not None:
                    stalls.append(t - last_step)
                last_step = t
                steps += 1
                keep = []
                for r, tok in zip(running, out):
                    r.token, r.length = tok, r.length + 1
                    r.token_times.append(t)
                    if r.background:
                        if r.length >= self.pool.shape[4] - 1:
                            r.length = a.prefix + a.suffix
                        keep.append(r)
                    elif len(r.token_times) >= a.output:
                        done.append(r)
                        free.append(r.slot)
                    else:
                        keep.append(r)
                running = keep
            elif not prefill_q:
                time.sleep(0.0005)
            finished = nxt == len(news) and not waiting and not prefill_q and not fetching and all(r.background for r in running)
            if finished or now > a.duration + a.drain:
                break
        unfinished = len(news) - len(done)
        self.settle(len(fetching))
        return self.summarise(method, rate, news, done, bg, unfinished, steps, stalls)

    def settle(self, outstanding: int) -> None:
        """Let fetches still in flight at the end of a run finish (link unthrottled) before the next
        run, so they neither share its link nor answer into it."""
        if not outstanding:
            return
        link = self.args.link_gbps * 1e9 / 8 if self.args.link_gbps else None
        self.requests.put(("link", None))
        end = time.perf_counter() + 120
        while outstanding and time.perf_counter() < end:
            try:
                msg = self.replies.get(timeout=1)
            except queue.Empty:
                continue
            if msg[0] == "done" and msg[1] == self.run_id:
                outstanding -= 1
        self.requests.put(("link", link))
        while self.replies.get()[0] != "link-set":
            pass

    def summarise(self, method, rate, news, done, bg, unfinished, steps, stalls) -> dict:
        a = self.args
        ttft = [r.first - r.arrival for r in done]
        tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in done if len(r.token_times) > 1]
        bg_gaps = [g for r in bg for g in np.diff(r.token_times).tolist()]
        ok = sum(1 for r in done if r.first - r.arrival <= a.ttft_slo and (r.token_times[-1] - r.token_times[0]) / max(1, len(r.token_times) - 1) <= a.tpot_slo)
        pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
        picks: dict[str, int] = {}
        for r in done:
            picks[r.method] = picks.get(r.method, 0) + 1
        return {
            "method": method, "link_gbps": a.link_gbps, "rate": rate, "arrived": len(news), "finished": len(done), "unfinished": unfinished,
            "goodput_rps": ok / a.duration, "slo_attainment": ok / max(1, len(news)),
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
            "bg_tpot_p50": pct(bg_gaps, 50), "bg_tpot_p99": pct(bg_gaps, 99),
            "fetch_s_p50": pct([r.fetch_s for r in done if r.fetch_s], 50), "picks": picks,
            "fallbacks": sum(r.fallback for r in done), "decode_steps": steps, "step_gap_max": max(stalls) if stalls else None,
        }


def measure(args) -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    shape = costmodel.SHAPES[args.shape]
    model = LlamaShape(shape, dev)
    cap = args.prefix + args.suffix + args.output + 8
    slot_bytes = shape.kv_bytes_per_token() * cap
    slots = args.slots
    if dev.type == "cuda":
        free_b, _ = torch.cuda.mem_get_info()
        slots = min(slots, int((free_b - args.reserve_gb * 2**30) // slot_bytes))
    pool = torch.zeros((slots, shape.layers, 2, shape.kv_heads, cap, shape.head_dim), dtype=torch.bfloat16, device=dev)
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    methods = [m for m in ("raw", "q8", "raw-direct", "cachegen") if m in set(args.stored.split(","))]
    handles = [ipc.cuda_handle(pool[i]) for i in range(slots)] if dev.type == "cuda" else None
    side = ctx.Process(target=sidecar_main, args=(pool, handles, args.shape, args.prefix, methods, requests, replies,
                                                  args.decode_workers, args.window, args.procs))
    side.start()
    t0 = time.perf_counter()
    errors = {}
    while True:
        try:
            msg = replies.get(timeout=5)
        except queue.Empty:
            if not side.is_alive():
                raise SystemExit("the sidecar process died before it was ready") from None
            continue
        if msg[0] == "error":
            errors[msg[1]] = msg[2]
            print("sidecar:", msg, flush=True)
        elif msg[0] == "ready":
            rates, sizes = msg[1], msg[2]
            break
    print(f"sidecar ready after {time.perf_counter() - t0:.0f} s: restore GB/s", {k: round(v / 1e9, 2) for k, v in rates.items()}, flush=True)
    server = Server(args, model, pool, requests, replies, rates, sizes)
    server.warm()
    print(f"prefill of {args.prefix + args.suffix} tokens {server.prefill_s:.3f} s, suffix {server.suffix_s:.4f} s, slots {slots}", flush=True)
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "date": datetime.date.today().isoformat(),
           "config": {k: v for k, v in vars(args).items() if k not in ("func",)}, "slots": slots, "restore_Bps": rates,
           "stored_bytes": sizes, "prefill_s": server.prefill_s, "suffix_prefill_s": server.suffix_s, "sidecar_errors": errors, "runs": []}
    plan = [("recompute", None)] + [(m, g) for g in args.links for m in args.methods if m != "recompute"]
    deadline = time.perf_counter() + args.budget_s
    for method, gbps in plan:
        if method not in ("recompute", "auto", "auto-fastest") and method not in rates:
            continue
        args.link_gbps = gbps or 0
        requests.put(("link", gbps * 1e9 / 8 if gbps else None))
        while replies.get()[0] != "link-set":
            pass
        series = list(args.rates)
        i = 0
        while i < len(series):
            if time.perf_counter() > deadline:
                print("budget spent: stopping", flush=True)
                break
            r = server.run(method, series[i], seed=i)
            res["runs"].append(r)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
            if r["slo_attainment"] < 0.8:  # saturated: higher rates only fail more; from the first, try half
                if i == 0:
                    series = [series[0], series[0] / 2]
                    i = 1
                    continue
                break
            i += 1
        Path(args.out).write_text(json.dumps(res, indent=1))
    requests.put(("stop",))
    side.join(timeout=10)
    if side.is_alive():
        side.terminate()
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("wrote", args.out, flush=True)


# -- report -------------------------------------------------------------------------------------


def report(args) -> None:
    res = json.loads(Path(args.json).read_text())
    c = res["config"]
    runs = res["runs"]
    out_md, out_png = Path(args.json).with_suffix(".md"), Path(args.json).with_suffix(".png")
    best: dict = {}
    for r in runs:
        key = (r["method"], r["link_gbps"])
        if key not in best or r["goodput_rps"] > best[key]["goodput_rps"]:
            best[key] = r
    rec = best.get(("recompute", 0))
    f = lambda x, p=3: "—" if x is None else f"{x:.{p}f}"  # noqa: E731
    L = [f"# Goodput on a busy GPU ({res['device']}, {res['date']})", "",
         f"`benchmarks/goodput/goodput_bench.py`: one GPU serves a {c['shape']} shape (random bf16 weights); {c['background']} requests decode "
         f"throughout; new requests arrive (Poisson) with a {c['prefix']}-token prefix shared by all (no local prefix cache) plus "
         f"{c['suffix']} unique tokens, and generate {c['output']} tokens. Recompute prefills prefix + suffix between decode steps; "
         "the fetch methods load the prefix in a sidecar process (kvfetcher: `pipeline.fetch` with decode worker processes; "
         "`raw-direct`: the KV's bytes straight to the GPU; CacheGen through LMCache's GPU decoder where it runs) over an emulated link (shared FIFO pipe + 2 ms latency; synthetic objects, timing only), then prefill the suffix. "
         f"Goodput = requests with TTFT <= {c['ttft_slo']} s and TPOT <= {c['tpot_slo']} s per second of a {c['duration']} s arrival window; "
         "each method's best over the arrival rates tried (a rate series stops once under 80% of the requests meet the SLOs).", "",
         f"Prefill of the whole prompt on the idle GPU: {res['prefill_s']:.3f} s; suffix after a fetch: {res['suffix_prefill_s']:.4f} s. "
         "Sidecar restore rates (downloads free): " + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in res["restore_Bps"].items()) +
         "; stored prefix: " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in res["stored_bytes"].items()) + ".", ""]
    if res.get("status"):
        L.append(f"**Status: {res['status']}**\n")
    if res.get("sidecar_errors"):
        L.append(f"Sidecar errors: {res['sidecar_errors']}\n")
    L += ["## Best goodput per method and link", "",
          "| method | link Gbit/s | rate rps | goodput rps | vs recompute | TTFT p50 s | TTFT p99 s | TPOT p50 s | TPOT p99 s | background TPOT p99 s | auto picks |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (m, g), r in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        gain = r["goodput_rps"] / rec["goodput_rps"] if rec and rec["goodput_rps"] > 0 else None
        L.append(f"| {m} | {g or '—'} | {r['rate']} | {r['goodput_rps']:.2f} | {f(gain, 2)}{'' if gain is None else 'x'} | {f(r['ttft_p50'])} | {f(r['ttft_p99'])} | "
                 f"{f(r['tpot_p50'], 4)} | {f(r['tpot_p99'], 4)} | {f(r['bg_tpot_p99'], 4)} | {r['picks'] if m.startswith('auto') else ''} |")
    L += ["", "## Every run", "", "| method | link | rate | arrived | finished | SLO met | goodput | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | fetch p50 s |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        L.append(f"| {r['method']} | {r['link_gbps'] or '—'} | {r['rate']} | {r['arrived']} | {r['finished']} | {100 * r['slo_attainment']:.0f}% | "
                 f"{r['goodput_rps']:.2f} | {f(r['ttft_p50'])} | {f(r['ttft_p99'])} | {f(r['tpot_p50'], 4)} | {f(r['tpot_p99'], 4)} | {f(r['fetch_s_p50'])} |")
    for note in res.get("notes", []):
        L += ["", note]
    out_md.write_text("\n".join(L) + "\n")
    plot(best, out_png, res)
    print(out_md.read_text())


def plot(best: dict, path: Path, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = sorted({g for (_, g) in best if g})
    methods = sorted({m for (m, g) in best if g})
    rec = best.get(("recompute", 0))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    w = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        xs = [j + i * w for j in range(len(links))]
        axes[0].bar(xs, [best.get((m, g), {}).get("goodput_rps", 0) for g in links], w, label=m)
        axes[1].bar(xs, [best.get((m, g), {}).get("ttft_p99") or 0 for g in links], w, label=m)
        axes[2].bar(xs, [best.get((m, g), {}).get("bg_tpot_p99") or 0 for g in links], w, label=m)
    if rec:
        axes[0].axhline(rec["goodput_rps"], color="k", ls="--", label="recompute")
        axes[1].axhline(rec["ttft_p99"] or 0, color="k", ls="--", label="recompute")
        axes[2].axhline(rec["bg_tpot_p99"] or 0, color="k", ls="--", label="recompute")
    for ax, t in zip(axes, ["goodput (rps meeting SLOs)", "TTFT p99 s at that rate", "running requests' TPOT p99 s at that rate"]):
        ax.set_xticks([j + w * (len(methods) - 1) / 2 for j in range(len(links))], [f"{g} Gbit/s" for g in links])
        ax.set_title(t)
        ax.legend(fontsize=8)
    fig.suptitle(f"{res['config']['shape']}, {res['config']['prefix']}-token shared prefix, {res['device']}, {res['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True)
    m.add_argument("--shape", default="llama3-8b")
    m.add_argument("--prefix", type=int, default=16384)
    m.add_argument("--suffix", type=int, default=64)
    m.add_argument("--output", type=int, default=32)
    m.add_argument("--background", type=int, default=8)
    m.add_argument("--slots", type=int, default=32)
    m.add_argument("--reserve-gb", type=float, default=14.0)
    m.add_argument("--duration", type=float, default=10.0)
    m.add_argument("--drain", type=float, default=8.0)
    m.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 2.0, 3.0])
    m.add_argument("--links", type=lambda s: [float(x) for x in s.split(",")], default=[10.0, 40.0, 100.0])
    m.add_argument("--methods", type=lambda s: s.split(","), default=["raw-direct", "auto"])
    m.add_argument("--stored", default="raw,q8,raw-direct")
    m.add_argument("--ttft-slo", type=float, default=2.0)
    m.add_argument("--tpot-slo", type=float, default=0.1)
    m.add_argument("--auto-budget", type=float, default=None,
                   help="auto's TTFT budget (choice.choose's budget_s: a fetch within it beats a faster recompute); "
                        "default 0.75 x the TTFT SLO, 0 for none (the fastest option wins)")
    m.add_argument("--decode-workers", type=int, default=4, help="decode threads (used without CUDA)")
    m.add_argument("--procs", type=int, default=8, help="decode worker processes of the sidecar (CUDA)")
    m.add_argument("--window", type=int, default=8)
    m.add_argument("--budget-s", type=float, default=330.0, help="stop starting runs after this long")
    m.add_argument("--cpu", action="store_true")
    r = sub.add_parser("report")
    r.add_argument("json")
    args = ap.parse_args()
    measure(args) if args.cmd == "measure" else report(args)


if __name__ == "__main__":
    main()
