"""calibrate: a model's own calibration (KV basis and per-layer step tables) from its own KV.

What ``kvfetcher calibrate`` runs. On windows of calibration text (``data/calibration/``, none of
them an evaluation text) it prefills the model and keeps every layer's KV of every token
(sliding-window layers included) and the pre-RoPE queries of each window's last 128 positions:

* the **basis** (codec/basis.py): per (layer, K|V, KV head) the metric the model sees errors in
  (keys: the group's pre-RoPE queries over relative rotations at the layer's own RoPE base;
  values: the output projection), the channels' covariance within 256-token chunks, their KLT
  and the calibration mean;
* the **sensitivity tables** (format/calibration.py), by splicing: every window is stored and
  restored through the layout at one step for all layers, and each (layer, K|V) alone is put back
  from the restored copy; the KL of the next-token distributions over a 64-token continuation
  against the fp16 cache, per unit step squared, is that group's sensitivity: at
  ``BASIS_STEP`` pooled standard deviations with uniform rounding for ``compact``'s table
  (``basis``), through ``balanced``'s own layout (basis, trellis, sparse corrections) at
  ``TRELLIS_STEP`` for ``balanced``'s (``trellis``). Their first cut (steps as sensitivity^-1/2,
  ``TRELLIS_UNITS``) is then re-allocated by each group's rate slope and its budget tuned on
  calibration windows (allocation.py); the tables hold the tuned steps (as ``sigma_steps``
  reads them) and record the measurements and the budget.

The artefact is stamped with the model's tag and geometry, its per-layer RoPE bases and windows.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfetcher.codec import basis, layout, rope
from kvfetcher.eval import allocation, model
from kvfetcher.format import calibration, presets

log = logging.getLogger("kvfetcher.calibrate")

TEXTS_DIR = Path(__file__).parent / "data" / "calibration"
WINDOW, CONT, QUERIES, CHUNK = 512, 64, 128, 256
#: relative offsets over which a key's metric averages its queries (a 512-token prefix)
DELTAS = list(range(0, WINDOW, 8))
BASIS_STEP = 0.7  # pooled standard deviations: the ``basis`` table's point
TRELLIS_STEP = 0.4  # grid steps of balanced's layout: the ``trellis`` table's point
#: units of the ``trellis`` table: balanced's scale 0.001 allots each (layer, K|V) a KL of about
#: 1e-6 times this; chosen so that SmolLM2-135M's calibration reproduces its shipped table (the
#: median ratio of the two; benchmarks/compression/calibrate_check.md)
TRELLIS_UNITS = 0.29


@dataclass
class Window:
    ids: torch.Tensor  # [WINDOW] prefix tokens
    cont: torch.Tensor  # [CONT] the text's continuation
    kv: torch.Tensor  # [L, 2, H, WINDOW, D] fp16, as a server stores it (keys post-RoPE)
    queries: torch.Tensor  # [L, QUERIES, q_heads, D] pre-RoPE queries of the last positions


def windows_of(lm: model.LoadedModel, texts: list[Path], per_text: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Up to ``per_text`` disjoint (prefix, continuation) windows from the start of each text."""
    out = []
    for path in texts:
        ids = model.tokenize(lm, Path(path).read_text())
        starts = range(0, len(ids) - WINDOW - CONT + 1, WINDOW + CONT)
        out += [(ids[s : s + WINDOW], ids[s + WINDOW : s + WINDOW + CONT]) for s in list(starts)[:per_text]]
    if not out:
        raise ValueError(f"no calibration text of {WINDOW + CONT} tokens among {[str(t) for t in texts]}")
    return out


def _query_module(attn: torch.nn.Module) -> tuple[torch.nn.Module, bool]:
    """The module whose output is the pre-RoPE query: a query norm if the model has one (Gemma 3,
    ``[b, heads, T, D]``), else the query projection (``[b, T, heads * D]``)."""
    return (attn.q_norm, True) if hasattr(attn, "q_norm") else (attn.q_proj, False)


