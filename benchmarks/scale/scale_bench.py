"""scale_bench: recompute vs fetch for Llama-3-8B and -70B shapes, contexts 4K-128K, links 1-100 Gbit/s.

``measure`` (on the GPU) times, for real:
  * prefill of the 8B shape and of a contiguous subset of the 70B shape's layers (k and k/2
    layers, so the per-layer time and the fixed part — embedding, head — separate; 80 layers =
    fixed + 80 x per-layer). KV bytes are exact by layer count.
  * the end-to-end restore rate of each fetch path (``executor.fetch`` into a GPU KV buffer from
    memory: download free, decode + restore measured) for raw, q8, lean, and LMCache's CacheGen.
  * a few fetches over an emulated link (``linkstore``) to check the predicted fetch times.
``report`` (anywhere) turns that JSON into the per-link comparison: each option's time from
``costmodel.compare`` (= ``choice.choose``, what the sidecar decides) with the measured prefill
times, the real-KV compression ratios of ``presets_measured.json`` and the measured restore rates.

    python -m benchmarks.scale.scale_bench measure --out benchmarks/scale/result_h200.json
    python -m benchmarks.scale.scale_bench report benchmarks/scale/result_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

from benchmarks.lib import fetchkit, linkstore
from benchmarks.lib.llama_shape import full_depth, sweep_prefill

from kvfetcher.eval import costmodel
from kvfetcher import ipc
from kvfetcher.fetch.workers import DecodeWorkers
from kvfetcher.eval.costmodel import LLAMA3_8B, LLAMA3_70B, SHAPES
from kvfetcher import kvbuffer

CONTEXTS = [4096, 8192, 16384, 32768, 65536, 131072]
LINKS_GBPS = [1, 5, 10, 25, 40, 100]
CHUNK = 256


def measure_fetch(shape, device: str, presets: list[str], chunks: int, decode_workers: int, window: int, cachegen: bool, procs: int,
                  threads: bool = True, direct: bool = True) -> dict:
    """Restore rate (KV bytes / s) of each path, downloads free (8B chunks): kvfetcher presets with
    decode worker processes (``procs``; main's NVDEC path) and, for comparison, with decode threads."""
    out: dict = {"chunks": chunks, "shape": shape.name, "decode_threads": decode_workers, "decode_procs": procs, "window": window, "paths": {}, "threads": {}}
    shared = ipc.allocate((shape.layers, 2, shape.kv_heads, chunks * CHUNK, shape.head_dim), torch.bfloat16, device)
    buf = shared.tensor
    kv_bytes = buf.numel() * 2
    store = linkstore.LinkStore()
    workers = DecodeWorkers(procs) if procs else None
    if workers:
        workers.start()
    out["_workers"], out["_shared"] = workers, shared
    with ThreadPoolExecutor(16) as io, ThreadPoolExecutor(decode_workers) as dec:
        for p in presets:
            t = time.perf_counter()
            objs = fetchkit.encode_objects(shape, p, CHUNK, distinct=4, workers=8)
            enc_s = time.perf_counter() - t
            refs = fetchkit.put_prefix(store, p, objs, chunks)
            stored = sum(len(objs[i % len(objs)]) for i in range(chunks))
            for label, w, h in (("paths", workers, shared.handle), ("threads", None, None)):
                if (label == "paths" and workers is None) or (label == "threads" and workers is not None and not threads):
                    continue
                fetchkit.run(fetchkit.fetch_kvfetcher(store, refs[:4], buf, 0, io, dec, window, w, h))  # decoders, processes
                runs = []
                for _ in range(2):
                    o = fetchkit.run(fetchkit.fetch_kvfetcher(store, refs, buf, 0, io, dec, window, w, h))
                    assert o.error is None, o
                    runs.append(o.seconds)
                row = {"kv_Bps": kv_bytes / min(runs), "seconds": runs, "synthetic_ratio": kv_bytes / stored, "encode_s_4_chunks": enc_s}
                out[label][p] = row
                if workers is None:
                    out["paths"][p] = row
                print(f"fetch {p} ({label}): {kv_bytes / min(runs) / 1e9:.2f} GB/s KV", flush=True)
        if direct:  # the raw baseline: bytes straight to the GPU, no container, no decode step
            objs = fetchkit.raw_objects(shape, CHUNK)
            refs = fetchkit.put_prefix(store, "raw-direct", objs, chunks)
            fetchkit.fetch_raw_direct(store, refs[:4], buf, 0, io, window)
            runs = [fetchkit.fetch_raw_direct(store, refs, buf, 0, io, window) for _ in range(2)]
            out["paths"]["raw-direct"] = {"kv_Bps": kv_bytes / min(runs), "seconds": runs, "synthetic_ratio": 1.0}
            print(f"fetch raw-direct: {kv_bytes / min(runs) / 1e9:.2f} GB/s KV", flush=True)
        if cachegen:
            try:
                codec = fetchkit.CacheGen(shape, device)
                objs = [codec.encode(fetchkit.synthetic_kv(shape.layers, shape.kv_heads, CHUNK, shape.head_dim, torch.bfloat16, s)) for s in range(4)]
                refs = fetchkit.put_prefix(store, "cachegen", objs, chunks)
                fetchkit.fetch_cachegen(store, refs[:4], buf, 0, codec, io, window)
                runs = [fetchkit.fetch_cachegen(store, refs, buf, 0, codec, io, window) for _ in range(2)]
                stored = sum(len(objs[i % len(objs)]) for i in range(chunks))
                out["paths"]["cachegen"] = {"kv_Bps": kv_bytes / min(runs), "seconds": runs, "synthetic_ratio": kv_bytes / stored}
                print(f"fetch cachegen: {kv_bytes / min(runs) / 1e9:.2f} GB/s KV", flush=True)
            except Exception as e:  # report, do not stop the other measurements
                out["cachegen_error"] = f"{type(e).__name__}: {e}"
                print("cachegen failed:", out["cachegen_error"], flush=True)
    out["kv_bytes"] = kv_bytes
    out["_store"] = store  # reused by the link checks, dropped before writing
    return out


def link_checks(shape, fetch: dict, device: str, points: list[tuple[str, float]], decode_workers: int, window: int) -> list[dict]:
    """Fetches over an emulated link: measured seconds vs ``max(bytes/link, kv/restore rate)``."""
    chunks = fetch["chunks"]
    src: linkstore.LinkStore = fetch["_store"]
    workers, shared = fetch["_workers"], fetch["_shared"]
    buf = shared.tensor
    res = []
    with ThreadPoolExecutor(16) as io, ThreadPoolExecutor(decode_workers) as dec:
        for preset, gbps in points:
            if preset not in fetch["paths"]:
                continue
            store = linkstore.LinkStore(linkstore.Link(gbps * 1e9 / 8, latency_s=0.002))
            store.objects = {k: v for k, v in src.objects.items() if k.startswith(preset + "/")}
            refs = [kvbuffer.ChunkRef(f"{preset}/{i}.kvfc", len(store.objects[f"{preset}/{i}.kvfc"]), i * CHUNK, CHUNK) for i in range(chunks)]
            stored = sum(r.size for r in refs)
            if preset == "cachegen":
                codec = fetchkit.CacheGen(shape, device)
                secs = fetchkit.fetch_cachegen(store, refs, buf, 0, codec, io, window)
            elif preset == "raw-direct":
                secs = fetchkit.fetch_raw_direct(store, refs, buf, 0, io, window)
            else:
                o = fetchkit.run(fetchkit.fetch_kvfetcher(store, refs, buf, 0, io, dec, window, workers, shared.handle if workers else None))
                secs = o.seconds
            predicted = 0.002 + max(stored / (gbps * 1e9 / 8), fetch["kv_bytes"] / fetch["paths"][preset]["kv_Bps"])
            res.append({"preset": preset, "gbps": gbps, "stored_bytes": stored, "measured_s": secs, "predicted_s": predicted})
            print(f"link {preset} {gbps} Gbit/s: {secs:.3f} s measured, {predicted:.3f} s predicted", flush=True)
    return res


def measure(args) -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    s8, s70 = (LLAMA3_8B, LLAMA3_70B) if not args.tiny else (SHAPES["tiny"], SHAPES["tiny"])
    res: dict = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "contexts": args.contexts,
    }
    t0 = time.perf_counter()
    if not args.skip_prefill:
        prefill_sweeps(args, res, s8, s70, dev)
        print(f"prefill sweeps {time.perf_counter() - t0:.0f} s", flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))  # what is measured so far survives a time limit
    f = measure_fetch(s8, dev, args.presets.split(","), args.fetch_chunks, args.decode_workers, args.window, not args.no_cachegen,
                      args.procs if dev == "cuda" else 0, threads=not args.no_threads)
    pts = [("raw-direct", 10), ("raw-direct", 40), ("raw-direct", 100), ("raw", 40), ("q8", 5), ("q8", 10), ("q8", 25), ("lean", 10),
           ("cachegen", 10)]
    res["link_checks"] = link_checks(s8, f, dev, pts, args.decode_workers, args.window)
    f.pop("_store")
    if f["_workers"]:
        f["_workers"].close()
    f.pop("_workers"), f.pop("_shared").close()
    res["fetch"] = f
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out} after {time.perf_counter() - t0:.0f} s", flush=True)


