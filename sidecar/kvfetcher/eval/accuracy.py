"""accuracy: does a preset change what the model says? Measured on the real model.

For each prompt (a prefix and the text that really follows it): prefill, keep the KV in the
storage dtype (fp16: what a server holds, the reference), store it chunk by chunk through a
preset, restore it, and compare the model fed from the restored cache with the model fed from
the reference cache, over the true continuation (teacher forcing):

* ``tf_top1``: fraction of continuation positions whose top-1 token is unchanged;
* ``kl``: mean KL(reference || restored) of the next-token distributions, nats;
* ``nll_increase_pct``: increase of the continuation's mean negative log-likelihood, percent.

Secondary, when asked: greedy agreement over ``n_new`` tokens with the reference's near-ties
(steps whose top-2 margin is under ``metrics.NEAR_TIE_MARGIN``, where any change may flip the
token), and the retrieval task (``retrieval``): exact match of lookups whose answers exist only
in the prefix. Figures aggregate over prompts (median, bootstrap CI); a preset's gate (``GATES``)
judges the aggregate, never one prompt. ``exact`` agrees by construction.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from kvfetcher.chunk import decode_chunk, encode_chunk
from kvfetcher.eval import metrics, model, retrieval
from kvfetcher.format.presets import Preset, get

#: (text file, token offset) of the first harness's prompts, over calibration texts too; kept for
#: the benchmarks that compare against it. The suite uses ``suite_cases`` (eval-only texts).
PROMPTS: list[tuple[str, int]] = [
    ("license.txt", 0),
    ("license.txt", 1200),
    ("code.txt", 0),
    ("code.txt", 2000),
    ("numbers.txt", 0),
    ("numbers.txt", 3000),
    ("dialogue.txt", 0),
    ("prose.txt", 0),
]

#: What each preset promises, judged on the aggregate (medians over prompts): ``tf_top1`` at
#: least; ``kl`` (nats) and ``nll_increase_pct`` at most; with the retrieval task, exact match at
#: most ``retrieval_drop`` below the fp16 cache's (default 0: unchanged). Lossless presets must
#: reproduce the reference; ``balanced`` promises top-1 0.99, NLL +0.5% and retrieval unchanged.
GATES: dict[str, dict[str, float]] = {
    "raw": {"tf_top1": 1.0, "kl": 1e-6},
    "exact": {"tf_top1": 1.0, "kl": 1e-6},
    "q8": {"tf_top1": 0.99, "kl": 0.0005, "nll_increase_pct": 0.5},
    "lean": {"tf_top1": 0.95, "kl": 0.005, "retrieval_drop": 0.1},
    "balanced": {"tf_top1": 0.99, "nll_increase_pct": 0.5},
    "compact": {"tf_top1": 0.93, "kl": 0.02, "retrieval_drop": 0.1},
}


@dataclass
class RoundTrip:
    kv: torch.Tensor
    stored_bytes: int
    encode_s: float
    decode_s: float


#: A way to store and restore a prefix's fp16 KV ``[layers, 2, kv_heads, tokens, head_dim]``.
Codec = Callable[[torch.Tensor], RoundTrip]


def round_trip(
    kv: torch.Tensor, preset: Preset | str, fingerprint: str, chunk_tokens: int = 256, rope_theta: float | None = None
) -> RoundTrip:
    """Store ``kv`` (a prefix from position 0) chunk by chunk through ``preset`` and restore it on
    ``kv``'s device, timing both directions. A preset given by name is the model's (``fingerprint``'s calibration,
    RoPE bases and basis), as a serving sidecar resolves it."""
    p = get(preset, fingerprint) if isinstance(preset, str) else preset
    objs, enc, dec = [], 0.0, 0.0
    parts = []
    for start in range(0, kv.shape[3], chunk_tokens):
        piece = kv[:, :, :, start : start + chunk_tokens].contiguous()
        t = time.perf_counter()
        obj = encode_chunk(piece, p, fingerprint, start=start, rope_theta=rope_theta)
        enc += time.perf_counter() - t
        t = time.perf_counter()
        parts.append(decode_chunk(obj, fingerprint, device=kv.device))
        dec += time.perf_counter() - t
        objs.append(len(obj))
    return RoundTrip(torch.cat(parts, dim=3), sum(objs), enc, dec)


def preset_codec(lm: model.LoadedModel, preset: Preset | str, chunk_tokens: int = 256) -> Codec:
    """The codec of a kvfetcher preset for ``lm``'s KV."""
    theta = model.rope_theta(lm)
    return lambda kv: round_trip(kv, preset, lm.fingerprint, chunk_tokens, theta)


