"""Which parts of the KV cache tolerate coarse quantisation? (research for rate control)

For each (layer, K|V) group, quantise only that group to ``bits`` (per channel over chunks of
256 tokens, as the layout does) and measure the relative increase of the continuation NLL
over the shipped prompts, the rest of the cache untouched. Cheap (one forward pass of the
continuation per group and prompt), so every group can be measured; the greedy-agreement
harness then checks the allocation built from it.

    python -m research.sensitivity --bits 4 --out /tmp/sensitivity.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

from kvfetcher.eval import accuracy, model
from kvfetcher.codec import layout


def quantise(kv: torch.Tensor, bits: int, chunk: int = 256) -> torch.Tensor:
    p = layout.LayoutParams(mode="quant", bits=bits)
    parts = []
    for s in range(0, kv.shape[3], chunk):
        piece = kv[:, :, :, s : s + chunk].contiguous()
        pk = layout.pack(piece, p)
        parts.append(layout.unpack(pk.frames, pk.side, piece.shape, piece.dtype, p))
    return torch.cat(parts, dim=3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bits", default="4")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", default=str(ROOT / "research" / "results" / "sensitivity.json"))
    args = ap.parse_args()
    lm = model.load()
    cases = []
    for n, o in accuracy.PROMPTS:
        ids, cont = accuracy.prompt_ids(lm, n, o, args.tokens)
        kv = model.prefill(lm, ids)[0].half()
        cases.append((ids, cont, kv, model.continuation_nll(lm, ids, kv, cont)))
    layers = cases[0][2].shape[0]
    res = {"date": datetime.date.today().isoformat(), "model": lm.fingerprint, "tokens": args.tokens, "groups": {}}
    t0 = time.time()
    for bits in [int(b) for b in args.bits.split(",")]:
        qs = [quantise(kv, bits) for _, _, kv, _ in cases]
        for layer in range(layers):
            for kvi, name in ((0, "k"), (1, "v")):
                incs = []
                for (ids, cont, kv, nll0), q in zip(cases, qs):
                    mixed = kv.clone()
                    mixed[layer, kvi] = q[layer, kvi]
                    incs.append((model.continuation_nll(lm, ids, mixed, cont) - nll0) / nll0)
                key = f"L{layer:02d}{name}"
                res["groups"].setdefault(key, {})[f"q{bits}"] = sum(incs) / len(incs)
                print(f"{key} q{bits}: {100 * sum(incs) / len(incs):+.3f}%  ({time.time() - t0:.0f}s)", flush=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
