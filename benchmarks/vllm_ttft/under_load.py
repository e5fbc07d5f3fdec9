"""under_load: the ``load`` phase of the vLLM TTFT benchmark: a stream of requests at a fixed
arrival rate, most of them a long shared prefix (stored beforehand) plus a fresh suffix, each
decoding ``output`` tokens, so that prefills arrive beside ongoing decodes.

The same stream runs twice through one ``AsyncLLM`` (vLLM's prefix cache off, so every reuse is
kvfetcher's): ``recompute`` (no cached KV read) and ``kvfetcher`` (the cost model's choice at the
link ``--load-link`` Gbit/s, fed the prefill rate the recompute pass taught the connector).
Reported per method: TTFT p50 / p99 (all requests, and those with a stored prefix), output
tokens/s over the stream, and the tokens loaded.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path

from benchmarks.vllm_ttft.engine import connector, kv_dtype, on_gpu, s3_sidecar, shape_of, timing_model, watchdog

GBIT = 1.25e8
# the workload: prompt = one of `prefixes` stored prefixes of `prefix` tokens (a `shared` share of the
# requests; the others a fresh prompt as long) + `suffix` fresh tokens; `output` tokens decoded each
WORKLOAD = {
    False: dict(prefixes=8, prefix=16384, suffix=512, shared=0.8, output=128, rate=1.0, requests=48, link=25.0),
    True: dict(prefixes=3, prefix=768, suffix=64, shared=0.8, output=16, rate=0.3, requests=10, link=1.0),
}


def add_args(ap) -> None:
    ap.add_argument("--rate", type=float, help="load phase: requests/s (default 1; --tiny 0.3)")
    ap.add_argument("--requests", type=int, help="load phase: requests in the stream (default 48; --tiny 10)")
    ap.add_argument("--load-link", type=float, help="load phase: Gbit/s of the link to the store (default 25; --tiny 1)")


def stream(rng: random.Random, prefixes: list[list[int]], w: dict, vocab: int) -> list[tuple[float, list[int], bool]]:
    """(arrival s, prompt, has a stored prefix) of each request, arriving every 1/rate s."""
    fresh = lambda n: [rng.randrange(100, vocab - 1) for _ in range(n)]  # noqa: E731
    out = []
    for i in range(w["requests"]):
        shared = rng.random() < w["shared"]
        head = rng.choice(prefixes) if shared else fresh(w["prefix"])
        out.append((i / w["rate"], head + fresh(w["suffix"]), shared))
    return out


async def one(engine, rid: str, at: float, prompt: list[int], params: dict | None, output: int) -> dict:
    """One request arriving ``at`` (perf_counter time): its TTFT, tokens and cached tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    await asyncio.sleep(max(0.0, at - time.perf_counter()))
    sp = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True, skip_reading_prefix_cache=params is None,
                        extra_args={"kv_transfer_params": params} if params else None)
    t0, first, last = time.perf_counter(), None, None
    async for o in engine.generate(TokensPrompt(prompt_token_ids=prompt), sp, rid):
        first = first or time.perf_counter()
        last = o
    return dict(ttft_s=first - t0, end=time.perf_counter(), tokens=len(last.outputs[0].token_ids), cached=last.num_cached_tokens or 0)


def summary(reqs: list[tuple[float, list[int], bool]], got: list[dict], t0: float) -> dict:
    def pct(xs, q):
        return round(statistics.quantiles(xs, n=100, method="inclusive")[q - 1], 4) if len(xs) > 1 else round(xs[0], 4)

    ttft = [g["ttft_s"] for g in got]
    shared = [g["ttft_s"] for g, r in zip(got, reqs) if r[2]]
    return {"ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "shared_ttft_p50_s": pct(shared, 50) if shared else None,
            "shared_ttft_p99_s": pct(shared, 99) if shared else None,
            "output_tokens_per_s": round(sum(g["tokens"] for g in got) / (max(g["end"] for g in got) - t0), 2),
            "loaded_tokens": sum(g["cached"] for g in got), "requests": len(got)}


async def replay(a, model_dir: Path, opts: dict, sc, fingerprint: str, reqs, w: dict) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    dtype = dict(dtype="bfloat16", gpu_memory_utilization=0.85) if on_gpu() else dict(dtype="float32")
    args = AsyncEngineArgs(model=str(model_dir), enforce_eager=True, max_model_len=w["prefix"] + w["suffix"] + w["output"] + 16,
                           enable_prefix_caching=False, kv_transfer_config=connector(sc.socket, fingerprint), **dtype, **opts)
    with watchdog(a.start_timeout_s, "engine start"):
        engine = AsyncLLM.from_engine_args(args)
    res = {}
    try:
        for method, params in (("recompute", None), ("kvfetcher", {})):
            with watchdog(w["requests"] / w["rate"] + 3 * a.call_timeout_s, f"the {method} stream"):
                t0 = time.perf_counter() + 0.5
                got = await asyncio.gather(*(one(engine, f"{method}-{i}", t0 + at, p, params, w["output"])
                                             for i, (at, p, _) in enumerate(reqs)))
            res[method] = summary(reqs, got, t0)
            print(f"under load, {method:>9}: {res[method]}", flush=True)
    finally:
        engine.shutdown()
    return res


def phase_load(a, work: Path) -> dict:
    from benchmarks.lib import fetchkit, linkserver
    from kvfetcher import keys

    w = dict(WORKLOAD[a.tiny])
    w.update({k: v for k, v in (("rate", a.rate), ("requests", a.requests), ("link", a.load_link)) if v is not None})
    model_dir, opts = timing_model(a.tiny, work)
    shape = shape_of(model_dir)
    rng = random.Random(2)
    prefixes = [[rng.randrange(100, shape.vocab - 1) for _ in range(w["prefix"])] for _ in range(w["prefixes"])]
    reqs = stream(rng, prefixes, w, shape.vocab)
    ns = keys.Namespace(model=fetchkit.FINGERPRINT, dtype=kv_dtype(), shape=(shape.layers, shape.kv_heads, shape.head_dim))
    with s3_sidecar(work, "load", prefixes, ns, shape, a.workers) as (sc, url, size):
        linkserver.set_rate(url, w["link"] * GBIT)
        res = asyncio.run(replay(a, model_dir, opts, sc, ns.model, reqs, w))
    return {"model": model_dir.name, "kv_dtype": ns.dtype, "workload": w, "object_bytes_per_chunk": size, **res}