def prefill_sweeps(args, res: dict, s8, s70, dev: str) -> None:
    w8 = sweep_prefill(s8, [s8.layers], args.contexts, dev)
    res["prefill"] = {"llama3-8b": {str(T): s for T, s in w8[s8.layers].items() if s is not None}}
    w70 = sweep_prefill(s70, [args.layers_70b // 2, args.layers_70b], args.contexts, dev)
    res["prefill"]["llama3-70b"] = {str(T): s for T, s in full_depth(LLAMA3_70B, w70).items()}
    res["prefill_70b_subset"] = {str(k): {str(T): s for T, s in v.items()} for k, v in w70.items()}


# -- report ------------------------------------------------------------------------------------

#: kvfetcher's automatic choice: recompute or any stored preset whose greedy agreement is 1.000
AUTO_SET = ("raw", "q8")
#: GPUs for the cost-model table: dense bf16 peak TFLOP/s (vendor data sheets)
GPUS = {"H100/H200": 989.0, "A100": 312.0, "L4": 121.0}


def representations(res: dict, raw_link_Bps: float = 55e9) -> dict[str, costmodel.Representation]:
    """Stored forms with real-KV ratios (presets_measured.json; others: the ratio of their objects)
    and the restore rates measured on the device; plus ``raw-link``, the raw-fetch baseline at its
    best: the link is its only limit (copies at the pinned host-to-device rate, FACTS.md: 55 GB/s)."""
    measured = json.loads((ROOT / "sidecar/kvfetcher/data/presets_measured.json").read_text())
    reps = {"raw-link": costmodel.Representation(1.0, raw_link_Bps, "raw")}
    for name, p in res["fetch"]["paths"].items():
        ratio = measured[name]["ratio_vs_fp16"] if name in measured else p["synthetic_ratio"]
        reps[name] = costmodel.Representation(ratio, p["kv_Bps"], "raw" if name.startswith("raw") else "hevc")
    return reps


def verdict(shape, tokens: int, gbps: float, recompute_s: float, reps: dict) -> dict:
    """Every option's time; ``auto`` = ``choice.choose`` over recompute and AUTO_SET; the raw
    baseline is ``raw-link``, a raw fetch limited by the link alone."""
    v = costmodel.compare(shape, tokens, gbps * 1e9 / 8, recompute_s, reps)
    kf = {k: t for k, t in v.seconds.items() if k in AUTO_SET or k == costmodel.choice.RECOMPUTE}
    auto = min(kf, key=kf.get)
    raw = v.seconds["raw-link"]
    rec = v.seconds[costmodel.choice.RECOMPUTE]
    return {"shape": shape.name, "tokens": tokens, "gbps": gbps, "recompute_s": rec, "raw_s": raw, "seconds": v.seconds,
            "auto": auto, "auto_s": kf[auto], "vs_recompute": rec / kf[auto], "vs_raw": raw / kf[auto],
            "best_other": min(rec, raw)}


def table(res: dict, reps: dict) -> list[dict]:
    return [verdict(SHAPES[name], int(T), g, sec, reps)
            for name, pts in res["prefill"].items() for T, sec in sorted(pts.items(), key=lambda kv: int(kv[0])) for g in LINKS_GBPS]


def gpu_table(res: dict, reps: dict, peak: float) -> list[str]:
    """Fastest of recompute, the raw fetch and kvfetcher's auto, with its margin over the runner-up,
    for other GPUs: the measured H100/H200 prefill scaled by peak bf16 ratio (same efficiency), the
    restore rates as measured on the H200 (NVDEC engines differ per GPU: a lead only)."""
    L = ["| GPU (bf16 TFLOP/s) | shape | context | " + " | ".join(f"{g} Gbit/s" for g in LINKS_GBPS) + " |",
         "|---|---|---|" + "---|" * len(LINKS_GBPS)]
    for gpu, tf in GPUS.items():
        for name in ("llama3-8b", "llama3-70b"):
            for T in (4096, 32768, 131072):
                sec = res["prefill"].get(name, {}).get(str(T))
                if sec is None:
                    continue
                cells = []
                for g in LINKS_GBPS:
                    r = verdict(SHAPES[name], T, g, sec * peak / tf, reps)
                    opts = {"recompute": r["recompute_s"], "raw fetch": r["raw_s"]}
                    if r["auto"] != costmodel.choice.RECOMPUTE:
                        opts[r["auto"]] = r["auto_s"]
                    best, second = sorted(opts, key=opts.get)[:2]
                    cell = f"{best} {opts[second] / opts[best]:.1f}x"
                    cells.append(f"**{cell}**" if best not in ("recompute", "raw fetch") else cell)
                L.append(f"| {gpu} ({tf:.0f}) | {name} | {T // 1024}K | " + " | ".join(cells) + " |")
    return L


def wins(rows: list[dict], res: dict) -> list[str]:
    """Per shape and context: the links where auto beats both, by how much; what wins elsewhere."""
    L = []
    for name in res["prefill"]:
        for T in sorted({r["tokens"] for r in rows if r["shape"] == name}):
            sel = [r for r in rows if r["shape"] == name and r["tokens"] == T]
            beats = [r for r in sel if r["vs_recompute"] > 1.005 and r["vs_raw"] > 1.005]
            desc = ", ".join(f"{r['gbps']} Gbit/s ({r['auto']}: {r['vs_recompute']:.2f}x recompute, {r['vs_raw']:.2f}x raw)" for r in beats)
            rest = ", ".join(f"{r['gbps']}: {'raw fetch' if r['raw_s'] < min(r['auto_s'], r['recompute_s']) else r['auto']}"
                             for r in sel if r not in beats)
            L.append(f"* **{name} {T // 1024}K**: " + (desc if beats else "nowhere") + (f"; elsewhere {rest}" if rest else ""))
    return L


def report(args) -> None:
    res = json.loads(Path(args.json).read_text())
    reps = representations(res, args.raw_link_gbytes * 1e9)
    rows = table(res, reps)
    dev = res["device"]
    out_md, out_png = Path(args.json).with_suffix(".md"), Path(args.json).with_suffix(".png")
    pts = [(SHAPES[s], int(T), sec) for s, d in res["prefill"].items() for T, sec in d.items()]
    try:
        eff = costmodel.fit_efficiency(pts, args.peak_tflops)
    except ValueError:  # (e.g. a CPU smoke run's tiny shapes)
        eff = (1.0, 1.0)
    gpu = costmodel.Gpu(dev, args.peak_tflops, *eff)
    f = res["fetch"]
    L = [f"# Recompute vs fetch at scale ({dev}, {res['date']})", "",
         f"`benchmarks/scale/scale_bench.py` on an {dev} (torch {res['torch']}), {res['date']}.", "",
         "* **Measured**: prefill of a Llama-3-8B shape (random bf16 weights, SDPA; best of 2 passes up to 32K, one above) and of a "
         f"Llama-3-70B shape through a contiguous subset of {' and '.join(res['prefill_70b_subset'])} of its 80 layers (all 80 are 140 GB in bf16): "
         "70B prefill = fixed part + 80 x the per-layer time from those two depths (embedding and head counted once), "
         "KV bytes exactly by layer count. The restore rate of each fetch path: "
         f"{f['chunks']} chunks of 256 tokens of the 8B shape ({f['kv_bytes'] / 1e9:.2f} GB of KV) into a GPU KV buffer, downloads free "
         "(q8 and the raw baseline again over 96 chunks, 3.2 GB, in a second fetch-only run whose figures are used); "
         f"kvfetcher's presets through `executor.fetch` with main's decode worker processes ({f['decode_procs']}; NVDEC), "
         "the raw baseline as ranged GETs copied straight to the GPU. A few fetches over an emulated link check the fetch model.",
         "* **Modelled**: the fetch time at each link speed, `latency + max(stored bytes / link, KV bytes / restore rate)` — "
         "the sidecar's own cost model (`choice.choose`, via `costmodel.compare`) — with real-KV compression ratios from "
         "`presets_measured.json` (q8 1.76x, lean 2.78x; the synthetic timing objects compress differently) and the measured rates.",
         "* `auto` = kvfetcher's automatic choice among recompute and the stored presets that keep greedy agreement 1.000 "
         f"({', '.join(AUTO_SET)}); `lean` (2.78x, agreement 0.91) is listed, not chosen. "
         "`raw fetch` = the baseline at its best: the KV's bytes over the link, copied at the pinned host-to-device rate "
         f"({args.raw_link_gbytes:.0f} GB/s, FACTS.md), so the link is its only limit. (This benchmark's own plain raw fetch, `raw-direct` below — "
         "ranged GETs into Python buffers, pageable copies — reached less; kvfetcher's `raw` preset path less still.)", ""]
    if f.get("cachegen_error"):
        L += [f"LMCache's CacheGen (the peer codec) could not run on the device: `{f['cachegen_error']}` (a dependency of its import "
              "chain the device lacks). LMCache also logged its compiled CUDA ops as not found, so it would have run its baseline ops "
              "(numba, on the CPU), which would not stand for CacheGen's GPU decoder. So no CacheGen figures here.", ""]
    L += ["## Prefill (recompute), measured, and the cost model's fit", "",
          "| context | 8B s | 8B KV GB | 70B s (scaled) | 70B KV GB | model 8B s | model 70B s |", "|---|---|---|---|---|---|---|"]
    for T in sorted({int(t) for d in res["prefill"].values() for t in d}):
        a, b = res["prefill"]["llama3-8b"].get(str(T)), res["prefill"]["llama3-70b"].get(str(T))
        fmt = lambda x: f"{x:.3f}" if x is not None else "—"  # noqa: E731
        L.append(f"| {T // 1024}K | {fmt(a)} | {costmodel.kv_bytes(LLAMA3_8B, T) / 1e9:.2f} | {fmt(b)} | "
                 f"{costmodel.kv_bytes(LLAMA3_70B, T) / 1e9:.2f} | {gpu.prefill_seconds(LLAMA3_8B, T):.3f} | {gpu.prefill_seconds(LLAMA3_70B, T):.3f} |")
    p8 = sorted(res["prefill"]["llama3-8b"].items(), key=lambda kv: int(kv[0]))
    (t_lo, s_lo), (t_hi, s_hi) = p8[0], p8[-1]
    L += ["", f"Fit over these {len(pts)} points (peak {args.peak_tflops:.0f} dense bf16 TFLOP/s): matmuls at {eff[0]:.0%} of peak, "
          f"attention at {eff[1]:.0%}. Prefill grows faster than KV: 8B from {int(t_lo) // 1024}K to {int(t_hi) // 1024}K tokens is "
          f"{int(t_hi) // int(t_lo)}x the KV and {s_hi / s_lo:.0f}x the time.", ""]
    L += ["## Restore rate per path (downloads free)", "", "| path | GB/s of KV | ratio used | runs (s) |", "|---|---|---|---|"]
    for name, p in f["paths"].items():
        L.append(f"| {name}{' (worker processes)' if name in f.get('threads', {}) else ''} | {p['kv_Bps'] / 1e9:.2f} | {reps[name].ratio:.2f} | "
                 + ", ".join(f"{x:.3f}" for x in p["seconds"]) + " |")
    for name, p in f.get("threads", {}).items():
        L.append(f"| {name} (decode threads, for comparison) | {p['kv_Bps'] / 1e9:.2f} | | " + ", ".join(f"{x:.3f}" for x in p["seconds"]) + " |")
    L += ["", "## The fetch model against measured fetches over the emulated link (8B, "
          f"{f['kv_bytes'] / 1e9:.2f} GB of KV)", "", "| path | Gbit/s | stored GB | measured s | predicted s | error |", "|---|---|---|---|---|---|"]
    for c in res.get("link_checks", []):
        L.append(f"| {c['preset']} | {c['gbps']} | {c['stored_bytes'] / 1e9:.2f} | {c['measured_s']:.3f} | {c['predicted_s']:.3f} | "
                 f"{100 * (c['predicted_s'] / c['measured_s'] - 1):+.0f}% |")
    L += ["", "## Where kvfetcher's automatic choice beats both recompute and the raw fetch", ""] + wins(rows, res)
    if args.alt_rates:
        alt = dict(reps)
        for item in args.alt_rates.split(","):
            k, v = item.split("=")
            alt[k] = costmodel.Representation(alt[k].ratio, float(v) * 1e9, alt[k].fmt)
        L += ["", f"### The same with {args.alt_label}", "",
              "Restore rates " + ", ".join(f"{k} {alt[k].decode_Bps / 1e9:.2f} GB/s" for k in sorted(alt) if k != "raw-link") + ":", ""]
        L += wins(table(res, alt), res)
    L += ["", "## Every point (seconds until the prefix's KV is in the buffers)", "",
          "| shape | context | Gbit/s | recompute | raw fetch | kvf raw | q8 | lean | auto picks | auto | vs recompute | vs raw fetch |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o = lambda k: "—" if r["seconds"].get(k) is None else f"{r['seconds'][k]:.3f}"  # noqa: E731
        L.append(f"| {r['shape']} | {r['tokens'] // 1024}K | {r['gbps']} | {r['recompute_s']:.3f} | {r['raw_s']:.3f} | {o('raw')} | {o('q8')} | "
                 f"{o('lean')} | {r['auto']} | {r['auto_s']:.3f} | {r['vs_recompute']:.2f}x | {r['vs_raw']:.2f}x |")
    L += ["", "## Cost model for other GPUs", "",
          "The fastest of recompute, the raw fetch and kvfetcher's choice (bold where that is a kvfetcher preset) and its margin "
          "over the runner-up; prefill scaled from the measured H200 points by dense bf16 peak (same efficiency), restore rates "
          "as measured on the H200 (other GPUs have other NVDEC counts: a lead, not a measurement).", ""] + gpu_table(res, reps, args.peak_tflops)
    L += ["", "Measured with `scale_bench.py measure` (and a fetch-only run folded in with `merge`); this page by `scale_bench.py report "
          + " ".join(sys.argv[2:]).replace("|", "/") + "`."]
    out_md.write_text("\n".join(L) + "\n")
    plot(rows, out_png, dev, res["date"])
    print(out_md.read_text())


def plot(rows: list[dict], path: Path, dev: str, date: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in rows}, key=lambda s: SHAPES[s].layers)
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 4.8), sharey=True, squeeze=False)
    for ax, s in zip(axes[0], shapes):
        for T in sorted({r["tokens"] for r in rows if r["shape"] == s}):
            sel = [r for r in rows if r["shape"] == s and r["tokens"] == T]
            (line,) = ax.plot([r["gbps"] for r in sel], [r["vs_recompute"] for r in sel], marker="o", label=f"{T // 1024}K auto")
            ax.plot([r["gbps"] for r in sel], [r["recompute_s"] / r["raw_s"] for r in sel], ls=":", color=line.get_color())
        ax.axhline(1, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link Gbit/s")
        ax.set_title(f"{s}: speed-up over recompute (solid: auto, dotted: raw fetch)", fontsize=9)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("recompute time / time to KV in buffers")
    fig.suptitle(f"{dev}, {date}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def merge(args) -> None:
    """Fold a fetch-only run (``--skip-prefill``) into a full run: its paths and link checks win."""
    a, b = json.loads(Path(args.base).read_text()), json.loads(Path(args.extra).read_text())
    a["fetch"]["paths"].update(b["fetch"]["paths"])
    keys = {(c["preset"], c["gbps"]) for c in b["link_checks"]}
    a["link_checks"] = [c for c in a["link_checks"] if (c["preset"], c["gbps"]) not in keys] + b["link_checks"]
    a.setdefault("runs", []).append({"fetch_only": b["date"], "paths": sorted(b["fetch"]["paths"])})
    Path(args.out).write_text(json.dumps(a, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True)
    m.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=CONTEXTS)
    m.add_argument("--layers-70b", type=int, default=8)
    m.add_argument("--presets", default="raw,q8,lean")
    m.add_argument("--fetch-chunks", type=int, default=32)
    m.add_argument("--decode-workers", type=int, default=4, help="decode threads (the thread path, for comparison)")
    m.add_argument("--procs", type=int, default=8, help="decode worker processes (main's NVDEC path)")
    m.add_argument("--window", type=int, default=8)
    m.add_argument("--no-cachegen", action="store_true")
    m.add_argument("--skip-prefill", action="store_true", help="fetch measurements only")
    m.add_argument("--no-threads", action="store_true", help="skip the decode-thread comparison")
    m.add_argument("--tiny", action="store_true", help="tiny shapes in place of 8B/70B (a CPU smoke run)")
    r = sub.add_parser("report")
    r.add_argument("json")
    r.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the measured GPU (H100/H200 SXM: 989)")
    r.add_argument("--alt-rates", default="", help="name=GB/s,...: a second 'where auto wins' with these restore rates")
    r.add_argument("--alt-label", default="other restore rates")
    r.add_argument("--raw-link-gbytes", type=float, default=55.0, help="restore rate of the ideal raw fetch, GB/s (pinned H2D copy)")
    g = sub.add_parser("merge")
    g.add_argument("base")
    g.add_argument("extra")
    g.add_argument("--out", required=True)
    args = ap.parse_args()
    {"measure": measure, "report": report, "merge": merge}[args.cmd](args)


if __name__ == "__main__":
    main()
