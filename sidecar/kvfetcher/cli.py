"""kvfetcher command line: ``eval``, ``presets``, ``calibrate`` and ``evict`` here; ``serve`` and ``demo`` register theirs.

Errors a user can make (a missing file, an unknown preset, a bad number, a busy port, a store URL
of an unknown scheme) end the command with one line on stderr and a non-zero status, never a
traceback (``--log-level DEBUG`` shows it). Logs go to stderr at ``KVFETCHER_LOG_LEVEL`` (or
``--log-level``), as text or as one JSON object a line (``KVFETCHER_LOG_FORMAT=json``, ``--log-json``).
"""

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
    from kvfetcher.format import calibration, presets

    fp = args.model
    cal = calibration.calibration_for(fp) if fp else calibration.default()
    shipped = cal is not None and cal.name == calibration.default().name  # the shipped figures are its model's
    rows = []
    for name, p in presets.PRESETS.items():
        why = presets.refusal(name, fp) if fp else None
        # the calibration's own figures (harness v2) first, else the shipped benchmark's for the default model
        fig = None if why else ((cal.measured or {}).get(name) if cal else None) or (presets.measured(name) if shipped else None)
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
        print(f"{r['name']:>14}  {fig:<28}  {r['summary']}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    import shutil

    from kvfetcher import store
    from kvfetcher.codec import basis
    from kvfetcher import config as settings
    from kvfetcher.eval import calibrate, model
    from kvfetcher.format import calibration, mac

    lm = model.load(args.model)
    tag = basis.tag_of(args.tag) if args.tag else lm.fingerprint.split("/", 1)[0]
    texts = [Path(t) for t in args.texts] if args.texts else None
    if args.retune:
        doc = calibrate.retune(lm, Path(args.retune), texts, tuple(args.presets.split(",")))
        cal = calibration.parse(doc, doc["model"])
        if not args.no_measure:
            doc["measured"] = calibrate.measure(lm, cal, calibrate.MEASURE_PROMPTS)
        b = basis.load(cal.basis)
    else:
        doc, b = calibrate.calibrate(lm, tag, texts, measure_prompts=None if args.no_measure else calibrate.MEASURE_PROMPTS)
    path = calibration.write(doc)
    basis_path = basis.path_of(b.name)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path, basis_path = Path(shutil.copy(path, out)), Path(shutil.copy(basis_path, out))
    print(json.dumps({"model": tag, "fingerprint": lm.fingerprint, "calibration": str(path), "basis": str(basis_path)}))
    if args.publish:
        key = mac.key_from(settings.OBJECT_KEY.read())  # the pool's key: its sidecars take only tagged calibrations
        names = calibration.publish(store.from_url(args.publish), path, basis_path, key)
        print(json.dumps({"published": names}))
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
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, not {text!r}") from None
        if not 0 < v < float("inf"):
            raise argparse.ArgumentTypeError(f"must be positive, not {text}")
        return v

    return parse


def _size(text: str) -> int:
    """A byte count: a plain integer or a quantity as a pool's spec writes it (``700Gi``, ``10G``)."""
    from kvfetcher.config import quantity_bytes

    try:
        v = quantity_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte, not {text}")
    return v


def _preset(text: str) -> str:
    from kvfetcher.config import PRESET_NAMES

    if text not in PRESET_NAMES:
        raise argparse.ArgumentTypeError(f"unknown preset {text!r}; known: {', '.join(PRESET_NAMES)}")
    return text


def _existing(text: str) -> str:
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"no such file or directory: {text}")
    return text


def _readable(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


class JsonFormatter(logging.Formatter):
    """One JSON object a record: time, level, logger, message (and the traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"), "level": record.levelname,
               "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(level: str, as_json: bool) -> None:
    """Logs to stderr at ``level`` (a name such as INFO), as text or JSON lines."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if as_json else logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvfetcher")
    except PackageNotFoundError:
        return "unknown (not installed)"