# --- prompts ---------------------------------------------------------------------------------


@dataclass
class Case:
    label: str
    genre: str
    ids: torch.Tensor  # the prefix
    cont: torch.Tensor  # the text that follows it


def manifest() -> dict[str, dict]:
    """The shipped texts' genres and roles (data/manifest.json): only role ``eval`` texts are
    prompts of the suite; ``calibration`` texts may have shaped a basis."""
    return json.loads((model.DATA_DIR / "manifest.json").read_text())["texts"]


def suite_cases(lm: model.LoadedModel, tokens: int = 256, cont: int = 256, per_genre: int = 5) -> list[Case]:
    """Up to ``per_genre`` non-overlapping windows (prefix + continuation) per genre, from the
    eval-only texts in manifest order."""
    cases: list[Case] = []
    taken: dict[str, int] = {}
    for name, info in manifest().items():
        if info["role"] != "eval":
            continue
        ids = model.tokenize(lm, model.sample_text(name))
        w = tokens + cont
        for off in range(0, len(ids) - w + 1, w):
            if taken.get(info["genre"], 0) >= per_genre:
                break
            taken[info["genre"]] = taken.get(info["genre"], 0) + 1
            cases.append(Case(f"{name}@{off}", info["genre"], ids[off : off + tokens], ids[off + tokens : off + w]))
    return cases


