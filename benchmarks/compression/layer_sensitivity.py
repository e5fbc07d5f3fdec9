"""Per-layer sensitivity of the shipped model to key and value error (input to sigma_steps).

For each (layer, keys|values) alone, quantise with a step of ``--step`` channel standard
deviations (keys before RoPE, the first token of each 256-token chunk exact, every other
layer exact) and measure the KL divergence of the next-token distributions over the 64-token
continuation against the fp16 cache. KL is additive over small independent errors and grows
with the square of the step, so these 60 numbers set a step per layer: minimising
``sum w_l (s_l / s0)**2`` at a fixed ``sum log2 s_l`` (the rate) gives ``s_l ~ w_l**-0.5``.

    python -m benchmarks.compression.layer_sensitivity [--prompts 0,2,4,6] [--step 0.7] [--basis NAME]

With ``--basis`` the layer is quantised as the layout does with a basis (kvfetcher/basis.py):
components ``enc @ x`` per head, one step of ``--step`` times their pooled standard deviation.

Writes benchmarks/compression/layer_sensitivity.json (``--out`` for another file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from kvfetcher.eval import accuracy, model
from kvfetcher.codec import basis, rope


def quantise_one(kv: torch.Tensor, layer: int, kind: int, step: float, start: int, theta: float,
                 bas: basis.Basis | None = None) -> torch.Tensor:
    """``kv`` chunk with only (layer, kind) quantised at ``step`` sigma (keys in the pre-RoPE frame)."""
    out = kv.clone()
    x = kv[layer, kind].float()  # [H, T, D]
    cos, sin = rope.rotation(start, x.shape[1], x.shape[2], theta)
    if kind == 0:
        x = rope.apply(x, cos, sin, inverse=True)
    if bas is not None:
        x = torch.einsum("hde,hte->htd", bas.enc[layer, kind], x)
    body = x[:, 1:]
    mu, sd = body.mean(1, keepdim=True), body.std(1, keepdim=True, correction=0)
    if bas is not None:
        sd = sd.square().mean().sqrt().expand_as(sd)  # one step for all components (pooled)
    st = (sd * step).clamp_min(1e-8)
    y = x.clone()
    y[:, 1:] = torch.round((body - mu) / st) * st + mu
    if bas is not None:
        y = torch.einsum("hde,hte->htd", bas.dec[layer, kind], y)
    if kind == 0:
        y = rope.apply(y, cos, sin)
    out[layer, kind] = y.to(kv.dtype)
    out[layer, kind, :, 0] = kv[layer, kind, :, 0]
    return out


@torch.inference_mode()
def continuation_logp(lm: model.LoadedModel, ids: torch.Tensor, kv: torch.Tensor, cont: torch.Tensor) -> torch.Tensor:
    cache = model.to_cache(kv[:, :, :, : len(ids) - 1].float())
    feed = torch.cat([ids[-1:], cont[:-1]]).unsqueeze(0)
    return torch.log_softmax(lm.model(feed, past_key_values=cache, use_cache=True).logits[0].float(), -1)


def kl(ref: torch.Tensor, lp: torch.Tensor) -> float:
    """Mean over positions of KL(reference || restored) of next-token distributions."""
    return float((ref.exp() * (ref - lp)).sum(-1).mean())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="0,2,4,6", help="indices into accuracy.PROMPTS")
    ap.add_argument("--step", type=float, default=0.7)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "layer_sensitivity.json"))
    ap.add_argument("--basis", help="quantise in this shipped basis (kvfetcher/basis.py)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    bas = basis.load(args.basis) if args.basis else None
    lm = model.load()
    theta = model.rope_theta(lm)
    cases = []
    for i in map(int, args.prompts.split(",")):
        name, off = accuracy.PROMPTS[i]
        ids, cont = accuracy.prompt_ids(lm, name, off, 512)
        kv = model.prefill(lm, ids)[0].half()
        cases.append((ids, cont, kv, continuation_logp(lm, ids, kv, cont)))
    layers = lm.config.num_hidden_layers
    w = [[0.0, 0.0] for _ in range(layers)]
    t0 = time.perf_counter()
    for layer in range(layers):
        for kind in (0, 1):
            total = 0.0
            for ids, cont, kv, ref in cases:
                parts = [quantise_one(kv[:, :, :, s : s + 256], layer, kind, args.step, s, theta, bas) for s in range(0, kv.shape[3], 256)]
                total += kl(ref, continuation_logp(lm, ids, torch.cat(parts, 3), cont))
            w[layer][kind] = total / len(cases)
        print(f"layer {layer}: KL keys {w[layer][0]:.2e} values {w[layer][1]:.2e} ({time.perf_counter() - t0:.0f} s)", flush=True)
    out = {
        "date": datetime.date.today().isoformat(),
        "device": "CPU, 2 shared cores",
        "model": lm.fingerprint,
        "prompts": [f"{accuracy.PROMPTS[i][0]}@{accuracy.PROMPTS[i][1]}" for i in map(int, args.prompts.split(","))],
        "tokens": 512,
        "step_sigma": args.step,
        "basis": args.basis,
        "kl_keys_values_by_layer": w,
    }
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
