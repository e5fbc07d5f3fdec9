"""cold_start_bench: the first fetch after a fresh sidecar start, with and without warming the decode workers.

A sidecar's decode worker processes start with torch imported and nothing else. On their first
chunk they would also create a CUDA context, load libnvcuvid and open an NVDEC session, load the
unpack kernels, move the model basis to the device and map the KV buffer (CUDA IPC). With
``KVFETCHER_WARM_UP`` on (the default) the sidecar restores tiny chunks in every worker at start
(``DecodeWorkers.warm``) and has the workers map a buffer when it is registered; off, all of it
lands on the first fetch. This measures both, side by side, in one run: each round starts
``kvfetcher serve`` afresh in a process of its own (as in a pod; a CUDA IPC handle cannot be
opened by the process that made it), waits until it is ready, registers a KV buffer, waits
``--gap-s`` (a model's first request comes some time after it registers its cache), then times
the first fetch of a stored prefix and a second one (the warm reference). Modes alternate round
by round; the report gives medians per mode. Also recorded: the decode rate the cost model was
shown by each fetch (``kvfetcher_decode_bytes_per_second``), the seconds until the sidecar was
ready, and its warm-up gauge.

The stored prefix is synthetic KV of a model shape (``fetchkit.encode_objects``: a few distinct
chunks cycled); the store is a local directory, so the link is not what is measured.

    python -m benchmarks.cold_start.cold_start_bench --device cpu --procs 2
    python -m benchmarks.cold_start.cold_start_bench --device cuda     # 8 workers, Llama-3-8B's KV shape
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

from benchmarks.lib import fetchkit
from benchmarks.lib.linkserver import free_port

from kvfetcher import ipc, keys
from kvfetcher.api.client import KVClient
from kvfetcher.eval.costmodel import ModelShape
from kvfetcher.store.local import LocalStore
from kvfetcher.fetch.plan import FetchOptions

TOKEN = "cold-start-bench"
MODES = {"cold": "0", "warm": "1"}  # KVFETCHER_WARM_UP


def device_tag(name: str) -> str:
    """``cpu``, or the GPU's model in short (``h100``), for file names."""
    if name == "cpu":
        return "cpu"
    m = re.search(r"\b([A-Z]+\d{2,4})\b", name)
    return m.group(1).lower() if m else "gpu"


def store_prefix(directory: Path, shape: ModelShape, presets: list[str], chunks: int, chunk_tokens: int) -> list[int]:
    """Write a prefix of ``chunks`` chunks in every preset under the keys a sidecar looks up; its tokens."""
    tokens = list(range(1000, 1000 + chunks * chunk_tokens))
    ns = keys.Namespace(model=fetchkit.FINGERPRINT, dtype="bfloat16", shape=(shape.layers, shape.kv_heads, shape.head_dim))
    store = LocalStore(directory)
    for p in presets:
        objs = fetchkit.encode_objects(shape, p, chunk_tokens, distinct=2, workers=2)
        for i, k in enumerate(keys.chunk_keys(ns, tokens, chunk_tokens)):
            store.put(keys.object_name(k, p), objs[i % len(objs)])
    return tokens


def gauge(metrics: str, name: str, preset: str | None = None) -> float | None:
    """A gauge's value in a Prometheus exposition (``preset`` its label), if present."""
    label = f'{{preset="{preset}"}}' if preset else ""
    m = re.search(rf"^{re.escape(name + label)} (\S+)$", metrics, re.M)
    return float(m.group(1)) if m else None


