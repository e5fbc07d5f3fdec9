"""report: turn ttft_bench JSON (and its interference run) into the committed Markdown and plot.

    python -m benchmarks.ttft_8b.report RESULTS_DIR OUT_DIR [ttft=NOTES.md] [interference=NOTES.md]

writes ``result_<device>.json/.md/.png`` and ``interference_<device>.json/.md`` (device: h200, h100...).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

PEERS = ("q8zstd", "nvcomp", "cachegen")


def slug(device: str) -> str:
    m = re.search(r"(H100|H200|A100|L4|L40S|B200)", device)
    return (m.group(1) if m else re.sub(r"\W+", "_", device)).lower()


def failed(cell: dict) -> str | None:
    """The error that stopped a run, unless it was the time-box (a deadline)."""
    errs = [r.get("error") for r in cell.get("runs", []) if r.get("error") not in (None, "deadline")]
    return errs[0] if errs else None


def fmt(cell: dict, fails: set) -> str:
    if cell["ttft_s"] is not None:
        return f"{cell['ttft_s']:.3f}"
    if failed(cell):
        return f"error ({failed(cell)})"
    if cell.get("skipped") and any(m == cell["method"] and g >= cell["link_gbps"] and c <= cell["ctx"] for m, g, c in fails):
        return "error\u2020"
    return f"> {cell['box_s']:.1f}" + ("\u2020" if cell.get("skipped") else "")


def ttft_md(r: dict, notes: str = "") -> str:
    cells = r["cells"]
    methods = r["methods"]
    links = sorted({c["link_gbps"] for c in cells})
    probes = {p["set_Gbps"]: p["delivered_Gbps"] for p in r["probes"]}
    get = {(c["link_gbps"], c["ctx"], c["method"]): c for c in cells}
    fails = {(c["method"], c["link_gbps"], c["ctx"]) for c in cells if failed(c)}
    objs = r["setup"]["objects"]
    out = [
        f"# Time to first token: recompute vs fetch ({r['device']}, {r['date'][:10]})",
        "",
        "Produced by `benchmarks/ttft_8b/ttft_bench.py` (see its README); raw numbers in the JSON beside this file.",
        "",
        notes,
        "**What is real and what is emulated.**",
        f"* Model: {r['model']} — random weights, so timings only; prefill is the real computation of that shape.",
        f"* KV: {r['kv']}. {r['setup']['distinct_chunks']} distinct 256-token chunks were encoded per method and stored "
        "under the name of every chunk of the context: sizes and decode work per chunk are those of distinct chunks.",
        f"* Link: {r['link']}. The set rate is the token bucket's; what it delivered to the S3 client "
        "(8 parallel 8 MB ranged GETs, `link_probe`) is in the table below; where it falls short of the set rate, this "
        "machine's loopback and Python S3 client, not the bucket, set the rate, and those rows are really the delivered rate.",
        "* kvfetcher goes through the real sidecar (`Sidecar.fetch`: one LIST per chunk, the cost model, `pipeline.fetch` "
        f"over `S3Store`), NVDEC decoding in {r.get('decode_workers')} threads"
        + (f" and {r['decode_procs']} decode worker processes" if r.get("decode_procs") else " (no decode worker processes on main at run time)")
        + ". Peers fetch through the same store and link (one GET per part, parts decoded in threads as they arrive, 4 chunks in flight).",
        "* TTFT = until the first output token's logits exist: recompute = full prefill; fetch = fetch + one decode step "
        "over the restored KV; `auto` = the sidecar's choice (lookup + decision + the fetch or, if it picks recompute, the prefill). "
        "Before each link rate's cells one small fetch lets the sidecar's estimator measure the link (as a sidecar on a steady link would have).",
        "* Time-box: a cell is stopped at max(1.5 s, 2 x recompute) and shown as `> box`; `\u2020` = not run, because the same method "
        "was already past its box at a faster link and a context no longer (fetch time only grows with bytes and falls with rate). "
        "`error` = the fetch failed (reason in brackets), `error\u2020` = not run after that failure. "
        + (f"Cells under {r['cheap_s']:g} s are medians of 3 runs, others one run." if "cheap_s" in r
         else "Fast cells are medians of 3 runs, others one run (each cell's runs are in the JSON)."),
        "",
        "## Setup",
        "",
        "| method | stored bytes per 256-token chunk | ratio vs bf16 | notes |",
        "|---|---|---|---|",
    ]
    for k, v in objs.items():
        note = v.get("codec") or v.get("impl") or ""
        if v.get("rel_mean_abs_error") is not None:
            note += f" mean abs error {v['rel_mean_abs_error']:.4f} of mean |KV|"
        out.append(f"| {k} | {v['bytes_per_chunk'] / 1e6:.2f} MB | {v['ratio_vs_bf16']:.2f}x | {note.strip()} |")
    for k, v in r["setup"].get("blocked", {}).items():
        msg = " ".join(v.split())[:240].replace("|", "/")
        out.append(f"| {k} | — | — | **blocked**: {msg} |")
    out += ["", "| set link (Gbit/s) | delivered to the S3 client (Gbit/s) |", "|---|---|"]
    out += [f"| {g:g} | {probes.get(g, float('nan')):.1f} |" for g in sorted(probes)]
    out += ["", "| context | recompute (prefill) s | one decode step after a fetch s |", "|---|---|---|"]
    out += [f"| {int(c)} | {float(s):.3f} | {float(r['first_token_step_s'][str(c)] if str(c) in r['first_token_step_s'] else r['first_token_step_s'][c]):.4f} |"
            for c, s in r["recompute_s"].items()]
    checks = []
    for ctx in r["contexts"]:
        out += ["", f"## {ctx // 1024}K tokens: TTFT in seconds", "",
                "| link Gbit/s | " + " | ".join(methods) + " | fastest | auto chose |",
                "|---|" + "---|" * (len(methods) + 2)]
        for g in links:
            row = [get.get((g, ctx, m)) for m in methods]
            done = [(c["ttft_s"], c["method"]) for c in row if c and c["ttft_s"] is not None]
            best = min(done)[1] if done else "—"
            auto = get.get((g, ctx, "auto"))
            chose = ",".join(sorted(set(auto.get("chose", [])))) if auto else ""
            out.append(f"| {g:g} | " + " | ".join(fmt(c, fails) if c else "" for c in row) + f" | {best} | {chose} |")
            if auto and auto["ttft_s"] is not None:
                base = [get[(g, ctx, m)]["ttft_s"] for m in ("raw", "recompute") if get.get((g, ctx, m)) and get[(g, ctx, m)]["ttft_s"] is not None]
                peer = [get[(g, ctx, m)] for m in PEERS if get.get((g, ctx, m))]
                peer_t = [c["ttft_s"] for c in peer if c["ttft_s"] is not None]
                checks.append({"link": g, "ctx": ctx, "auto": auto["ttft_s"], "best_raw_recompute": min(base) if base else None,
                               "best_peer": min(peer_t) if peer_t else None})
    out += ["", "## Targets", "",
            "| link Gbit/s | context | auto s | best of raw, recompute s | auto / that | best peer s | auto ahead of every peer |",
            "|---|---|---|---|---|---|---|"]
    for c in checks:
        ratio = c["auto"] / c["best_raw_recompute"] if c["best_raw_recompute"] else float("nan")
        ahead = "yes" if c["best_peer"] is None or c["auto"] < c["best_peer"] else "no"
        bp = f"{c['best_peer']:.3f}" if c["best_peer"] is not None else "all > box"
        out.append(f"| {c['link']:g} | {c['ctx']} | {c['auto']:.3f} | {c['best_raw_recompute']:.3f} | {ratio:.2f} | {bp} | {ahead} |")
    return "\n".join(out) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctxs = r["contexts"]
    fig, axes = plt.subplots(1, len(ctxs), figsize=(5.2 * len(ctxs), 4.2), squeeze=False)
    color = {m: plt.get_cmap("tab10")(i) for i, m in enumerate(r["methods"])}  # one colour per method in every panel
    for ax, ctx in zip(axes[0], ctxs):
        for m in r["methods"]:
            pts = sorted((c["link_gbps"], c["ttft_s"]) for c in r["cells"] if c["ctx"] == ctx and c["method"] == m and c["ttft_s"] is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", lw=2.5 if m == "auto" else 1.2, label=m, color=color[m])
        box = max(c["box_s"] for c in r["cells"] if c["ctx"] == ctx)
        ax.axhline(box, color="grey", ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link (Gbit/s, set)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{ctx // 1024}K tokens (dotted: time-box)")
        ax.grid(True, which="both", alpha=0.3)
    handles = [plt.Line2D([], [], color=color[m], marker="o", label=m) for m in r["methods"]]
    axes[0][0].legend(handles=handles, fontsize=8)
    fig.suptitle(f"TTFT, Llama-3-8B shape, {r['device']}, {r['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def interference_md(r: dict, notes: str = "") -> str:
    out = [
        f"# Interference: decode TPOT while fetching ({r['device']}, {r['date'][:10]})",
        "",
        f"A separate process decodes a batch of {r['decode_batch']} requests of {r['decode_ctx']} cached tokens with the "
        "Llama-3-8B-shaped model (random bf16 weights), one CUDA-graph replay and one sync per step. The benchmark process "
        f"(as the sidecar, in its own process like the real one) meanwhile fetches a {r['fetch_ctx'] // 1024}K-token context "
        f"over and over for {r['phase_s']:g} s per method, through the link server set to {r['link_gbps']:g} Gbit/s "
        "(what it delivers is in the TTFT results); `recompute` runs that context's prefill over and over instead. "
        "Two processes share the GPU by time-slicing (no MPS), as a model server and a sidecar container would. "
        "Produced by `benchmarks/ttft_8b/ttft_bench.py --interference` (`benchmarks/ttft_8b/interference.py`).",
        "",
        notes,
        "| method | TPOT median ms | TPOT p90 ms | slowdown median | slowdown p90 | fetches in the phase | KV restored GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in r["phases"]:
        if not p.get("steps"):
            out.append(f"| {p['method']} | no steps | | | | {p['fetches']} | |")
            continue
        bad = p["method"] not in ("none", "none_after") and p["fetch_GBps"] == 0
        tag = " (no fetch completed: not a measurement)" if bad else ""
        out.append(f"| {p['method']}{tag} | {p['median_ms']:.2f} | {p['p90_ms']:.2f} | {p.get('slowdown_median_pct', 0):+.1f}% | "
                   f"{p.get('slowdown_p90_pct', 0):+.1f}% | {p['fetches']} | {p['fetch_GBps']:.2f} |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="ttft_bench's --out directory (ttft.json, interference.json)")
    ap.add_argument("dst", type=Path, help="where the report goes (this suite's directory for the canonical result)")
    ap.add_argument("notes", nargs="*", help="ttft=NOTES.md / interference=NOTES.md: prose put above the tables")
    a = ap.parse_args()
    src, dst = a.src, a.dst
    notes = {k: Path(v).read_text() for k, v in (n.split("=", 1) for n in a.notes)}
    r = json.loads((src / "ttft.json").read_text())
    s = slug(r["device"])
    shutil.copy(src / "ttft.json", dst / f"result_{s}.json")
    (dst / f"result_{s}.md").write_text(ttft_md(r, notes.get("ttft", "")))
    plot(r, dst / f"result_{s}.png")
    if (src / "interference.json").exists():
        i = json.loads((src / "interference.json").read_text())
        shutil.copy(src / "interference.json", dst / f"interference_{s}.json")
        (dst / f"interference_{s}.md").write_text(interference_md(i, notes.get("interference", "")))
    print(f"wrote {dst}/result_{s}.* and interference_{s}.*")
    return 0


if __name__ == "__main__":
    sys.exit(main())
