"""under_load: the ``load`` phase of the vLLM TTFT benchmark: a stream of requests at a fixed
arrival rate, most of them a long shared prefix (stored beforehand) plus a fresh suffix, each
decoding ``output`` tokens, so that prefills arrive beside ongoing decodes.

The same stream runs three times through one ``AsyncLLM`` (vLLM's prefix cache off, so every
reuse is kvfetcher's), in the order of :data:`PASSES`: ``recompute`` (no cached KV read),
``kvfetcher-nosave`` (lookups and loads as deployed, no save) and ``kvfetcher`` (as deployed,
saves on); the last two take the cost model's choice at the link ``--load-link`` Gbit/s among the
stored presets (``--methods``; default all), fed the prefill rate the passes before taught the
connector. The passes share arrivals and stored prefixes; their fresh tokens differ (else a pass
would load what one before saved). ``recompute`` requests (``skip_reading_prefix_cache``) pass the
connector by: no lookup, no load, no save (vLLM alone but for the connector's per-step hooks).
``kvfetcher-nosave`` requests say ``"store": false`` in their ``kv_transfer_params`` (one engine
cannot change its ``kv_role`` between passes; a second engine would start without the prefill
model the first pass taught it): against ``recompute`` the lookups' and loads' cost, against
``kvfetcher`` the saves'. It runs before ``kvfetcher``, so no pass without saves follows the
sidecar's uploads. ``kvfetcher``'s prefills' new chunks go to the sidecar, which writes them
(``raw``) through the link server (on a GPU the server counts the uploads without keeping their
bytes: tens of GB). Reported per pass: TTFT p50 / p99 (all requests, and those with a stored
prefix), output tokens/s over the stream, the tokens loaded, and the sidecar's side (lookups,
listing seconds, loads, chunks stored, uploads, drops).

Then the lookup's own cost (:func:`lookup_cost`): the scheduler's call (``KVClient.lookup``, as
the connector's ``get_num_new_matched_tokens`` makes it) timed from a client against the running
sidecar, for 8K- and 128K-token prompts, stored and not, ``--lookup-reps`` times each: p50/p99.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path

from benchmarks.vllm_ttft.engine import (GBIT, Probe, connector, delivered_gbit, kv_dtype, methods, metric, on_gpu, phase_left, presets_of, read_metrics, s3_sidecar,
                                         shape_of, timing_model, warm_index, watchdog)

# the workload: prompt = one of `prefixes` stored prefixes of `prefix` tokens (a `shared` share of the
# requests; the others a fresh prompt as long) + `suffix` fresh tokens; `output` tokens decoded each
WORKLOAD = {
    False: dict(prefixes=8, prefix=16384, suffix=512, shared=0.8, output=128, rate=1.0, requests=48, link=25.0),
    True: dict(prefixes=3, prefix=768, suffix=64, shared=0.8, output=16, rate=0.3, requests=10, link=1.0),
}

#: the passes in their order: each one's ``kv_transfer_params`` (None: ``skip_reading_prefix_cache``) and the seed of its fresh tokens
PASSES = {"recompute": (None, 4), "kvfetcher-nosave": ({"store": False}, 6), "kvfetcher": ({}, 5)}
FORCED, FORCED_SEED = "forced-", 8  # a forced pass's name prefix (``--load-force``) and the seed of its fresh tokens


def passes(force: str | None) -> dict[str, tuple[dict | None, int]]:
    """:data:`PASSES`, with ``forced-<preset>`` second (right after ``recompute``, the first pass a
    short phase skips) where ``force`` names a preset: every request loads its stored prefix in it
    whatever the cost, saving nothing (what ``auto``'s choice is held to under load)."""
    if not force:
        return dict(PASSES)
    if not (params := methods(force)[force]):
        raise ValueError(f"--load-force takes a stored preset, not {force!r}")
    forced = {"store": False, **params}
    first, *rest = PASSES.items()
    return dict([first, (FORCED + force, (forced, FORCED_SEED)), *rest])


def add_args(ap) -> None:
    ap.add_argument("--rate", type=float, help="load phase: requests/s (default 1; --tiny 0.3)")
    ap.add_argument("--requests", type=int, help="load phase: requests in the stream (default 48; --tiny 10)")
    ap.add_argument("--load-link", type=float, help="load phase: Gbit/s of the link to the store (default 25; --tiny 1)")
    ap.add_argument("--lookup-reps", type=int, default=50, help="load phase: lookups timed per prompt (8K and 128K tokens, stored and not)")
    ap.add_argument("--load-force", metavar="PRESET", help="load phase: add a pass forcing this stored preset (no saves): what auto is held to")
    ap.add_argument("--keep-puts", action="store_true", help="load phase: keep the uploaded bytes (default on a GPU: counted, not kept)")


def stream(rng: random.Random, prefixes: list[list[int]], w: dict, vocab: int, fresh_rng: random.Random | None = None
           ) -> list[tuple[float, list[int], bool]]:
    """(arrival s, prompt, has a stored prefix) of each request, arriving every 1/rate s. The
    fresh tokens come from ``fresh_rng`` (default ``rng``): two streams of one ``rng`` seed and
    different ``fresh_rng`` share arrivals and prefixes, not one fresh token."""
    fr = fresh_rng or rng
    fresh = lambda n: [fr.randrange(100, vocab - 1) for _ in range(n)]  # noqa: E731
    out = []
    for i in range(w["requests"]):
        shared = rng.random() < w["shared"]
        head = rng.choice(prefixes) if shared else fresh(w["prefix"])
        out.append((i / w["rate"], head + fresh(w["suffix"]), shared))
    return out


async def one(engine, rid: str, at: float, prompt: list[int], params: dict | None, output: int) -> dict:
    """One request arriving ``at`` (perf_counter time): its TTFT, tokens and cached tokens, and, where
    vLLM keeps its stats, the engine's split of it: ``queued_s`` from the request's arrival in the
    scheduler to its first scheduling (a lookup that put it off a step shows here), ``scheduled_s``
    from then to its first token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    sp = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True, skip_reading_prefix_cache=params is None,
                        extra_args={"kv_transfer_params": params} if params else None)
    t0, first, last = time.perf_counter(), None, None
    async for o in engine.generate(TokensPrompt(prompt_token_ids=prompt), sp, rid):
        first = first or time.perf_counter()
        last = o
    st = getattr(last, "metrics", None)
    split = dict(queued_s=st.scheduled_ts - st.queued_ts, scheduled_s=st.first_token_ts - st.scheduled_ts) \
        if getattr(st, "scheduled_ts", 0) and getattr(st, "first_token_ts", 0) else {}
    return dict(ttft_s=first - t0, end=time.perf_counter(), tokens=len(last.outputs[0].token_ids), cached=last.num_cached_tokens or 0, **split)


def summary(reqs: list[tuple[float, list[int], bool]], got: list[dict], t0: float) -> dict:
    def pct(xs, q):
        return round(statistics.quantiles(xs, n=100, method="inclusive")[q - 1], 4) if len(xs) > 1 else round(xs[0], 4)

    ttft = [g["ttft_s"] for g in got]
    shared = [g["ttft_s"] for g, r in zip(got, reqs) if r[2]]
    return {"ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "shared_ttft_p50_s": pct(shared, 50) if shared else None,
            "shared_ttft_p99_s": pct(shared, 99) if shared else None,
            "output_tokens_per_s": round(sum(g["tokens"] for g in got) / (max(g["end"] for g in got) - t0), 2),
            "loaded_tokens": sum(g["cached"] for g in got), "requests": len(got), "ttft_s": [round(x, 4) for x in ttft],
            **{k: [round(g[k], 4) for g in got] for k in ("queued_s", "scheduled_s") if all(k in g for g in got)}}


def start_engine(a, model_dir: Path, opts: dict, w: dict, kv_transfer_config: dict):
    """An ``AsyncLLM`` for the workload ``w`` with ``kv_transfer_config``'s connector, vLLM's prefix
    cache off (every reuse is the connector's); bf16 on a GPU, fp32 on a CPU."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    dtype = dict(dtype="bfloat16", gpu_memory_utilization=0.85) if on_gpu() else dict(dtype="float32")
    args = AsyncEngineArgs(model=str(model_dir), enforce_eager=True, max_model_len=w["prefix"] + w["suffix"] + w["output"] + 16,
                           enable_prefix_caching=False, kv_transfer_config=kv_transfer_config, **dtype, **opts)
    with watchdog(a.start_timeout_s, "engine start"):
        return AsyncLLM.from_engine_args(args)


async def replay(a, model_dir: Path, opts: dict, sc, url: str, fingerprint: str, streams: dict, w: dict) -> dict:
    engine = start_engine(a, model_dir, opts, w, connector(sc.socket, fingerprint))
    res = {}
    client = sc.client()
    try:
        for method, (params, _) in passes(a.load_force).items():
            reqs, stream_s = streams[method], w["requests"] / w["rate"]
            if phase_left() < stream_s + 60:  # a pass killed midway would lose the passes before it: none is started
                res[method] = {"skipped": "not run: the phase's time ran out"}
                print(f"under load, {method}: {res[method]['skipped']}", flush=True)
                continue
            probe = Probe(client, url)
            with watchdog(stream_s + 3 * a.call_timeout_s, f"the {method} stream"):
                t0 = time.perf_counter() + 0.5
                got = await asyncio.gather(*(one(engine, f"{method}-{i}", t0 + at, p, params, w["output"])
                                             for i, (at, p, _) in enumerate(reqs)))
            await asyncio.to_thread(client.flush)  # the stream's saves written (or dropped): counted in this pass
            d = probe.delta()
            res[method] = dict(summary(reqs, got, t0), sidecar=d,
                               delivered_gbit=delivered_gbit(d["link_bytes_sent"], d["read_s"]))
            print(f"under load, {method:>16}: {res[method]}", flush=True)
    finally:
        client.close()
        engine.shutdown()
    return res


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def lookup_cost(sc, ns, stored: list[int], vocab: int, reps: int, budget_s: float = 40.0) -> dict:
    """The scheduler's call, timed (:func:`scheduler_call`), for prompts of 8K and 128K tokens, the
    stored ``stored`` prefix's and fresh ones, each after one lookup that warmed the sidecar's
    index, ``reps`` times each (fewer past ``budget_s`` a prompt): p50 / p99 / max ms of the
    client's call, the sidecar's own answer time (mean) and the store listings they caused."""
    rng = random.Random(5)
    client = sc.client()
    look = dict(model=ns.model, dtype=ns.dtype, kv_shape=ns.shape)
    rows, call = [], None
    try:
        cases = [(n, is_stored) for n in (8192, 131072) for is_stored in (True, False)]
        for i, (n, is_stored) in enumerate(cases):
            prompt = stored[:n] if is_stored else [rng.randrange(100, vocab - 1) for _ in range(n)]
            have = warm_index(client, prompt, **look)
            scheduler_call(client, prompt, look)  # untimed: the connection, the sidecar's first answer
            # within this phase's time: what is left (less the JSON's writing) shared by the cases left
            budget = max(2.0, min(budget_s, (phase_left() - 30) / (len(cases) - i)))
            m0, times, t_end = read_metrics(client), [], time.perf_counter() + budget
            for _ in range(reps):
                t = time.perf_counter()
                call = scheduler_call(client, prompt, look)
                times.append(time.perf_counter() - t)
                if time.perf_counter() > t_end:
                    break
            m1 = read_metrics(client)
            d = lambda name: metric(m1, name) - metric(m0, name)  # noqa: E731
            rows.append({"tokens": n, "stored_tokens": have, "reps": len(times), "p50_ms": round(pct(times, 50) * 1e3, 3),
                         "p99_ms": round(pct(times, 99) * 1e3, 3), "max_ms": round(max(times) * 1e3, 3),
                         "sidecar_answer_ms_mean": round(d("kvfetcher_lookup_seconds_sum") / len(times) * 1e3, 3),
                         "store_listings": int(d("kvfetcher_listing_seconds_count"))})
            print(f"lookup of {n} tokens ({have} stored): p50 {rows[-1]['p50_ms']} ms, p99 {rows[-1]['p99_ms']} ms "
                  f"over {len(times)}", flush=True)
    finally:
        client.close()
    return {"reps": reps, "call": call, "rows": rows}


def scheduler_call(client, tokens: list[int], look: dict) -> str:
    """The connector scheduler's question for ``tokens``, as it asks it (answered from the sidecar's
    index, waiting at most ``listing_wait_s`` for a background listing): which call was made."""
    from kvfetcher.fetch.plan import FetchOptions
    from kvfetcher.integrations.vllm_meta import Options

    client.lookup(None, tokens, FetchOptions(wait_s=Options.listing_wait_s), **look)
    return f"KVClient.lookup(None, tokens, FetchOptions(wait_s={Options.listing_wait_s}), model, dtype, kv_shape)"


def workload(a, vocab: int) -> tuple[dict, list[list[int]], dict[str, list[tuple[float, list[int], bool]]]]:
    """The phase's workload (:data:`WORKLOAD`, with the arguments' rate, requests and link), its
    stored prefixes and each pass's stream (:func:`passes`): the same for every engine measured."""
    w = dict(WORKLOAD[a.tiny])
    w.update({k: v for k, v in (("rate", a.rate), ("requests", a.requests), ("link", a.load_link)) if v is not None})
    rng = random.Random(2)
    prefixes = [[rng.randrange(100, vocab - 1) for _ in range(w["prefix"])] for _ in range(w["prefixes"])]
    return w, prefixes, {m: stream(random.Random(3), prefixes, w, vocab, random.Random(seed)) for m, (_, seed) in passes(a.load_force).items()}


def phase_load(a, work: Path) -> dict:
    from benchmarks.lib import fetchkit, linkserver
    from kvfetcher import keys

    presets = presets_of(methods(a.methods))  # what auto may choose among
    if a.load_force and a.load_force not in presets:
        raise ValueError(f"--load-force {a.load_force}: not among the presets stored ({', '.join(presets)})")
    model_dir, opts = timing_model(a.tiny, work)
    shape = shape_of(model_dir)
    w, prefixes, streams = workload(a, shape.vocab)
    long_prefix = [random.Random(7).randrange(100, shape.vocab - 1) for _ in range(131072)]  # the lookup cost's stored 128K prompt
    ns = keys.Namespace(model=fetchkit.FINGERPRINT, dtype=kv_dtype(), shape=(shape.layers, shape.kv_heads, shape.head_dim))
    discard = on_gpu() and not a.keep_puts
    with s3_sidecar(work, "load", prefixes + [long_prefix], ns, shape, a.workers, link_procs=a.link_procs, writes="raw",
                    discard_puts=discard, presets=presets) as (sc, url, size):
        client = sc.client()
        for p in prefixes:  # the node has seen the shared prefixes (untimed)
            warm_index(client, p, model=ns.model, dtype=ns.dtype, kv_shape=ns.shape)
        client.close()
        linkserver.set_rate(url, w["link"] * GBIT)
        res = asyncio.run(replay(a, model_dir, opts, sc, url, ns.model, streams, w))
        res["lookup_cost"] = lookup_cost(sc, ns, long_prefix, shape.vocab, a.lookup_reps)
    return {"model": model_dir.name, "kv_dtype": ns.dtype, "workload": w, "object_bytes_per_chunk": size, "stored_presets": presets,
            "writes": "raw", "discard_puts": discard, **res}