@torch.inference_mode()
def capture(lm: model.LoadedModel, pairs) -> list[Window]:
    """Prefill each window with a cache that keeps every layer's every token; record its KV and queries."""
    d = model.head_dim(lm)
    qs: dict[int, torch.Tensor] = {}

    def hook(idx: int, heads_first: bool):
        def f(_m, _i, o):
            q = o[0].transpose(0, 1) if heads_first else o[0].reshape(o.shape[1], -1, d)
            qs[idx] = q[-QUERIES:].float().cpu()
        return f

    attns = [layer.self_attn for layer in lm.model.model.layers]
    hooks = [_query_module(a)[0].register_forward_hook(hook(i, _query_module(a)[1])) for i, a in enumerate(attns)]
    try:
        out = []
        for ids, cont in pairs:
            kv = model.prefill(lm, ids)[0].half().cpu()
            out.append(Window(ids, cont, kv, torch.stack([qs[i] for i in range(len(attns))])))
        return out
    finally:
        for h in hooks:
            h.remove()


def pre_rope(kv: torch.Tensor, thetas: tuple[float, ...]) -> torch.Tensor:
    """``kv`` in float32 with its keys un-rotated, each layer at its own base."""
    x = kv.float()
    x[:, 0] = rope.apply_layers(x[:, 0], 0, thetas, inverse=True)
    return x


def make_basis(lm: model.LoadedModel, wins: list[Window], thetas: tuple[float, ...], tag: str) -> basis.Basis:
    """The KLT per (layer, K|V, KV head) in the metric the model sees errors in, with its mean."""
    cfg = lm.config
    L, H, d = cfg.num_hidden_layers, cfg.num_key_value_heads, model.head_dim(lm)
    xs = [pre_rope(w.kv, thetas) for w in wins]
    enc = torch.zeros(L, 2, H, d, d, dtype=torch.float64)
    for layer in range(L):
        wo = lm.model.model.layers[layer].self_attn.o_proj.weight.cpu()
        metric = (basis.key_metric([w.queries[layer] for w in wins], H, thetas[layer], DELTAS),
                  basis.value_metric(wo, H, d))
        for kind in (0, 1):  # chunks without their first (exact) token, centred per chunk as the layout does
            cov = basis.covariance([x[layer, kind, :, s + 1 : s + CHUNK] for x in xs for s in range(0, WINDOW, CHUNK)])
            enc[layer, kind] = basis.transform(basis.normalise_heads(metric[kind]), cov)[0]
    e16 = enc.float().half().float()  # as stored
    mean = torch.cat([torch.einsum("lkhde,lkhte->lkhtd", e16, x) for x in xs], 3).mean(3)
    return basis.build(tag, enc.float(), mean)


@torch.inference_mode()
def _logp(lm: model.LoadedModel, w: Window, kv: torch.Tensor) -> torch.Tensor:
    dtype = next(lm.model.parameters()).dtype
    cache = model.to_cache(kv[:, :, :, : WINDOW - 1].to(lm.device, dtype))
    feed = torch.cat([w.ids[-1:], w.cont[:-1]]).unsqueeze(0).to(lm.device)
    return torch.log_softmax(lm.model(feed, past_key_values=cache, use_cache=True).logits[0].float(), -1).cpu()


def sensitivity(lm: model.LoadedModel, wins: list[Window], lp: layout.LayoutParams) -> list[list[float]]:
    """Per (layer, K|V): mean KL over ``wins`` with that group alone restored through ``lp``."""
    L = lm.config.num_hidden_layers
    w_kl = [[0.0, 0.0] for _ in range(L)]
    for i, w in enumerate(wins):
        log.info("sensitivity: window %d of %d", i + 1, len(wins))
        ref = _logp(lm, w, w.kv)
        back = allocation.restored(w.kv, lp)
        for layer in range(L):
            for kind in (0, 1):
                kv = w.kv.clone()
                kv[layer, kind] = back[layer, kind]
                lp_ = _logp(lm, w, kv)
                w_kl[layer][kind] += float((ref.exp() * (ref - lp_)).sum(-1).mean()) / len(wins)
    return w_kl


