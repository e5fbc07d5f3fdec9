"""Ratio against accuracy per codec family, on both real models at several prefix lengths.

Each family is run at several points on the same fp16 caches through the accuracy harness
(teacher-forced top-1, KL, NLL; kvfetcher.eval.accuracy):

* ``transform-zstd x f``: the transform family's layout with every step times ``f`` (zstd here on
  the CPU, with the encoder's literal parameters; nvCOMP's ANS on a GPU codes the same planes: its
  ratio there is measured by benchmarks/entropy);
* ``balanced``, ``compact`` (lossless HEVC, x265) and ``balanced x f``;
* ``kvtc@b``: the KVTC-style peer (kvtc.py) at ``b`` bits per value before DEFLATE;
* ``cachegen``: CacheGen's quantisation (its size estimated from its symbols' entropy, as in accuracy_bench).

Prompts: at 256 tokens one window per genre of the eval-only texts (the suite's windows); at longer
prefixes, where no single held-out text is long enough, the eval texts of all five genres joined,
starting from a different genre per prompt (the continuation is whatever follows the prefix there).
A point passes the gate when its median top-1 is >= 0.99 and its median NLL increase <= 0.5%
(retrieval is judged by accuracy_bench, not here). Each model x length's figures are written as
soon as they exist, to ``curves/<model>-<tokens>.json`` (a run on the same prompts keeps the points of
codecs it does not run); ``--render`` makes ``curves.md`` and ``curves.png`` from them.

    python -m benchmarks.accuracy.curves --model smollm2 --tokens 256 --prompts 5
    python -m benchmarks.accuracy.curves --render
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import re
import time
from pathlib import Path

import torch

from benchmarks.accuracy import accuracy_bench as ab
from benchmarks.accuracy.kvtc import KVTC
from kvfetcher.eval import accuracy, model
from kvfetcher.format import presets

OUT = Path(__file__).resolve().parent / "curves"
GATE = {"tf_top1": 0.99, "nll_increase_pct": 0.5}
DEFAULT = ("transform-zstdx1,transform-zstdx1.3,transform-zstdx1.7,transform-zstdx2.2,transform-zstdx3,transform-zstdx4,"
           "balanced,compact,kvtc@4,kvtc@5,kvtc@6,cachegen")
GENRES = ("legal", "prose", "code", "tables", "dialogue")
SCALED = re.compile(r"(transform-zstd|transform-ans|balanced|compact)x([0-9.]+)")


def long_cases(lm: model.LoadedModel, tokens: int, cont: int, n: int) -> list[accuracy.Case]:
    """``n`` prompts of ``tokens`` + ``cont`` from the eval texts of every genre joined, prompt ``i``
    starting with genre ``i``'s texts."""
    texts = {g: [name for name, info in accuracy.manifest().items() if info["role"] == "eval" and info["genre"] == g] for g in GENRES}
    cases = []
    for i in range(n):
        order = GENRES[i % 5:] + GENRES[: i % 5]
        ids = model.tokenize(lm, "\n\n".join(model.sample_text(t) for g in order for t in texts[g]))
        if len(ids) < tokens + cont:
            raise ValueError(f"the eval texts hold {len(ids)} tokens, {tokens}+{cont} asked")
        cases.append(accuracy.Case(f"joined-from-{order[0]}", order[0], ids[:tokens], ids[tokens : tokens + cont]))
    return cases


def codec_of(lm: model.LoadedModel, name: str, kvtc: list):
    if name.startswith("kvtc@"):
        if not kvtc:
            kvtc.append(KVTC(lm))
        return kvtc[0].codec(float(name[5:]))
    m = SCALED.fullmatch(name)
    if m:
        base, f = m.groups()
        p = presets.get(base, lm.fingerprint)
        p = dataclasses.replace(p, name=name, layout=dataclasses.replace(p.layout, sigma_steps=presets.scaled(p.layout.sigma_steps, float(f))))
        return accuracy.preset_codec(lm, p, ab.CHUNK)
    return ab.codec_of(lm, name)


