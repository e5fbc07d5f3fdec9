"""kvfetcher command line: ``eval`` and ``presets`` here; ``serve`` and ``demo`` register theirs."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def _eval(args: argparse.Namespace) -> int:
    from kvfetcher.eval import accuracy, model
    from kvfetcher import codec

    lm = model.load(args.model)
    text = Path(args.text).read_text() if args.text else None
    retrieval_tokens = (args.retrieval_tokens or min(1024, model.max_prefix(lm) or 1024)) if args.suite else 0
    report = accuracy.evaluate(args.preset, tokens=args.tokens, text=text, chunk_tokens=args.chunk_tokens, lm=lm,
                               cont=args.cont, n_new=args.greedy if args.greedy is not None else (32 if args.suite else 0),
                               suite=text is None, retrieval_tokens=retrieval_tokens)
    s = report.summary()
    s["codec_backend"] = _backend_name(args.preset, codec.capabilities())
    if not args.per_prompt:
        s.pop("per_prompt")
    if args.json:
        print(json.dumps(s, indent=None if args.compact else 2))
    else:
        for k, v in s.items():
            print(f"{k:>22}: {v}")
    return 0 if s["gate"] is None or s["gate"]["passed"] else 3


def _backend_name(preset: str, caps: dict) -> str:
    from kvfetcher.format.presets import get

    fmt = get(preset).codec.format
    if fmt == "raw":
        return "raw"
    enc = "nvenc" if caps.get("nvenc") else "x265"
    dec = "libavcodec"  # eval restores on the CPU; NVDEC rates are the GPU benchmarks' business
    return f"{enc}+{dec}"


def _presets(args: argparse.Namespace) -> int:
    from kvfetcher.format.presets import PRESETS, measured

    rows = [dict(p.to_dict(), measured=measured(p.name)) for p in PRESETS.values()]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            m = r["measured"]
            fig = f"{m['ratio_vs_fp16']:.2f}x, agreement {m['greedy_agreement']:.3f}" if m else "not measured"
            print(f"{r['name']:>9}  {fig:<28}  {r['summary']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvfetcher", description=__doc__)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)

    ev = sub.add_parser("eval", help="round-trip a model's KV through a preset and measure what the model then says "
                        "(exit status 3: the preset misses its accuracy gate)")
    ev.add_argument("--model", help="a GGUF file or a transformers directory (default: the shipped SmolLM2)")
    ev.add_argument("--text", help="text file to prefill (default: the eval-only prompt set)")
    ev.add_argument("--tokens", type=int, default=256, help="prefix tokens per prompt")
    ev.add_argument("--cont", type=int, default=256, help="continuation tokens scored per prompt (teacher forcing)")
    ev.add_argument("--suite", action="store_true", help="the full prompt set, the retrieval task and greedy figures")
    ev.add_argument("--greedy", type=int, help="greedy tokens to compare (default 32 with --suite, else none)")
    ev.add_argument("--retrieval-tokens", type=int, help="retrieval prefix length with --suite (default 1024, "
                    "or the model's sliding window)")
    ev.add_argument("--preset", default="q8")
    ev.add_argument("--chunk-tokens", type=int, default=256)
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--compact", action="store_true", help="one-line JSON")
    ev.add_argument("--per-prompt", action="store_true")
    ev.set_defaults(func=_eval)

    pr = sub.add_parser("presets", help="list presets with their parameters and measured figures")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=_presets)

    for register in _plugins():
        register(sub)
    return ap


def _plugins():
    """Subcommands that live beside their code: a module with ``register_cli(subparsers)``."""
    found = []
    for mod in ("api.server", "eval.demo"):
        try:
            m = __import__(f"kvfetcher.{mod}", fromlist=["register_cli"])
        except ModuleNotFoundError as e:
            if e.name != f"kvfetcher.{mod}":
                raise
            continue
        if hasattr(m, "register_cli"):
            found.append(m.register_cli)
    return found


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
