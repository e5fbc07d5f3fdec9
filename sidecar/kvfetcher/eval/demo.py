"""demo: the README's main job — remote KV reuse end to end, on one machine, no GPU.

Two sidecars on loopback share one store (a local directory, or S3 when
``KVFETCHER_S3_ENDPOINT`` is set). "Server A" gets a long prompt nobody has seen: it prefills it
with the real small model (SmolLM2-135M), answers, and stores the prompt's KV through its
sidecar. "Server B" then gets the same prompt: its sidecar finds the prefix, fetches and
decodes it into B's KV buffer, B prefills only the few remaining tokens and generates. We
report time to first token both ways, the bytes moved, the compression ratio, and whether B
generated exactly what A did. Every figure comes from this run; none is looked up.
"""

from __future__ import annotations

import argparse
import json
import secrets
import tempfile
import time

import torch

from kvfetcher.eval import model
from kvfetcher.api.client import KVClient
from kvfetcher.integrations.transformers import CachedLM
from kvfetcher.format.presets import get
from kvfetcher.api.server import Embedded
from kvfetcher.config import CHUNK_TOKENS, S3_ENDPOINT, Config
from kvfetcher.service import Sidecar
from kvfetcher.store import from_env
from kvfetcher.store.local import LocalStore


def run(prompt_tokens: int = 1800, new_tokens: int = 32, chunk_tokens: int = 256, preset: str | None = None,
        text: str = "license.txt") -> dict:
    config = Config.from_env()
    config.chunk_tokens = chunk_tokens
    if preset:
        config.presets = (get(preset).name,)
    tmp = None
    if S3_ENDPOINT.read():
        store = from_env()
    else:
        tmp = tempfile.TemporaryDirectory(prefix="kvfetcher-demo-")
        store = LocalStore(tmp.name)
    lm = model.load()
    ids = model.tokenize(lm, model.sample_text(text), prompt_tokens)
    with torch.inference_mode():  # warm-up: first-call overheads are not prefill time
        lm.model(ids[:16].unsqueeze(0))
    token = secrets.token_urlsafe(24)
    capacity = prompt_tokens + new_tokens
    with Embedded(Sidecar(store, config), token) as sa, Embedded(Sidecar(store, config), token) as sb:
        a = CachedLM(lm.model, lm.fingerprint, KVClient(socket_path=sa.socket), capacity)
        ga = a.generate(ids, new_tokens)  # nothing stored yet: a full prefill
        t = time.perf_counter()
        a.client.flush()  # wait for A's sidecar to encode and upload (off the request path)
        store_s = time.perf_counter() - t
        b = CachedLM(lm.model, lm.fingerprint, KVClient(socket_path=sb.socket), capacity, prefill=a.prefill)
        gb = b.generate(ids, new_tokens, store=False)
        bytes_stored = sum(store.list("kv/").values())
        a.close()
        b.close()
    if tmp:
        tmp.cleanup()
    fetched = gb.fetch
    bytes_fetched = fetched.bytes_read if fetched else 0
    kv_bytes = gb.loaded_tokens * b.buffer.tensor[:, :, :, :1].numel() * b.buffer.tensor.element_size()
    same = sum(x == y for x, y in zip(ga.tokens, gb.tokens))
    return {
        "model": lm.fingerprint,
        "prompt_tokens": prompt_tokens,
        "chunk_tokens": chunk_tokens,
        "preset": ",".join(config.presets),
        "ttft_recompute_s": round(ga.ttft_s, 3),
        "ttft_fetch_s": round(gb.ttft_s, 3),
        "speedup": round(ga.ttft_s / gb.ttft_s, 2),
        "loaded_tokens": gb.loaded_tokens,
        "computed_tokens": gb.computed_tokens,
        "fetch_s": round(fetched.seconds, 3) if fetched else 0.0,
        "fetch_decision": fetched.decision.preset if fetched and fetched.decision else None,
        "fetch_predicted_s": round(fetched.decision.predicted_s, 3) if fetched and fetched.decision else None,
        "fetch_error": fetched.error if fetched else None,
        "bytes_fetched": bytes_fetched,
        "kv_bytes_fp16": kv_bytes,
        "compression_ratio": round(kv_bytes / bytes_fetched, 2) if bytes_fetched else None,
        "bytes_stored": bytes_stored,
        "store_s": round(store_s, 3),
        "new_tokens": new_tokens,
        "identical_tokens": ga.tokens == gb.tokens,
        "matching_tokens": same,
        "text": lm.tokenizer.decode(gb.tokens),
    }


def render(r: dict) -> str:
    mb = lambda n: f"{n / 1e6:.1f} MB"  # noqa: E731
    return "\n".join(
        [
            f"kvfetcher demo: {r['model']}, {r['prompt_tokens']}-token prompt, chunks of {r['chunk_tokens']}, preset {r['preset']}",
            f"  A  recompute: prefill {r['prompt_tokens']} tokens        -> first token in {r['ttft_recompute_s']:.2f} s",
            f"     stored {mb(r['bytes_stored'])} in the background (encode + upload) in {r['store_s']:.2f} s",
            f"  B  fetch {r['loaded_tokens']} tokens ({r['fetch_decision']}, {mb(r['bytes_fetched'])} for {mb(r['kv_bytes_fp16'])} of fp16 KV,"
            f" ratio {r['compression_ratio']}x) in {r['fetch_s']:.2f} s (predicted {r['fetch_predicted_s']:.2f} s),",
            f"     prefill the other {r['computed_tokens']} tokens   -> first token in {r['ttft_fetch_s']:.2f} s  ({r['speedup']}x)",
            f"  generated tokens identical: {'yes' if r['identical_tokens'] else 'NO'} ({r['matching_tokens']}/{r['new_tokens']})"
            + (f"; fetch error: {r['fetch_error']}" if r["fetch_error"] else ""),
            f"  B says: {r['text']!r}",
        ]
    )


def register_cli(sub) -> None:
    p = sub.add_parser("demo", help="two sidecars on loopback: prefill+store on one, fetch+generate on the other")
    p.add_argument("--tokens", type=int, default=1800, help="prompt length")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS.read())
    p.add_argument("--preset", default=None, help="stored representation (default: KVFETCHER_PRESET or q8)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    def main(args: argparse.Namespace) -> int:
        r = run(args.tokens, args.new_tokens, args.chunk_tokens, args.preset)
        print(json.dumps(r) if args.json else render(r))
        return 0 if r["identical_tokens"] else 1

    p.set_defaults(func=main)