def prompt_ids(lm: model.LoadedModel, name: str, offset: int, tokens: int, cont: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    ids = model.tokenize(lm, model.sample_text(name))
    if offset + tokens + cont > len(ids):
        offset = max(0, len(ids) - tokens - cont)
    if offset + tokens + cont > len(ids):
        raise ValueError(f"{name} has {len(ids)} tokens, too few for {tokens}+{cont}")
    return ids[offset : offset + tokens], ids[offset + tokens : offset + tokens + cont]


def text_case(lm: model.LoadedModel, text: str, tokens: int, cont: int = 256) -> Case:
    """One prompt from the start of ``text``: ``tokens`` of prefix, up to ``cont`` following."""
    ids = model.tokenize(lm, text)
    if len(ids) < tokens + 2:
        raise ValueError(f"text has only {len(ids)} tokens, {tokens} asked plus a continuation")
    return Case("text", "text", ids[:tokens], ids[tokens : tokens + cont])


def retrieval_contexts(lm: model.LoadedModel, tokens: int, contexts: int = 2) -> list[tuple[torch.Tensor, list[retrieval.Probe]]]:
    """``contexts`` lookup prefixes of at most ``tokens`` tokens (as many records as fit), with
    their probes at every depth."""
    out = []
    for seed in range(contexts):
        n = min(len(retrieval.WORDS), max(2, tokens // 9))
        while True:
            text, probes = retrieval.build(n, seed=seed)
            ids = model.tokenize(lm, text)
            if len(ids) <= tokens or n == 2:
                break
            n = max(2, min(n - 1, n * tokens // len(ids)))
        out.append((ids, probes))
    return out


# --- the run ---------------------------------------------------------------------------------


@dataclass
class PromptResult:
    prompt: str
    genre: str
    tokens: int
    continuation: int
    fp16_bytes: int
    stored_bytes: int
    ratio_vs_fp16: float
    bit_exact: bool
    max_abs_error: float
    tf_top1: float
    kl: float
    kl_max: float
    nll_fp16: float
    nll_restored: float
    nll_increase_pct: float
    encode_s: float
    decode_s: float
    greedy_agreement: float | None = None
    first_divergence: int | None = None
    near_ties: int | None = None  # reference greedy steps with a top-2 margin under NEAR_TIE_MARGIN
    divergence_at_near_tie: bool | None = None


@dataclass
class ProbeResult:
    context: int
    depth: float
    answer: str
    fp16: str
    restored: str
    fp16_ok: bool
    restored_ok: bool


@dataclass
class Report:
    preset: str
    model: str
    n_new: int
    prompts: list[PromptResult] = field(default_factory=list)
    probes: list[ProbeResult] = field(default_factory=list)

    def summary(self) -> dict:
        """The figures, aggregated over prompts; top-level figures are medians over prompts."""
        ps = self.prompts
        fp16 = sum(r.fp16_bytes for r in ps)
        enc, dec = sum(r.encode_s for r in ps), sum(r.decode_s for r in ps)
        stats = {k: metrics.aggregate([getattr(r, k) for r in ps]) for k in ("tf_top1", "kl", "nll_increase_pct")}
        s = {
            "preset": self.preset,
            "model": self.model,
            "tokens": ps[0].tokens if len({r.tokens for r in ps}) == 1 else [r.tokens for r in ps],
            "continuation": min(r.continuation for r in ps),
            "prompts": len(ps),
            "ratio_vs_fp16": fp16 / sum(r.stored_bytes for r in ps),
            "bit_exact": all(r.bit_exact for r in ps),
            **{k: v["median"] for k, v in stats.items()},
            "stats": stats,
            "per_genre": self._per_genre(),
            "nll_increase": statistics.fmean(r.nll_increase_pct for r in ps) / 100,
            "encode_mb_s": fp16 / 1e6 / enc if enc else None,
            "decode_mb_s": fp16 / 1e6 / dec if dec else None,
        }
        if self.n_new:
            s["greedy_agreement"] = statistics.fmean(r.greedy_agreement for r in ps)
            s["greedy"] = self._greedy()
        if self.probes:
            s["retrieval"] = self._retrieval()
        s["gate"] = self.gate(s)
        s["per_prompt"] = [asdict(r) for r in ps]
        return s

    def _per_genre(self) -> dict:
        out = {}
        for g in dict.fromkeys(r.genre for r in self.prompts):
            rs = [r for r in self.prompts if r.genre == g]
            out[g] = {"prompts": len(rs)} | {k: statistics.median(getattr(r, k) for r in rs) for k in ("tf_top1", "kl", "nll_increase_pct")}
        return out

    def _greedy(self) -> dict:
        ps = self.prompts
        diverged = [r for r in ps if r.first_divergence < self.n_new]
        return {
            "tokens": self.n_new,
            "agreement": statistics.fmean(r.greedy_agreement for r in ps),
            "min_first_divergence": min(r.first_divergence for r in ps),
            "near_tie_margin": metrics.NEAR_TIE_MARGIN,
            "near_ties": sum(r.near_ties for r in ps),
            "steps": self.n_new * len(ps),
            "prompts_diverged": len(diverged),
            "diverged_at_near_tie": sum(bool(r.divergence_at_near_tie) for r in diverged),
        }

    def _retrieval(self) -> dict:
        by_depth = {}
        for d in dict.fromkeys(p.depth for p in self.probes):
            ps = [p for p in self.probes if p.depth == d]
            by_depth[str(d)] = {"fp16": sum(p.fp16_ok for p in ps) / len(ps), "restored": sum(p.restored_ok for p in ps) / len(ps)}
        n = len(self.probes)
        return {
            "probes": n,
            "fp16_exact": sum(p.fp16_ok for p in self.probes) / n,
            "restored_exact": sum(p.restored_ok for p in self.probes) / n,
            "answers_changed": sum(p.fp16 != p.restored for p in self.probes),
            "by_depth": by_depth,
        }

    def gate(self, s: dict) -> dict | None:
        """The preset's promise (``GATES``) against the aggregate figures: the criteria and those
        missed; None for a codec without one."""
        g = GATES.get(self.preset)
        if g is None:
            return None
        missed = [k for k in ("kl", "nll_increase_pct") if k in g and s[k] > g[k]]
        if s["tf_top1"] < g["tf_top1"]:
            missed.append("tf_top1")
        if "retrieval" in s and s["retrieval"]["restored_exact"] < s["retrieval"]["fp16_exact"] - g.get("retrieval_drop", 0.0):
            missed.append("retrieval")
        return {"criteria": dict(g), "missed": missed, "passed": not missed}


@dataclass
class _Reference:
    kv: torch.Tensor
    logits: torch.Tensor
    greedy: list[int]
    margins: list[float]


def _reference(lm: model.LoadedModel, case: Case, n_new: int, dtype: torch.dtype) -> _Reference:
    kv = model.prefill(lm, case.ids)[0].to(dtype)
    greedy, margins = model.greedy_steps(lm, case.ids, kv, n_new) if n_new else ([], [])
    return _Reference(kv, model.teacher_forced_logits(lm, case.ids, kv, case.cont), greedy, margins)


def _compare(lm: model.LoadedModel, case: Case, ref: _Reference, rt: RoundTrip, n_new: int) -> PromptResult:
    logits = model.teacher_forced_logits(lm, case.ids, rt.kv, case.cont)
    m = metrics.compare(ref.logits, logits, case.cont)
    fp16_bytes = ref.kv.numel() * ref.kv.element_size()
    r = PromptResult(
        prompt=case.label, genre=case.genre, tokens=len(case.ids), continuation=len(case.cont),
        fp16_bytes=fp16_bytes, stored_bytes=rt.stored_bytes, ratio_vs_fp16=fp16_bytes / rt.stored_bytes,
        bit_exact=bool(torch.equal(rt.kv.view(torch.uint8), ref.kv.view(torch.uint8))),
        max_abs_error=float((rt.kv.float() - ref.kv.float()).abs().max()),
        tf_top1=m.top1, kl=float(m.kl.mean()), kl_max=float(m.kl.max()),
        nll_fp16=m.nll_ref, nll_restored=m.nll_test, nll_increase_pct=m.nll_increase_pct,
        encode_s=rt.encode_s, decode_s=rt.decode_s,
    )
    if n_new:
        tokens = model.greedy(lm, case.ids, rt.kv, n_new)
        r.greedy_agreement, r.first_divergence = metrics.greedy_agreement(ref.greedy, tokens)
        r.near_ties = metrics.near_ties(ref.margins)
        if r.first_divergence < n_new:
            r.divergence_at_near_tie = ref.margins[r.first_divergence] < metrics.NEAR_TIE_MARGIN
    return r


def _answers(lm: model.LoadedModel, ctx: torch.Tensor, kv: torch.Tensor, probes: list[retrieval.Probe]) -> list[str]:
    out = []
    for p in probes:
        ids = torch.cat([ctx, model.tokenize(lm, p.question, special=False)])
        out.append(lm.tokenizer.decode(model.greedy(lm, ids, kv, 6), skip_special_tokens=True))
    return out


def run(lm: model.LoadedModel, codecs: dict[str, Codec], cases: list[Case], n_new: int = 0,
        contexts: list[tuple[torch.Tensor, list[retrieval.Probe]]] = (), dtype: torch.dtype = torch.float16,
        log: Callable[[str], None] | None = None,
        progress: Callable[[dict[str, Report]], None] | None = None) -> dict[str, Report]:
    """Every codec over every case (and retrieval context), the reference computed once per case;
    ``progress`` sees the reports so far after each case and context."""
    reports = {name: Report(name, lm.fingerprint, n_new) for name in codecs}
    for case in cases:
        ref = _reference(lm, case, n_new, dtype)
        for name, codec in codecs.items():
            reports[name].prompts.append(_compare(lm, case, ref, codec(ref.kv), n_new))
        if log:
            log(f"{case.label}: " + " ".join(f"{n} {r.prompts[-1].tf_top1:.3f}/{r.prompts[-1].kl:.4f}" for n, r in reports.items()))
        if progress:
            progress(reports)
    for i, (ctx, probes) in enumerate(contexts):
        kv = model.prefill(lm, ctx)[0].to(dtype)
        want = _answers(lm, ctx, kv, probes)
        for name, codec in codecs.items():
            got = _answers(lm, ctx, codec(kv).kv, probes)
            reports[name].probes += [ProbeResult(i, p.depth, p.answer, w, g, retrieval.exact_match(w, p.answer),
                                                 retrieval.exact_match(g, p.answer)) for p, w, g in zip(probes, want, got)]
        if progress:
            progress(reports)
    return reports


def evaluate(preset: Preset | str, tokens: int = 512, prompts: list[tuple[str, int]] | None = None,
             text: str | None = None, n_new: int = 32, chunk_tokens: int = 256,
             storage_dtype: torch.dtype = torch.float16, lm: model.LoadedModel | None = None, cont: int = 64,
             suite: bool = False, retrieval_tokens: int = 0) -> Report:
    """One preset over one ``text`` (from its start), the ``prompts`` windows, or the eval suite
    (``suite``: eval-only texts, ``tokens`` of prefix and ``cont`` of continuation each); with
    ``retrieval_tokens``, the retrieval task on prefixes of that length too."""
    lm = lm or model.load()
    p = get(preset, lm.fingerprint) if isinstance(preset, str) else preset
    if text is not None:
        cases = [text_case(lm, text, tokens, cont)]
    elif suite:
        cases = suite_cases(lm, tokens, cont)
    else:
        cases = [Case(f"{n}@{o}", n.split(".")[0], *prompt_ids(lm, n, o, tokens, cont)) for n, o in (prompts or PROMPTS)]
    contexts = retrieval_contexts(lm, retrieval_tokens) if retrieval_tokens else []
    return run(lm, {p.name: preset_codec(lm, p, chunk_tokens)}, cases, n_new, contexts, storage_dtype)[p.name]
