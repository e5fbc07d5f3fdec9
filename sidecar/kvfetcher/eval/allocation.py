"""allocation: a calibration's step tables from its measurements, by rate-distortion per (layer,
K|V) and by a budget tuned on calibration text overall.

A lossy preset's step for group ``g`` is ``scale / sqrt(w_g)`` over the table it reads
(presets.sigma_steps). With the group's KL ``k_g s_g**2`` (``k_g``: KL per unit step squared, its
error alone) and its rate falling by ``r_g`` bits per value per unit of ``ln s`` (the rate slope,
measured at the group's own step from the plug-in entropy of its symbols per component), the
least total rate at a given summed KL has ``s_g**2 ~ r_g / k_g`` (:func:`rd_steps`): groups whose
bits are cheap in KL get coarser. The overall level (the budget) is then tuned on calibration
windows, never on evaluation text (:func:`tune`): ``balanced`` the coarsest steps whose median
teacher-forced top-1 agreement and NLL increase over the windows keep a margin (``MARGIN`` of the allowed
loss) against its gate (accuracy.GATES), ``compact`` the finest steps that reach ``COMPACT_RATIO``
but no coarser than its own gate allows on those windows (where the gate binds, it stays short of the
size, and the record says so).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfetcher import chunk
from kvfetcher.codec import layout, tiling
from kvfetcher.eval import accuracy, metrics, model
from kvfetcher.format import calibration, presets

log = logging.getLogger("kvfetcher.calibrate")

CHUNK = 256
RATE_FACTOR = 1.15  # the rate slope: entropy at a group's step and at this factor coarser
MIN_SLOPE = 0.05  # bits per unit of ln step: a group whose rate no longer falls is not coarsened on
MARGIN = 0.5  # the budget keeps this share of the gate's allowed loss in hand
COMPACT_RATIO = 6.7  # compact's size: 6x vs fp16 with 12% in hand (text the budget never saw may compress worse)
TUNED = ("balanced", "compact")  # the presets whose steps a calibration tunes
BUDGET_TOKENS, BUDGET_PER_TEXT = 256, 3  # windows of the budget: prefix and continuation as the accuracy suite's


def restored(kv: torch.Tensor, lp: layout.LayoutParams) -> torch.Tensor:
    """``kv`` (a prefix from position 0) stored and restored through ``lp`` chunk by chunk, the
    first token of the first chunk exact (the video codec is lossless: not run)."""
    parts = []
    for s in range(0, kv.shape[3], CHUNK):
        p = dataclasses.replace(lp, exact_tokens=1 if s == 0 else 0)
        piece = kv[:, :, :, s : s + CHUNK].contiguous()
        pk = layout.pack(piece, p, s)
        parts.append(layout.unpack(pk.frames, pk.side, tuple(piece.shape), piece.dtype, p, start=s))
    return torch.cat(parts, 3)


def symbol_entropy(kvs: list[torch.Tensor], lp: layout.LayoutParams) -> torch.Tensor:
    """Bits per value of each (layer, K|V)'s symbols through ``lp``: the plug-in entropy of each
    component over a chunk's tokens (what an adaptive lossless coder approaches), mean over
    chunks and components: ``[layers, 2]``."""
    total, n = 0.0, 0
    for kv in kvs:
        for s in range(0, kv.shape[3], CHUNK):
            piece = kv[:, :, :, s : s + CHUNK].contiguous()
            L, _, H, T, D = piece.shape
            pk = layout.pack(piece, dataclasses.replace(lp, exact_tokens=1 if s == 0 else 0), s)
            sym = tiling.frames_to_tiles(pk.frames, pk.geometry, T, H * D).reshape(L, 2, T, H * D).long()
            p = torch.zeros(L, 2, 256, H * D, device=sym.device).scatter_add_(2, sym, torch.ones_like(sym, dtype=torch.float)) / T
            total, n = total + -(p * p.clamp_min(1e-12).log2()).sum(2).mean(2).cpu(), n + 1
    return total / n


def rate_slopes(kvs: list[torch.Tensor], lp: layout.LayoutParams) -> torch.Tensor:
    """Bits per value saved per unit of ``ln step`` by each (layer, K|V) at ``lp``'s steps: ``[layers, 2]``."""
    coarser = dataclasses.replace(lp, sigma_steps=presets.scaled(lp.sigma_steps, RATE_FACTOR))
    return (symbol_entropy(kvs, lp) - symbol_entropy(kvs, coarser)) / math.log(RATE_FACTOR)