def run(key: str, tokens: int, prompts: int, cont: int, names: list[str]) -> dict:
    t0 = time.time()
    lm = model.load(ab.FILES.get(key) or ab.MODELS[key]())
    cases = accuracy.suite_cases(lm, tokens, cont, 1)[:prompts] if tokens <= 256 else long_cases(lm, tokens, cont, prompts)
    kvtc: list = []
    codecs = {n: codec_of(lm, n, kvtc) for n in names}
    out = {"model": key, "fingerprint": lm.fingerprint, "tokens": tokens, "continuation": cont, "prompts": [c.label for c in cases],
           "date": datetime.date.today().isoformat(), "device": ab.device(), "codecs": {}}
    path = OUT / f"{key}-{tokens}.json"
    OUT.mkdir(exist_ok=True)
    before = json.loads(path.read_text()) if path.exists() else {}
    kept = {n: p for n, p in before.get("codecs", {}).items() if n not in names} if before.get("prompts") == out["prompts"] else {}

    def progress(reports):
        out["codecs"] = kept | {n: _point(r.summary()) for n, r in reports.items()}
        out["seconds"] = time.time() - t0
        path.write_text(json.dumps(out, indent=1) + "\n")

    accuracy.run(lm, codecs, cases, 0, (), log=lambda m: print(m, flush=True), progress=progress)
    return out


def _point(s: dict) -> dict:
    keep = ("ratio_vs_fp16", "tf_top1", "kl", "nll_increase_pct", "prompts", "encode_mb_s", "decode_mb_s")
    p = {k: s[k] for k in keep}
    p["per_prompt"] = [{k: r[k] for k in ("prompt", "ratio_vs_fp16", "tf_top1", "kl", "nll_increase_pct")} for r in s["per_prompt"]]
    p["gate"] = s["tf_top1"] >= GATE["tf_top1"] and s["nll_increase_pct"] <= GATE["nll_increase_pct"]
    return p