def calibrate(lm: model.LoadedModel, tag: str, texts: list[Path] | None = None, per_text: int = 2,
              sensitivity_windows: int = 4, measure_prompts: list[tuple[str, int]] | None = None,
              budget_per_text: int = allocation.BUDGET_PER_TEXT) -> tuple[dict, basis.Basis]:
    """The artefact's JSON and the basis for model ``lm`` under tag ``tag`` (``per_text`` windows of
    each text for the basis, ``budget_per_text`` for the budgets); with ``measure_prompts``, the
    figures of its presets on them (:func:`measure`)."""
    t0 = time.perf_counter()
    texts = sorted(texts or TEXTS_DIR.glob("*.txt"))
    cfg = lm.config
    L = cfg.num_hidden_layers
    thetas = model.rope_thetas(lm)
    if thetas is None:
        raise ValueError("the model's RoPE is not default RoPE: its keys cannot be stored before RoPE")
    wins = capture(lm, windows_of(lm, texts, per_text))
    b = make_basis(lm, wins, thetas, tag)
    basis.save(b, Path(calibration.CALIBRATION_DIR.read()))  # the layout finds it by name
    log.info("basis %s from %d windows (%.0f s)", b.name, len(wins), time.perf_counter() - t0)
    # spread over the texts: every (per_text)-th window is a different text's
    probe = wins[::per_text][:sensitivity_windows]
    bal = presets.PRESETS["balanced"].layout
    theta = rope.compact(thetas)
    base = layout.LayoutParams(mode="quant", sigma_steps=((BASIS_STEP, BASIS_STEP),), basis=b.name, rope_theta=theta)
    trel = dataclasses.replace(bal, sigma_steps=((TRELLIS_STEP, TRELLIS_STEP),), basis=b.name, rope_theta=theta)
    kl_basis = torch.tensor(sensitivity(lm, probe, base))
    kl_trellis = torch.tensor(sensitivity(lm, probe, trel))
    k = {"basis": kl_basis / BASIS_STEP**2, "trellis": kl_trellis / TRELLIS_STEP**2}  # KL per unit step squared
    first = {"basis": [[_round(x) for x in kv] for kv in kl_basis.tolist()],  # steps ~ k^-1/2: the first cut
             "trellis": [[_round(x * TRELLIS_UNITS) for x in kv] for kv in k["trellis"].tolist()]}
    tables = {
        "basis": {"about": f"compact's steps: KL per unit step squared with one layer's keys or values alone restored in the "
                           f"model's basis at one pooled step of {BASIS_STEP} standard deviations of its components, over its "
                           f"rate slope at compact's steps, the budget tuned on calibration text (allocation)",
                  "layers": first["basis"]},
        "trellis": {"about": f"balanced's steps: KL per unit step squared with one layer's keys or values alone restored through "
                             f"balanced's layout at {TRELLIS_STEP} grid steps, over its rate slope at balanced's steps, the budget "
                             f"tuned on calibration text (allocation)",
                    "layers": first["trellis"]},
    }
    doc = calibration.artefact(
        tag, tables, b.name, (L, cfg.num_key_value_heads, model.head_dim(lm)), thetas, model.windows(lm),
        made_by="kvfetcher calibrate", date=datetime.date.today().isoformat(),
        texts=[Path(t).name for t in texts], windows_used=len(wins), sensitivity_windows=len(probe))
    doc = allocation.tune(lm, doc, [w.kv for w in probe], allocation.budget_cases(lm, texts, budget_per_text), k)
    if measure_prompts:
        doc["measured"] = measure(lm, calibration.parse(doc, tag), measure_prompts)
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    return doc, b


