"""kvfetcher command line: ``eval``, ``presets`` and ``calibrate`` here; ``serve`` and ``demo`` register theirs."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def _eval(args: argparse.Namespace) -> int:
    from kvfetcher.eval import accuracy
    from kvfetcher import codec

    text = Path(args.text).read_text() if args.text else None
    report = accuracy.evaluate(args.preset, tokens=args.tokens, text=text, chunk_tokens=args.chunk_tokens)
    s = report.summary()
    s["codec_backend"] = _backend_name(args.preset, codec.capabilities())
    if not args.per_prompt:
        s.pop("per_prompt")
    if args.json:
        print(json.dumps(s, indent=None if args.compact else 2))
    else:
        for k, v in s.items():
            print(f"{k:>22}: {v}")
    return 0


def _backend_name(preset: str, caps: dict) -> str:
    from kvfetcher.format.presets import get

    fmt = get(preset).codec.format
    if fmt == "raw":
        return "raw"
    enc = "nvenc" if caps.get("nvenc") else "x265"
    dec = "libavcodec"  # eval restores on the CPU; NVDEC rates are the GPU benchmarks' business
    return f"{enc}+{dec}"


def _presets(args: argparse.Namespace) -> int:
    from kvfetcher.format import calibration, presets

    fp = args.model
    cal = calibration.calibration_for(fp) if fp else calibration.default()
    shipped = cal is not None and cal.name == calibration.default().name  # the shipped figures are its model's
    rows = []
    for name, p in presets.PRESETS.items():
        why = presets.refusal(name, fp) if fp else None
        fig = None if why else (cal.measured or {}).get(name) if cal and cal.measured else presets.measured(name) if shipped else None
        row = dict((presets.get(name, fp) if fp and not why else p).to_dict(), measured=fig)
        if fp:
            row.update(model=fp, calibration=cal.name if cal else None, refused=why)
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if fp:
        print(f"model {fp}: calibration {cal.name if cal else 'none (presets that need one are refused)'}")
    for r in rows:
        m = r["measured"]
        fig = ("refused: no calibration" if r.get("refused") else "not measured" if not m else
               f"{m['ratio_vs_fp16']:.2f}x, " + (f"KL {m['kl']:.2g}" if "kl" in m else f"agreement {m['greedy_agreement']:.3f}"))
        print(f"{r['name']:>9}  {fig:<28}  {r['summary']}")
    return 0


def _store_at(url: str):
    """The store ``url`` names: ``http(s)://host:port/bucket`` (S3; credentials from
    ``KVFETCHER_S3_ACCESS_KEY`` / ``KVFETCHER_S3_SECRET_KEY``) or a local store directory."""
    import os
    from urllib.parse import urlparse

    from kvfetcher import config, store

    u = urlparse(url)
    if u.scheme in ("http", "https"):
        env = dict(os.environ, **{config.S3_ENDPOINT.name: f"{u.scheme}://{u.netloc}", config.S3_BUCKET.name: u.path.strip("/") or "kvfetcher"})
        return store.from_env(env)
    return store.from_env({config.STORE_DIR.name: u.path if u.scheme == "file" else url})


def _calibrate(args: argparse.Namespace) -> int:
    import shutil

    from kvfetcher.codec import basis
    from kvfetcher.eval import calibrate, model
    from kvfetcher.format import calibration

    lm = model.load(args.model)
    tag = args.tag or lm.fingerprint.split("/", 1)[0]
    doc, b = calibrate.calibrate(lm, tag, [Path(t) for t in args.texts] if args.texts else None,
                                 measure_prompts=None if args.no_measure else calibrate.MEASURE_PROMPTS)
    path = calibration.write(doc)
    basis_path = basis.path_of(b.name)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path, basis_path = Path(shutil.copy(path, out)), Path(shutil.copy(basis_path, out))
    print(json.dumps({"model": tag, "fingerprint": lm.fingerprint, "calibration": str(path), "basis": str(basis_path)}))
    if args.publish:
        names = calibration.publish(_store_at(args.publish), path, basis_path)
        print(json.dumps({"published": names}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvfetcher", description=__doc__)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)

    ev = sub.add_parser("eval", help="round-trip the real model's KV through a preset and measure it")
    ev.add_argument("--text", help="text file to prefill (default: the shipped prompt set)")
    ev.add_argument("--tokens", type=int, default=512)
    ev.add_argument("--preset", default="q8")
    ev.add_argument("--chunk-tokens", type=int, default=256)
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--compact", action="store_true", help="one-line JSON")
    ev.add_argument("--per-prompt", action="store_true")
    ev.set_defaults(func=_eval)

    pr = sub.add_parser("presets", help="list presets with their parameters and measured figures")
    pr.add_argument("--json", action="store_true")
    pr.add_argument("--model", help="a model fingerprint: its presets (those needing a calibration it lacks are refused)")
    pr.set_defaults(func=_presets)

    ca = sub.add_parser("calibrate", help="calibrate a model's basis and per-layer steps on its own KV")
    ca.add_argument("--model", required=True, help="a transformers model directory or a GGUF file")
    ca.add_argument("--tag", help="the fingerprint prefix it applies to (default: the model's name)")
    ca.add_argument("--texts", nargs="+", help="calibration text files (default: the shipped calibration texts)")
    ca.add_argument("--out", help="also copy the artefact and its basis here")
    ca.add_argument("--no-measure", action="store_true", help="skip measuring its presets on evaluation prompts")
    ca.add_argument("--publish", metavar="STORE_URL", help="put them in a pool's store: http(s)://host:port/bucket or a directory")
    ca.set_defaults(func=_calibrate)

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
