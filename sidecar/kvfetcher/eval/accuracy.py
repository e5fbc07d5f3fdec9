"""accuracy: does a preset change what the model says? Measured on the real model.

For each shipped prompt: prefill, store the KV chunk by chunk through a preset, restore it,
and compare generation from the restored cache with generation from the original:

* ``greedy_agreement``: fraction of 32 greedy tokens identical position by position;
* ``first_divergence``: index of the first differing token (32 if none);
* ``nll_increase``: relative increase of the mean negative log-likelihood of the text that
  really follows the prefix.

The original cache is the model's KV in the storage dtype (fp16), i.e. what a server holds;
``exact`` therefore agrees by construction and every other preset is judged against it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from kvfetcher.eval import model
from kvfetcher.chunk import decode_chunk, encode_chunk
from kvfetcher.format.presets import Preset, get

#: (text file, token offset) of the shipped prompts: legal prose, code, numbers, dialogue, prose.
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


@dataclass
class RoundTrip:
    kv: torch.Tensor
    stored_bytes: int
    encode_s: float
    decode_s: float


def round_trip(
    kv: torch.Tensor, preset: Preset | str, fingerprint: str, chunk_tokens: int = 256, rope_theta: float | None = None
) -> RoundTrip:
    """Store ``kv`` (a prefix from position 0) chunk by chunk through ``preset`` and restore it,
    timing both directions."""
    p = get(preset) if isinstance(preset, str) else preset
    objs, enc, dec = [], 0.0, 0.0
    parts = []
    for start in range(0, kv.shape[3], chunk_tokens):
        piece = kv[:, :, :, start : start + chunk_tokens].contiguous()
        t = time.perf_counter()
        obj = encode_chunk(piece, p, fingerprint, start=start, rope_theta=rope_theta)
        enc += time.perf_counter() - t
        t = time.perf_counter()
        parts.append(decode_chunk(obj, fingerprint))
        dec += time.perf_counter() - t
        objs.append(len(obj))
    return RoundTrip(torch.cat(parts, dim=3), sum(objs), enc, dec)


@dataclass
class PromptResult:
    prompt: str
    tokens: int
    fp16_bytes: int
    stored_bytes: int
    ratio_vs_fp16: float
    bit_exact: bool
    greedy_agreement: float
    first_divergence: int
    nll_original: float
    nll_restored: float
    nll_increase: float
    encode_s: float
    decode_s: float
    max_abs_error: float


@dataclass
class Report:
    preset: str
    tokens: int
    prompts: list[PromptResult] = field(default_factory=list)

    def summary(self) -> dict:
        n = len(self.prompts)
        fp16_bytes = sum(r.fp16_bytes for r in self.prompts)
        mb = fp16_bytes / 1e6
        enc = sum(r.encode_s for r in self.prompts)
        dec = sum(r.decode_s for r in self.prompts)
        return {
            "preset": self.preset,
            "tokens": self.tokens,
            "prompts": n,
            "ratio_vs_fp16": fp16_bytes / sum(r.stored_bytes for r in self.prompts),
            "bit_exact": all(r.bit_exact for r in self.prompts),
            "greedy_agreement": sum(r.greedy_agreement for r in self.prompts) / n,
            "min_first_divergence": min(r.first_divergence for r in self.prompts),
            "nll_increase": sum(r.nll_increase for r in self.prompts) / n,
            "encode_mb_s": mb / enc if enc else None,
            "decode_mb_s": mb / dec if dec else None,
            "per_prompt": [asdict(r) for r in self.prompts],
        }


def prompt_ids(lm: model.LoadedModel, name: str, offset: int, tokens: int, cont: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    ids = model.tokenize(lm, model.sample_text(name))
    if offset + tokens + cont > len(ids):
        offset = max(0, len(ids) - tokens - cont)
    if offset + tokens + cont > len(ids):
        raise ValueError(f"{name} has {len(ids)} tokens, too few for {tokens}+{cont}")
    return ids[offset : offset + tokens], ids[offset + tokens : offset + tokens + cont]


def _cases(lm: model.LoadedModel, tokens: int, prompts, text: str | None) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(label, prefix ids, continuation ids) for one text from its start, or the prompt set."""
    if text is None:
        return [(f"{n}@{o}", *prompt_ids(lm, n, o, tokens)) for n, o in (prompts or PROMPTS)]
    ids = model.tokenize(lm, text)
    if len(ids) < tokens:
        raise ValueError(f"text has only {len(ids)} tokens, {tokens} asked")
    return [("text", ids[:tokens], ids[tokens : tokens + 64])]


def evaluate(
    preset: Preset | str,
    tokens: int = 512,
    prompts: list[tuple[str, int]] | None = None,
    text: str | None = None,
    n_new: int = 32,
    chunk_tokens: int = 256,
    storage_dtype: torch.dtype = torch.float16,
) -> Report:
    """Run the harness for one preset over ``prompts`` (or one ``text``, from its start)."""
    lm = model.load()
    p = get(preset) if isinstance(preset, str) else preset
    report = Report(p.name, tokens)
    theta = model.rope_theta(lm)
    for label, ids, cont in _cases(lm, tokens, prompts, text):
        kv32, _ = model.prefill(lm, ids)
        kv = kv32.to(storage_dtype)
        rt = round_trip(kv, p, lm.fingerprint, chunk_tokens, theta)
        orig = model.greedy(lm, ids, kv, n_new)
        rest = model.greedy(lm, ids, rt.kv, n_new)
        same = [a == b for a, b in zip(orig, rest)]
        first = same.index(False) if False in same else n_new
        nll_o = model.continuation_nll(lm, ids, kv, cont) if len(cont) > 1 else float("nan")
        nll_r = model.continuation_nll(lm, ids, rt.kv, cont) if len(cont) > 1 else float("nan")
        report.prompts.append(
            PromptResult(
                prompt=label,
                tokens=len(ids),
                fp16_bytes=kv.numel() * 2,
                stored_bytes=rt.stored_bytes,
                ratio_vs_fp16=kv.numel() * 2 / rt.stored_bytes,
                bit_exact=bool(torch.equal(rt.kv.view(torch.uint8), kv.view(torch.uint8))),
                greedy_agreement=sum(same) / n_new,
                first_divergence=first,
                nll_original=nll_o,
                nll_restored=nll_r,
                nll_increase=(nll_r - nll_o) / nll_o if nll_o == nll_o and nll_o > 0 else 0.0,
                encode_s=rt.encode_s,
                decode_s=rt.decode_s,
                max_abs_error=float((rt.kv.float() - kv.float()).abs().max()),
            )
        )
    return report
