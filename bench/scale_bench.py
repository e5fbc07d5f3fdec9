"""scale_bench: recompute vs fetch for Llama-3-8B and -70B shapes, contexts 4K-128K, links 1-100 Gbit/s.

``measure`` (on the GPU) times, for real:
  * prefill of the 8B shape and of a contiguous subset of the 70B shape's layers (k and k/2
    layers, so the per-layer time and the fixed part — embedding, head — separate; 80 layers =
    fixed + 80 x per-layer). KV bytes are exact by layer count.
  * the end-to-end restore rate of each fetch path (``pipeline.fetch`` into a GPU KV buffer from
    memory: download free, decode + restore measured) for raw, q8, lean, and LMCache's CacheGen.
  * a few fetches over an emulated link (``linkstore``) to check the predicted fetch times.
``report`` (anywhere) turns that JSON into the per-link comparison: each option's time from
``costmodel.compare`` (= ``choice.choose``, what the sidecar decides) with the measured prefill
times, the real-KV compression ratios of ``presets_measured.json`` and the measured restore rates.

    python bench/scale_bench.py measure --out docs/benchmarks/scale_h200.json
    python bench/scale_bench.py report docs/benchmarks/scale_h200.json
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

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "sidecar"), str(ROOT / "tests"), str(ROOT / "bench")]

import fetchkit  # noqa: E402
import linkstore  # noqa: E402
from llama_shape import LlamaShape, subset  # noqa: E402

from kvfetcher import costmodel, ipc  # noqa: E402
from kvfetcher.decode_workers import DecodeWorkers  # noqa: E402
from kvfetcher.costmodel import LLAMA3_8B, LLAMA3_70B, SHAPES  # noqa: E402

CONTEXTS = [4096, 8192, 16384, 32768, 65536, 131072]
LINKS_GBPS = [1, 5, 10, 25, 40, 100]
CHUNK = 256


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_prefill(model: LlamaShape, tokens: int, repeats: int) -> float:
    kv = torch.empty((model.shape.layers, 2, model.shape.kv_heads, tokens, model.shape.head_dim), dtype=model.dtype, device=model.device)
    ids = torch.randint(0, model.shape.vocab, (tokens,), device=model.device)
    best = float("inf")
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        model.prefill(ids, kv)
        _sync()
        best = min(best, time.perf_counter() - t)
    del kv
    return best


def sweep_prefill(shape, layer_counts, contexts, device) -> dict:
    """{layers: {tokens: seconds}} for each layer count; stops a count at its first OOM."""
    res: dict = {}
    for k in layer_counts:
        model = LlamaShape(subset(shape, k), device)
        time_prefill(model, min(2048, contexts[0]), 2)  # kernels, allocator
        res[k] = {}
        for T in contexts:
            try:
                res[k][T] = time_prefill(model, T, 2 if T <= 32768 else 1)
            except torch.OutOfMemoryError:
                res[k][T] = None
                break
            print(f"prefill {shape.name} layers={k} tokens={T}: {res[k][T]:.3f} s", flush=True)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return res


def full_depth(shape, sweep: dict) -> dict:
    """Prefill of all ``shape.layers`` from two subset depths: fixed + layers x per-layer."""
    (k1, a), (k2, b) = sorted(sweep.items())[:2]
    out = {}
    for T in a:
        if a.get(T) is None or b.get(T) is None:
            continue
        per_layer = (b[T] - a[T]) / (k2 - k1)
        fixed = max(0.0, a[T] - k1 * per_layer)
        out[T] = fixed + shape.layers * per_layer
    return out


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
            refs = [fetchkit.pipeline.ChunkRef(f"{preset}/{i}.kvfc", len(store.objects[f"{preset}/{i}.kvfc"]), i * CHUNK, CHUNK) for i in range(chunks)]
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
    pts = [("raw-direct", 10), ("raw-direct", 40), ("raw-direct", 100), ("raw", 10), ("raw", 40), ("q8", 2), ("q8", 10), ("lean", 5),
           ("cachegen", 5), ("cachegen", 25)]
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


def representations(res: dict) -> dict[str, costmodel.Representation]:
    """Stored forms with real-KV ratios (presets_measured.json; CacheGen's from its own objects)
    and the restore rates measured on the device."""
    measured = json.loads((ROOT / "sidecar/kvfetcher/data/presets_measured.json").read_text())
    reps = {}
    for name, p in res["fetch"]["paths"].items():
        ratio = measured[name]["ratio_vs_fp16"] if name in measured else p["synthetic_ratio"]
        reps[name] = costmodel.Representation(ratio, p["kv_Bps"], "raw" if name.startswith("raw") else "hevc")
    return reps


#: kvfetcher's automatic choice: recompute or any stored preset whose greedy agreement is 1.000
AUTO_SET = ("raw", "q8")


def table(res: dict, reps: dict, auto_set: tuple[str, ...] = AUTO_SET) -> list[dict]:
    rows = []
    for shape_name, pts in res["prefill"].items():
        shape = SHAPES[shape_name]
        for T_s, rec_s in sorted(pts.items(), key=lambda kv: int(kv[0])):
            T = int(T_s)
            for gbps in LINKS_GBPS:
                v = costmodel.compare(shape, T, gbps * 1e9 / 8, rec_s, reps)
                kf = {k: s for k, s in v.seconds.items() if k in auto_set or k == costmodel.choice.RECOMPUTE}
                auto = min(kf, key=kf.get)  # = choice.choose with allowed=auto_set
                rows.append({
                    "shape": shape_name, "tokens": T, "gbps": gbps, "kv_GB": costmodel.kv_bytes(shape, T) / 1e9,
                    "recompute_s": rec_s, "seconds": v.seconds, "auto": auto, "auto_s": kf[auto],
                    "gain_vs_recompute": rec_s / kf[auto], "gain_vs_raw": v.seconds["raw"] / kf[auto],
                    "gain_vs_cachegen": (v.seconds["cachegen"] / kf[auto]) if "cachegen" in v.seconds else None,
                })
    return rows


def report(args) -> None:
    res = json.loads(Path(args.json).read_text())
    reps = representations(res)
    rows = table(res, reps)
    dev = res["device"]
    tag = Path(args.json).stem
    out_md, out_png = Path(args.json).with_suffix(".md"), Path(args.json).with_suffix(".png")
    pts = [(SHAPES[s], int(T), sec) for s, d in res["prefill"].items() for T, sec in d.items()]
    try:
        eff = costmodel.fit_efficiency(pts, args.peak_tflops)
    except ValueError:  # (e.g. a CPU smoke run's tiny shapes)
        eff = (1.0, 1.0)
    gpu = costmodel.Gpu(dev, args.peak_tflops, *eff)
    L = [f"# Recompute vs fetch at scale ({dev}, {res['date']})", "",
         f"`bench/scale_bench.py`, {res['device']}, torch {res['torch']}. Measured: prefill of a Llama-3-8B shape "
         "(random bf16 weights, SDPA) and of a Llama-3-70B shape's layer subset "
         f"({', '.join(res['prefill_70b_subset'])} layers, scaled to 80: fixed part + 80 x per-layer time, KV by layer count); "
         "the restore rate of each fetch path. Modelled: the fetch time at each link speed, "
         "`latency + max(stored bytes / link, KV bytes / restore rate)` (the sidecar's own cost model, `choice.choose`), "
         "with real-KV compression ratios from `presets_measured.json` (CacheGen: ratio of its objects on synthetic KV).", ""]
    L += ["## Measured prefill (recompute)", "", "| context | 8B s | 8B KV GB | 70B s (scaled) | 70B KV GB | model 8B s | model 70B s |", "|---|---|---|---|---|---|---|"]
    for T in sorted({int(t) for d in res["prefill"].values() for t in d}):
        a = res["prefill"]["llama3-8b"].get(str(T))
        b = res["prefill"]["llama3-70b"].get(str(T))
        fmt = lambda x: f"{x:.3f}" if x is not None else "—"  # noqa: E731
        L.append(f"| {T // 1024}K | {fmt(a)} | {costmodel.kv_bytes(LLAMA3_8B, T) / 1e9:.2f} | {fmt(b)} | "
                 f"{costmodel.kv_bytes(LLAMA3_70B, T) / 1e9:.2f} | {gpu.prefill_seconds(LLAMA3_8B, T):.3f} | {gpu.prefill_seconds(LLAMA3_70B, T):.3f} |")
    L += ["", f"Cost-model fit (peak {args.peak_tflops:.0f} bf16 TFLOP/s): matmul efficiency {eff[0]:.2f}, attention efficiency {eff[1]:.2f}.", ""]
    L += ["## Measured restore rate per path (downloads free, into a GPU KV buffer)", "",
          "| path | GB/s of KV | ratio used (real KV) | ratio of synthetic objects |", "|---|---|---|---|"]
    for name, p in res["fetch"]["paths"].items():
        L.append(f"| {name} | {p['kv_Bps'] / 1e9:.2f} | {reps[name].ratio:.2f} | {p['synthetic_ratio']:.2f} |")
    if res["fetch"].get("cachegen_error"):
        L.append(f"\nCacheGen did not run: `{res['fetch']['cachegen_error']}`")
    L += ["", "## Model vs measured fetches over an emulated link (8B chunks)", "", "| path | Gbit/s | measured s | predicted s | error |", "|---|---|---|---|---|"]
    for c in res.get("link_checks", []):
        L.append(f"| {c['preset']} | {c['gbps']} | {c['measured_s']:.3f} | {c['predicted_s']:.3f} | {100 * (c['predicted_s'] / c['measured_s'] - 1):+.0f}% |")
    L += ["", "## Who wins, per shape, context and link", "",
          "Time until the prefix's KV is in the buffers. `auto` = kvfetcher's automatic choice among recompute and the stored presets "
          f"that keep greedy agreement 1.000 ({', '.join(AUTO_SET)}); `lean` (2.78x, agreement 0.91) and CacheGen (lossy) are listed, not chosen.", "",
          "| shape | context | Gbit/s | recompute s | raw s | q8 s | lean s | cachegen s | auto picks | auto s | vs recompute | vs raw |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        opt = lambda k: "—" if r["seconds"].get(k) is None else f"{r['seconds'][k]:.3f}"  # noqa: E731
        L.append(f"| {r['shape']} | {r['tokens'] // 1024}K | {r['gbps']} | {r['recompute_s']:.3f} | {opt('raw')} | {opt('q8')} | "
                 f"{opt('lean')} | {opt('cachegen')} | {r['auto']} | {r['auto_s']:.3f} | {r['gain_vs_recompute']:.2f}x | {r['gain_vs_raw']:.2f}x |")
    L += ["", "## Where auto beats both recompute and raw", ""]
    for shape_name in res["prefill"]:
        for T in sorted({r["tokens"] for r in rows if r["shape"] == shape_name}):
            sel = [r for r in rows if r["shape"] == shape_name and r["tokens"] == T]
            beats = [r for r in sel if r["gain_vs_recompute"] > 1.0001 and r["gain_vs_raw"] > 1.0001]
            if beats:
                L.append(f"* {shape_name} {T // 1024}K: " + ", ".join(f"{r['gbps']} Gbit/s ({r['auto']}: {r['gain_vs_recompute']:.2f}x vs recompute, {r['gain_vs_raw']:.2f}x vs raw)" for r in beats))
            else:
                L.append(f"* {shape_name} {T // 1024}K: nowhere (" + ", ".join(f"{r['gbps']}: {r['auto']}" for r in sel) + ")")
    out_md.write_text("\n".join(L) + "\n")
    plot(rows, out_png, dev, res["date"])
    print(out_md.read_text())
    _ = tag


def plot(rows: list[dict], path: Path, dev: str, date: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), sharey=True)
    for ax, s in zip(axes if len(shapes) > 1 else [axes], shapes):
        for T in sorted({r["tokens"] for r in rows if r["shape"] == s}):
            sel = [r for r in rows if r["shape"] == s and r["tokens"] == T]
            ax.plot([r["gbps"] for r in sel], [r["recompute_s"] / r["auto_s"] for r in sel], marker="o", label=f"{T // 1024}K auto")
            ax.plot([r["gbps"] for r in sel], [r["recompute_s"] / r["seconds"]["raw"] for r in sel], ls=":", color=ax.lines[-1].get_color())
        ax.axhline(1, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link Gbit/s")
        ax.set_title(f"{s}: speed-up over recompute (solid auto, dotted raw)")
        ax.legend(fontsize=7)
    axes_0 = axes[0] if len(shapes) > 1 else axes
    axes_0.set_ylabel("recompute time / fetch time")
    fig.suptitle(f"{dev}, {date}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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
    args = ap.parse_args()
    measure(args) if args.cmd == "measure" else report(args)


if __name__ == "__main__":
    main()