def rd_steps(k: torch.Tensor, slopes: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Steps ``~ sqrt(slope / k)`` at the rate of ``steps`` (the same ``sum(slope * ln step)``):
    the least summed KL ``sum(k * step**2)`` at that rate."""
    r = slopes.double().clamp_min(MIN_SLOPE)
    new = 0.5 * (r / k.double().clamp_min(1e-12)).log()
    shift = (r * (steps.double().log() - new)).sum() / r.sum()
    return (new + shift).exp().float()


@dataclass
class BudgetCase:
    ids: torch.Tensor
    cont: torch.Tensor
    kv: torch.Tensor  # fp16, as a server stores it
    logits: torch.Tensor  # teacher-forced from the fp16 cache


def budget_cases(lm: model.LoadedModel, texts: list[Path], per_text: int = BUDGET_PER_TEXT) -> list[BudgetCase]:
    """Up to ``per_text`` disjoint windows of each calibration text, with their references."""
    out, w = [], 2 * BUDGET_TOKENS
    for path in texts:
        ids = model.tokenize(lm, Path(path).read_text())
        for s in list(range(0, len(ids) - w + 1, w))[:per_text]:
            pre, cont = ids[s : s + BUDGET_TOKENS], ids[s + BUDGET_TOKENS : s + w]
            kv = model.prefill(lm, pre)[0].half()
            out.append(BudgetCase(pre, cont, kv, model.teacher_forced_logits(lm, pre, kv, cont)))
    return out


def accuracy_at(lm: model.LoadedModel, cases: list[BudgetCase], lp: layout.LayoutParams) -> dict:
    """Teacher-forced top-1 agreement, NLL increase (%) and mean KL of ``lp``, medians over ``cases``
    (as the gate judges), and the agreement pooled over them."""
    agree, nll, kl = [], [], []
    for c in cases:
        logits = model.teacher_forced_logits(lm, c.ids, restored(c.kv, lp), c.cont)
        m = metrics.compare(c.logits, logits, c.cont)
        agree.append(m.top1)
        kl.append(float(m.kl.mean()))
        nll.append(m.nll_increase_pct)
    return {"tf_top1": statistics.median(agree), "nll_increase_pct": statistics.median(nll), "kl": statistics.median(kl),
            "tf_top1_pooled": statistics.fmean(agree)}


def ratio_at(cases: list[BudgetCase], preset: presets.Preset, fingerprint: str, thetas) -> float:
    """fp16 bytes over stored bytes (headers, side information and video) of ``preset`` over ``cases``."""
    fp16 = stored = 0
    for c in cases:
        fp16 += c.kv.numel() * 2
        stored += len(chunk.encode_chunk(c.kv, preset, fingerprint, start=0, rope_theta=thetas))
    return fp16 / stored


def bracket(ok: Callable[[float], bool], factor: float = 1.5, refine: int = 2, lo: float = 1 / 8, hi: float = 8) -> tuple[float, float]:
    """``(a, b)``, ``a < b``, with ``ok(a)`` and not ``ok(b)`` for ``ok`` true below a boundary in
    ``[lo, hi]``: steps of ``factor`` from 1, then ``refine`` geometric bisections. At a bound
    (everything ok, or nothing) that bound is returned twice."""
    m = 1.0
    if ok(m):
        while m * factor <= hi and ok(m * factor):
            m *= factor
        a, b = m, m * factor
        if b > hi:
            return a, a
    else:
        while m / factor >= lo and not ok(m / factor):
            m /= factor
        a, b = m / factor, m
        if a < lo:
            return b, b
    for _ in range(refine):
        mid = math.sqrt(a * b)
        a, b = (mid, b) if ok(mid) else (a, mid)
    return a, b


def tune(lm: model.LoadedModel, doc: dict, kvs: list[torch.Tensor], cases: list[BudgetCase],
         k: dict[str, torch.Tensor], names: tuple[str, ...] = TUNED) -> dict:
    """``doc`` (an artefact whose tables give the first steps) with ``balanced``'s and ``compact``'s
    tables (those of ``names``) re-allocated by rate-distortion and their budgets tuned; ``k``: per table, the KL per
    unit step squared ``[layers, 2]`` (a table without one keeps its allocation: only its budget
    is tuned). The measurements and the tuned figures go into the tables' records."""
    doc = dict(doc, sensitivity=dict(doc["sensitivity"]))
    tag = doc["model"]
    fp = f"{tag}/calibration"
    for name in names:
        kind = presets.LOSSY[name][0]
        p = presets.for_calibration(calibration.parse(doc, tag))[name]
        shape = torch.tensor(p.layout.sigma_steps)
        if kind in k:
            slopes = rate_slopes(kvs, p.layout)
            shape = rd_steps(k[kind], slopes, shape)

        def at(m: float, name=name, kind=kind, shape=shape) -> tuple[dict, presets.Preset]:
            d = dict(doc, sensitivity=dict(doc["sensitivity"], **{kind: {"layers": presets.table_for(name, (shape * m).tolist())}}))
            return d, presets.for_calibration(calibration.parse(d, tag))[name]

        thetas = doc["rope_thetas"]
        if name == "balanced":
            g = accuracy.GATES[name]
            want = {"tf_top1": 1 - (1 - g["tf_top1"]) * MARGIN, "nll_increase_pct": g["nll_increase_pct"] * MARGIN}
            figures: dict[float, dict] = {}

            def ok(m: float) -> bool:
                figures[m] = accuracy_at(lm, cases, at(m)[1].layout)
                log.info("%s x%.3f: %s", name, m, figures[m])
                return figures[m]["tf_top1"] >= want["tf_top1"] and figures[m]["nll_increase_pct"] <= want["nll_increase_pct"]
            m = bracket(ok)[0]
            tuned = {"target": want, "multiplier": round(m, 4), **figures.get(m, {})}
        else:
            ratios: dict[float, float] = {}

            def short(m: float) -> bool:  # true below the boundary: too fine to reach the size
                ratios[m] = ratio_at(cases, at(m)[1], fp, thetas)
                log.info("%s x%.3f: ratio %.3f", name, m, ratios[m])
                return ratios[m] < COMPACT_RATIO
            g = accuracy.GATES[name]
            figures = {}

            def within(m: float) -> bool:  # true below the boundary: its gate holds on the windows
                figures[m] = accuracy_at(lm, cases, at(m)[1].layout)
                log.info("%s x%.3f: %s", name, m, figures[m])
                return figures[m]["tf_top1"] >= g["tf_top1"] and figures[m]["kl"] <= g["kl"]
            m = bracket(short)[1]
            bound = not within(m)
            if bound:
                m = bracket(within, hi=m)[0]
            ratio = ratios[m] if m in ratios else ratio_at(cases, at(m)[1], fp, thetas)
            tuned = {"target": {"ratio_vs_fp16": COMPACT_RATIO, "tf_top1": g["tf_top1"], "kl": g["kl"]}, "multiplier": round(m, 4),
                     "ratio_vs_fp16": ratio, "gate_bound": bound, **figures.get(m, {})}
        table = at(m)[0]["sensitivity"][kind]
        measured = {"kl_per_step2": _rounded(k[kind]), "rate_slopes": _rounded(slopes)} if kind in k else {}
        doc["sensitivity"][kind] = dict(doc["sensitivity"][kind], layers=table["layers"],
                                        allocation=dict(measured, budget=tuned, budget_windows=len(cases)))
        log.info("%s: budget %s", name, tuned)
    return doc


def _rounded(t: torch.Tensor) -> list[list[float]]:
    return [[float(f"{x:.3g}") for x in kv] for kv in t.tolist()]
