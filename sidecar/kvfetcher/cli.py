"""kvfetcher command line: ``eval``, ``presets`` and ``evict`` here; ``serve`` and ``demo`` register theirs."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
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
    if fmt in ("raw", "zstd"):
        return fmt  # (zstd: the CPU's here; eval restores on the CPU)
    if fmt == "ans":
        return "nvcomp-ans"
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
            print(f"{r['name']:>14}  {fig:<28}  {r['summary']}")
    return 0


def _evict(args: argparse.Namespace) -> int:
    """Enforce the bounds once, or every ``--every`` seconds until stopped; one JSON report a run on
    stdout. Exit status (``--once``): 1 when the run met an error (what it did is still reported)."""
    from kvfetcher.store import from_env, from_url
    from kvfetcher.store.retention import Evictor

    store = from_url(args.store) if args.store else from_env()
    evictor = Evictor(store)
    ttl_s = None if args.ttl_days is None else args.ttl_days * 86400.0
    while True:
        t = time.monotonic()
        report = evictor.enforce(args.max_bytes, ttl_s)
        print(json.dumps(report.to_dict()), flush=True)
        if args.every is None:
            return 1 if report.errors else 0
        time.sleep(max(0.0, args.every - (time.monotonic() - t)))


def _positive(kind):
    def parse(text: str):
        v = kind(text)
        if not v > 0:
            raise argparse.ArgumentTypeError(f"must be positive, not {text}")
        return v

    return parse


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

    ex = sub.add_parser("evict", help="keep a store within a size and an idle time: least recently fetched prefix ends go first")
    ex.add_argument("--store", help="http(s)://host[:port]/bucket (credentials from KVFETCHER_S3_*), file:///dir or a "
                    "directory (default: the store the environment names, as the sidecar's)")
    ex.add_argument("--max-bytes", type=_positive(int), help="bytes the store may hold, every representation counted")
    ex.add_argument("--ttl-days", type=_positive(float), help="evict what was not fetched (or stored) for this long")
    when = ex.add_mutually_exclusive_group()
    when.add_argument("--once", action="store_true", help="one run, then exit (the default)")
    when.add_argument("--every", type=_positive(float), metavar="S", help="a run every S seconds until stopped")
    ex.set_defaults(func=_evict)

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