class _Parser(argparse.ArgumentParser):
    """An argument error is one line (no usage dump), status 2; subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from kvfetcher import config

    ap = _Parser(prog="kvfetcher", description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="version", version=f"kvfetcher {_version()}")
    ap.add_argument("-v", "--verbose", action="store_true", help="same as --log-level DEBUG")
    ap.add_argument("--log-level", type=str.upper, choices=config.LOG_LEVELS, default=None,
                    help=f"log level (default {config.LOG_LEVEL.name}, else INFO)")
    ap.add_argument("--log-json", action="store_true", default=None,
                    help=f"logs as one JSON object a line (default {config.LOG_FORMAT.name}=json)")
    sub = ap.add_subparsers(dest="cmd", required=True)

    ev = sub.add_parser("eval", help="round-trip a model's KV through a preset and measure what the model then says "
                        "(exit status 3: the preset misses its accuracy gate)")
    ev.add_argument("--model", help="a GGUF file or a transformers directory (default: the shipped SmolLM2)")
    ev.add_argument("--text", type=_readable, help="text file to prefill (default: the eval-only prompt set)")
    ev.add_argument("--tokens", type=_positive(int), default=256, help="prefix tokens per prompt")
    ev.add_argument("--cont", type=_positive(int), default=256, help="continuation tokens scored per prompt (teacher forcing)")
    ev.add_argument("--suite", action="store_true", help="the full prompt set, the retrieval task and greedy figures")
    ev.add_argument("--greedy", type=_positive(int), help="greedy tokens to compare (default 32 with --suite, else none)")
    ev.add_argument("--retrieval-tokens", type=_positive(int), help="retrieval prefix length with --suite (default 1024, "
                    "or the model's sliding window)")
    ev.add_argument("--preset", type=_preset, default="q8")
    ev.add_argument("--chunk-tokens", type=_positive(int), default=256)
    ev.add_argument("--json", action="store_true")
    ev.add_argument("--compact", action="store_true", help="one-line JSON")
    ev.add_argument("--per-prompt", action="store_true")
    ev.set_defaults(func=_eval)

    pr = sub.add_parser("presets", help="list presets with their parameters and measured figures")
    pr.add_argument("--json", action="store_true")
    pr.add_argument("--model", help="a model fingerprint: its presets (those needing a calibration it lacks are refused)")
    pr.set_defaults(func=_presets)

    ex = sub.add_parser("evict", help="keep a store within a size and an idle time: least recently fetched prefix ends go first")
    ex.add_argument("--store", help="http(s)://host[:port]/bucket (credentials from KVFETCHER_S3_*), file:///dir or a "
                    "directory (default: the store the environment names, as the sidecar's)")
    ex.add_argument("--max-bytes", type=_size, help="bytes the store may hold, every representation counted (an "
                    "integer or a quantity: 700Gi, 10G)")
    ex.add_argument("--ttl-days", type=_positive(float), help="evict what was not fetched (or stored) for this long")
    when = ex.add_mutually_exclusive_group()
    when.add_argument("--once", action="store_true", help="one run, then exit (the default)")
    when.add_argument("--every", type=_positive(float), metavar="S", help="a run every S seconds until stopped")
    ex.set_defaults(func=_evict)
    ca = sub.add_parser("calibrate", help="calibrate a model's basis and per-layer steps on its own KV")
    ca.add_argument("--model", required=True, type=_existing, help="a transformers model directory or a GGUF file")
    ca.add_argument("--tag", help="the fingerprint prefix it applies to (default: the model's name)")
    ca.add_argument("--texts", nargs="+", type=_readable, help="calibration text files (default: the shipped calibration texts)")
    ca.add_argument("--out", help="also copy the artefact and its basis here")
    ca.add_argument("--no-measure", action="store_true", help="skip measuring its presets on evaluation prompts")
    ca.add_argument("--retune", metavar="ARTEFACT", help="only tune the budgets of this calibration of the model again "
                    "(its basis and per-layer allocation kept)")
    ca.add_argument("--presets", default="balanced,compact", help="with --retune: the presets whose budgets are tuned "
                    "(the others keep their steps)")
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
    """Run a subcommand; its status, or 1 (a user's error: one line on stderr) or 2 (bad arguments)."""
    from kvfetcher import config

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        level = "DEBUG" if args.verbose else args.log_level or config.LOG_LEVEL.read()
        as_json = args.log_json if args.log_json is not None else config.LOG_FORMAT.read() == "json"
    except ValueError as e:  # a malformed KVFETCHER_LOG_* variable
        parser.error(str(e))
    configure_logging(level, as_json)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if level == "DEBUG":
            raise
        print(f"kvfetcher {args.cmd}: error: {_one_line(e)}", file=sys.stderr)
        return 1


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, (OSError, ValueError)) else f"{type(e).__name__}: {text}"


if __name__ == "__main__":
    sys.exit(main())