def one_round(a, mode: str, store_dir: Path, tokens: list[int], buf: ipc.SharedBuffer) -> dict:
    """Start a sidecar, register ``buf``, wait, fetch the prefix twice; seconds and learnt decode rates."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "sidecar"), os.environ.get("PYTHONPATH", "")]),
               KVFETCHER_STORE_DIR=str(store_dir), KVFETCHER_AUTH_TOKEN=TOKEN, KVFETCHER_PRESET=",".join(a.writes),
               KVFETCHER_CHUNK_TOKENS=str(a.chunk_tokens), KVFETCHER_DECODE_PROCS=str(a.procs),
               KVFETCHER_ROPE_THETA=str(a.shape.rope_theta), KVFETCHER_WARM_UP=MODES[mode], KVFETCHER_TRUST_STORE="1")
    for k in ("KVFETCHER_S3_ENDPOINT", "KVFETCHER_ALLOWED_PRESETS", "KVFETCHER_TENANT", "KVFETCHER_POOL"):
        env.pop(k, None)
    if a.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the sidecar and its workers then decode on CPU, as the buffer is
    t0 = time.perf_counter()
    # the Unix socket: a host-memory buffer registers only there (its fd is passed), a CUDA one either way
    sock = str(store_dir.parent / f"cold-start-{port}.sock")
    proc = subprocess.Popen([sys.executable, "-m", "kvfetcher.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--socket", sock],
                            env=env)
    c = KVClient(socket_path=sock, timeout_s=600)
    try:
        while True:
            try:
                c.metrics()
                break
            except OSError:
                if proc.poll() is not None or time.perf_counter() - t0 > 600:
                    raise RuntimeError(f"sidecar did not start (exit {proc.poll()})") from None
                time.sleep(0.05)
        out: dict = {"mode": mode, "ready_s": time.perf_counter() - t0}
        bid = c.register(buf.handle, fetchkit.FINGERPRINT)
        time.sleep(a.gap_s)
        for which in ("first", "second"):
            t = time.perf_counter()
            r = c.fetch(bid, tokens, options=FetchOptions(presets=[a.preset], recompute_tokens_per_s=1.0))
            s = time.perf_counter() - t
            if r.error or r.loaded_tokens != len(tokens):
                raise RuntimeError(f"{which} fetch loaded {r.loaded_tokens} of {len(tokens)} tokens: {r.error} {r.reason}")
            rate = gauge(c.metrics(), "kvfetcher_decode_bytes_per_second", a.preset)
            out[which] = {"seconds": s, "sidecar_s": r.seconds, "decode_rate": rate}
        out["warm_up_gauge_s"] = gauge(c.metrics(), "kvfetcher_decode_warm_up_seconds")
        return out
    finally:
        c.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def median(xs) -> float | None:
    xs = list(xs)
    return None if None in xs else statistics.median(xs)


def summary(rounds: list[dict]) -> dict:
    """Medians per mode."""
    out = {}
    for mode in MODES:
        rs = [r for r in rounds if r["mode"] == mode]
        out[mode] = {
            "ready_s": median(r["ready_s"] for r in rs),
            "first_s": median(r["first"]["seconds"] for r in rs),
            "second_s": median(r["second"]["seconds"] for r in rs),
            "first_rate": median(r["first"]["decode_rate"] for r in rs),
            "second_rate": median(r["second"]["decode_rate"] for r in rs),
            "warm_up_gauge_s": median(r["warm_up_gauge_s"] or 0.0 for r in rs),
        }
    return out


def report(res: dict) -> str:
    s = res["summary"]
    gb = lambda x: "—" if x is None else f"{x / 1e9:.3g}"  # noqa: E731
    rows = [f"# First fetch after a fresh sidecar start, with and without warm-up ({res['device']}, {res['date']})", "",
            f"Produced by `benchmarks/cold_start/cold_start_bench.py` (`{res['command']}`): {res['starts']} fresh `kvfetcher serve` processes per mode, "
            f"modes alternating, medians. {res['procs']} decode worker processes; a prefix of {res['chunks']} chunks x "
            f"{res['chunk_tokens']} tokens of synthetic bf16 KV shaped {res['shape']} (layers, KV heads, head dim), stored as "
            f"{'/'.join(res['presets'])}, fetched as `{res['preset']}` from a local directory by a sidecar writing "
            f"{'/'.join(res.get('writes', res['presets']))}; the buffer registered "
            f"{res['gap_s']:g} s before the first fetch. `cold`: `KVFETCHER_WARM_UP=0` (before this change); `warm`: the default "
            "(tiny chunks of each stored preset restored in every worker at start; at registration the buffer mapped and, in "
            "the background, one chunk of the model's own geometry per preset restored in every worker). "
            "Seconds are the client's, per fetch; decode rate is the `kvfetcher_decode_bytes_per_second` the fetch showed the "
            "cost model (KV bytes per second of decoding, GB/s).", "",
            "| mode | sidecar ready (s) | warm-up gauge (s) | first fetch (s) | second fetch (s) | first / second | "
            "decode rate, first (GB/s) | decode rate, second (GB/s) |",
            "|---|---|---|---|---|---|---|---|"]
    for mode, m in s.items():
        rows.append(f"| {mode} | {m['ready_s']:.2f} | {m['warm_up_gauge_s']:.2f} | {m['first_s']:.3f} | {m['second_s']:.3f} | "
                    f"{m['first_s'] / m['second_s']:.2f}x | {gb(m['first_rate'])} | {gb(m['second_rate'])} |")
    rows += ["", f"The warm-up takes {s['cold']['first_s'] - s['warm']['first_s']:.3f} s off the first fetch (median), "
             f"for {s['warm']['ready_s'] - s['cold']['ready_s']:.2f} s more before the sidecar is ready (it encodes the tiny "
             f"chunks, then every worker restores them); the gauge is the slowest worker's latest warm-up, the one at registration. Per round: `{Path(res['json']).name}`."]
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    ap.add_argument("--device", default="cuda" if cuda else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--procs", type=int, default=None, help="decode worker processes (default: 8 on cuda, 2 on cpu)")
    ap.add_argument("--shape", default=None, help="layers,kv_heads,head_dim (default: 32,8,128 on cuda, Llama-3-8B; 8,8,128 on cpu)")
    ap.add_argument("--presets", default="q8,balanced", help="stored presets: every worker warms each")
    ap.add_argument("--preset", default="balanced", help="the preset fetched")
    ap.add_argument("--writes", default=None, help="the presets the sidecar writes (default: the stored --presets); "
                    "e.g. raw, so that what it fetches was stored by another writer")
    ap.add_argument("--chunks", type=int, default=None, help="chunks in the prefix (default: 2 per worker)")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--starts", type=int, default=3, help="fresh sidecar starts per mode")
    ap.add_argument("--gap-s", type=float, default=8.0,
                    help="seconds between registering the buffer and the first fetch (the registration warm-up encodes a chunk of the model per preset on the CPU first: ~2 s each for the 8B shape)")
    ap.add_argument("--out-dir", default=".", help="writes result_<device>.json and .md there")
    ap.add_argument("--from-log", default=None,
                    help="build the report from the rounds a cut-short run printed (its stdout), with the same other options")
    ap.add_argument("--device-name", default=None, help="with --from-log on another machine: the GPU the rounds ran on")
    a = ap.parse_args()
    a.procs = a.procs if a.procs is not None else (8 if a.device == "cuda" else 2)  # 0: decode in threads
    L, H, D = (int(x) for x in (a.shape or ("32,8,128" if a.device == "cuda" else "8,8,128")).split(","))
    a.shape = ModelShape(f"{L},{H},{D}", L, 0, 0, H, D, 0, 0)
    a.presets = a.presets.split(",")
    a.writes = a.writes.split(",") if a.writes else a.presets
    a.chunks = a.chunks or 2 * a.procs
    if a.preset not in a.presets:
        ap.error(f"--preset {a.preset} must be one of the stored --presets")
    command = "python -m benchmarks.cold_start.cold_start_bench " + " ".join(sys.argv[1:])
    name = a.device_name or (torch.cuda.get_device_name() if a.device == "cuda" else "cpu")
    tag = device_tag(name)
    res = {"device": name, "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "command": command, "procs": a.procs, "shape": a.shape.name, "presets": a.presets,
           "writes": a.writes, "preset": a.preset, "chunks": a.chunks, "chunk_tokens": a.chunk_tokens, "starts": a.starts, "gap_s": a.gap_s, "rounds": []}
    out = Path(a.out_dir) / f"result_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    res["json"] = out.name
    if a.from_log:  # rounds printed one JSON line each; the device must be the one they ran on
        res["rounds"] = [json.loads(x) for x in Path(a.from_log).read_text().splitlines() if x.startswith('{"mode"')]
        res["starts"] = min(sum(r["mode"] == m for r in res["rounds"]) for m in MODES)
        argv = sys.argv[1:]
        drop = {i + k for i, x in enumerate(argv) if x in ("--from-log", "--device-name") for k in (0, 1)}
        res["command"] = "python -m benchmarks.cold_start.cold_start_bench " + " ".join(x for i, x in enumerate(argv) if i not in drop)
        res["command"] += f"`, cut short at its time limit; the report rebuilt from the {len(res['rounds'])} rounds it printed, with `--from-log"
    else:
        run_rounds(a, res, L, H, D)
    res["summary"] = summary(res["rounds"])
    out.write_text(json.dumps(res, indent=1) + "\n")
    md = report(res)
    out.with_suffix(".md").write_text(md)
    print(md)


def run_rounds(a, res: dict, L: int, H: int, D: int) -> None:
    """Fresh sidecars, modes alternating; each round's figures appended to ``res`` and printed."""
    with tempfile.TemporaryDirectory() as d:
        tokens = store_prefix(Path(d), a.shape, a.presets, a.chunks, a.chunk_tokens)
        buf = ipc.allocate((L, 2, H, len(tokens), D), torch.bfloat16, a.device)
        try:
            for i in range(a.starts):
                for mode in (("cold", "warm") if i % 2 == 0 else ("warm", "cold")):
                    r = one_round(a, mode, Path(d), tokens, buf)
                    res["rounds"].append(r)
                    print(json.dumps(r), flush=True)
        finally:
            buf.close()


if __name__ == "__main__":
    main()