def pooled_top1(p: dict, continuation: int) -> tuple[float, float, float]:
    """Top-1 agreement pooled over every scored token of the point's prompts, with a Wilson 95%
    interval. A continuation's tokens are not independent, so the true interval is wider: a point
    whose interval holds the gate's 0.99 is a near tie, not a verdict."""
    n = continuation * len(p["per_prompt"])
    rate = sum(q["tf_top1"] for q in p["per_prompt"]) / len(p["per_prompt"])
    z = 1.96
    centre = (rate + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return rate, centre - half, centre + half


def verdict(p: dict, continuation: int) -> str:
    """``pass``/``fail`` by the gate, with ``(near tie)`` where the pooled top-1's interval holds 0.99."""
    _, lo, hi = pooled_top1(p, continuation)
    return ("pass" if p["gate"] else "fail") + (" (near tie)" if lo < GATE["tf_top1"] <= hi else "")


def family(name: str) -> str:
    m = SCALED.fullmatch(name)
    return m.group(1) if m else name.split("@")[0]


def render() -> str:
    files = sorted(OUT.glob("*.json"), key=lambda p: (p.stem.split("-")[0], int(p.stem.split("-")[1])))
    runs = [json.loads(p.read_text()) for p in files]
    head = ["| model | tokens | prompts | codec | ratio vs fp16 | tf top-1 median | top-1 pooled [95%] | NLL increase % median | KL median | gate |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    best = ["| model | tokens | family | best ratio at the gate (point, verdict) | finest point's ratio, top-1 |", "|---|---|---|---|---|"]
    for r in runs:
        cont = r["continuation"]
        pts = sorted(r["codecs"].items(), key=lambda kv: (family(kv[0]), kv[1]["ratio_vs_fp16"]))
        for n, p in pts:
            rate, lo, hi = pooled_top1(p, cont)
            head.append(f"| {r['model']} | {r['tokens']} | {p['prompts']} | {n} | {p['ratio_vs_fp16']:.2f}x | {p['tf_top1']:.4f} | "
                        f"{rate:.4f} [{lo:.4f}, {hi:.4f}] | {p['nll_increase_pct']:.3f} | {p['kl']:.5f} | {verdict(p, cont)} |")
        for fam in dict.fromkeys(family(n) for n, _ in pts):
            mine = [(n, p) for n, p in pts if family(n) == fam]
            ok = [(n, p) for n, p in mine if p["gate"]]
            top = max(ok, key=lambda np: np[1]["ratio_vs_fp16"]) if ok else None
            fine = min(mine, key=lambda np: np[1]["ratio_vs_fp16"])
            at_gate = f"{top[1]['ratio_vs_fp16']:.2f}x ({top[0]}, {verdict(top[1], cont)})" if top else "none passes"
            best.append(f"| {r['model']} | {r['tokens']} | {fam} | {at_gate} | {fine[1]['ratio_vs_fp16']:.2f}x, {fine[1]['tf_top1']:.4f} |")
    meta = {(r["model"], r["tokens"]): (r["date"], r["device"], r["continuation"], done_prompts(r)) for r in runs}
    lines = [f"- {m} at {t} tokens: {d}, {dev}; {c} continuation tokens scored; prompts {', '.join(ps)}" for (m, t), (d, dev, c, ps) in meta.items()]
    preface = ("Made by `python -m benchmarks.accuracy.curves --render` (see README.md). A point passes the gate when its median "
               "teacher-forced top-1 over the prompts is >= 0.99 and its median NLL increase <= 0.5% (retrieval: accuracy_bench). "
               "Coders: `transform-zstd` zstd on the CPU as the encoder codes it with no level set (mostly literals: "
               "`entropy.LITERAL_PARAMS`, 6-11% smaller than zstd -3, ../transform/zstd_params.md; nvCOMP ANS codes the same "
               "planes on a GPU and approaches their order-0 entropy per block, 2-6% under this zstd); `balanced`, `compact` lossless HEVC (x265); `kvtc` DEFLATE (zlib 6); `cachegen` "
               "its symbols' entropy (an estimate). `<family>x<f>`: every step times f. Top-1 pooled: over every scored "
               "token of the prompts, with a Wilson 95% interval (a continuation's tokens are not independent: the true "
               "interval is wider); `(near tie)`: that interval holds 0.99, so the top-1 half of the verdict is not decided by "
               "these prompts. [curves.png](curves.png)")
    return "\n".join([preface, "", "Ratio at the gate per family (the largest ratio of a point passing it):", "", *best, "", "Every point:", "", *head, "",
                      "Runs:", "", *lines]) + "\n"


COLOURS = {"transform-zstd": "C0", "balanced": "C1", "compact": "C2", "kvtc": "C3", "cachegen": "C4"}


def done_prompts(r: dict) -> list[str]:
    """The prompts every point of a run was measured on (a run stopped early has fewer than it chose)."""
    return min(([q["prompt"] for q in p["per_prompt"]] for p in r["codecs"].values()), key=len, default=[])


def plot(path: Path) -> None:
    """Ratio against median top-1, a panel per model x length (SmolLM2's 7,936 tokens is its 8K), a line per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(p.read_text()) for p in OUT.glob("*.json")]
    models = sorted({r["model"] for r in runs})
    column = lambda t: 0 if t <= 256 else 1 if t <= 4096 else 2  # noqa: E731
    fig, axes = plt.subplots(len(models), 3, figsize=(13, 3.6 * len(models)), squeeze=False)
    for r in runs:
        ax = axes[models.index(r["model"])][column(r["tokens"])]
        fams: dict[str, list] = {}
        for n, p in r["codecs"].items():
            fams.setdefault(family(n), []).append((p["ratio_vs_fp16"], p["tf_top1"]))
        for fam, pts in fams.items():
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o-" if len(pts) > 1 else "s", label=fam, ms=4, color=COLOURS.get(fam))
        ax.axhline(GATE["tf_top1"], color="k", ls=":", lw=0.8)
        ax.set(title=f"{r['model']}, {r['tokens']} tokens, {len(done_prompts(r))} prompt(s)", xlabel="ratio vs fp16",
               ylabel="tf top-1, median", ylim=(0.8, 1.002))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=list(ab.MODELS))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--cont", type=int, default=256)
    ap.add_argument("--codecs", default=DEFAULT)
    ap.add_argument("--render", action="store_true", help="write curves.md from the runs' files")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    if args.render:
        (OUT.parent / "curves.md").write_text(render())
        plot(OUT.parent / "curves.png")
        return
    run(args.model, args.tokens, args.prompts, args.cont, args.codecs.split(","))


if __name__ == "__main__":
    main()