def retune(lm: model.LoadedModel, path: Path, texts: list[Path] | None = None,
           names: tuple[str, ...] = allocation.TUNED) -> dict:
    """The artefact at ``path`` with the budgets of ``names`` tuned again on calibration windows (its basis kept;
    stamped with the model's geometry, RoPE bases and windows where it lacks them): for a
    calibration made before budgets were tuned, or against a changed gate. One that ``calibrate``
    made before steps were allocated by rate (its tables the first cut: the measured sensitivities)
    is re-allocated from them too; any other keeps its allocation."""
    cal = calibration.read(path)
    calibration.check(cal, lm.fingerprint)
    c = lm.config
    texts = sorted(texts or TEXTS_DIR.glob("*.txt"))
    doc = {k: v for k, v in json.loads(Path(path).read_text()).items() if k != "measured"} | {"model": cal.model}
    doc.setdefault("geometry", [c.num_hidden_layers, c.num_key_value_heads, model.head_dim(lm)])
    doc["rope_thetas"] = doc.get("rope_thetas") or list(model.rope_thetas(lm))
    doc["windows"] = doc.get("windows") or list(model.windows(lm))
    k, kvs = {}, []
    if doc.get("made_by") == "kvfetcher calibrate" and not any("allocation" in t for t in doc["sensitivity"].values()):
        k = {"basis": torch.tensor(cal.table("basis")) / BASIS_STEP**2, "trellis": torch.tensor(cal.table("trellis")) / TRELLIS_UNITS}
        kvs = [model.prefill(lm, ids)[0].half() for ids, _ in windows_of(lm, texts, 1)[:4]]
    doc = allocation.tune(lm, doc, kvs, allocation.budget_cases(lm, texts), k, names)
    return dict(doc, retuned=datetime.date.today().isoformat())


#: the presets whose figures a calibration records, and the evaluation prompts it measures them on
MEASURED = ("q8", "balanced", "compact")
MEASURE_PROMPTS = [("license.txt", 0), ("code.txt", 0), ("numbers.txt", 0), ("prose.txt", 0)]


def measure(lm: model.LoadedModel, cal: calibration.Calibration, prompts: list[tuple[str, int]]) -> dict:
    """Per preset of ``MEASURED`` as ``cal`` makes it: ratio vs fp16 (headers and side information
    counted), mean KL and teacher-forced top-1 agreement over a 64-token continuation against the
    fp16 cache, on evaluation prompts (``accuracy.PROMPTS`` entries: text the calibration never saw)."""
    from kvfetcher.eval import accuracy

    table = presets.for_calibration(cal)
    tag_fp = f"{cal.model}/calibration"
    cases = []
    for name, off in prompts:
        ids, cont = accuracy.prompt_ids(lm, name, off, WINDOW, CONT)
        w = Window(ids, cont, model.prefill(lm, ids)[0].half(), torch.empty(0))
        cases.append((w, _logp(lm, w, w.kv)))
    out = {}
    for preset in MEASURED:
        size = fp16 = kl = top1 = 0.0
        for w, ref in cases:
            rt = accuracy.round_trip(w.kv, table[preset], tag_fp, CHUNK, rope.compact(cal.rope_thetas or model.rope_thetas(lm)))
            lp = _logp(lm, w, rt.kv)
            size, fp16 = size + rt.stored_bytes, fp16 + w.kv.numel() * 2
            kl += float((ref.exp() * (ref - lp)).sum(-1).mean()) / len(cases)
            top1 += float((ref.argmax(-1) == lp.argmax(-1)).float().mean()) / len(cases)
        out[preset] = {"ratio_vs_fp16": round(fp16 / size, 3), "kl": float(f"{kl:.3g}"), "tf_top1": round(top1, 4),
                       "prompts": [f"{n}@{o}" for n, o in prompts], "tokens": WINDOW}
        log.info("%s: %s", preset, out[preset])
    return out


def _round(x: float) -> float:
    return float(f"{max(x, 1e-9):.2g}")
