"""interference: the ``interference`` phase of the vLLM TTFT benchmark: what a load (or a
recompute) of a long stored prefix does to the requests decoding beside it in the same engine.

One ``AsyncLLM`` with the kvfetcher connector (vLLM's prefix cache off, so every hit is
kvfetcher's), one paced link (``--interference-link``). A sample: ``streams`` requests decode
(``skip_reading_prefix_cache``: they pass the connector by) until every one has ``warm`` tokens;
then one request of the stored ``prefix`` tokens plus ``suffix`` fresh ones arrives, in one
``path``:

* ``baseline``: no request; the window is ``base_window_s`` from the same point;
* ``recompute``: the engine prefills the prompt (no cached KV read);
* each stored preset forced (``raw``: copy and scatter; ``-ans``: nvCOMP on the SMs; ``balanced``:
  NVDEC on a GPU, its CPU decoder here), with a TTFT budget no load exceeds;
* ``auto``: the cost model's choice.

``--methods`` narrows the paths but ``baseline``, and only the presets it forces are stored.

The window of a request is its arrival to its first token. The decoding streams' inter-token
times (TPOT) that overlap the window (:func:`window_gaps`) give the sample's p50 / p99 / mean /
max; each path runs ``--repeats`` times (interleaved: one of each path per round) and reports the
medians over its samples, and the ratio of those to the baseline's (:func:`summarise`). The
streams are cancelled once every one has a token past the window, so a long window costs only
itself.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path

from benchmarks.vllm_ttft.engine import (CHUNK, GBIT, Probe, breakdown, connector, kv_dtype, methods, on_gpu, phase_left, presets_of, read_metrics,
                                         s3_sidecar, shape_of, timing_model, warm_index, watchdog)

TARGET_P50 = 1.05  # the target: a load may slow the decodes beside it by 5% at p50 at most
SHADOWSERVE = 2.2  # ShadowServe: decompression on the GPU slows decoding by up to 2.2x
# streams decoding `stream_prompt`-token prompts (at most `stream_max` tokens: cancelled long before),
# each with `warm` tokens before the request arrives; the request: a stored `prefix` + `suffix` fresh tokens
WORKLOAD = {
    False: dict(streams=8, stream_prompt=512, stream_max=4096, warm=16, prefix=32768, suffix=16, base_window_s=2.0, link=100.0),
    True: dict(streams=2, stream_prompt=64, stream_max=1024, warm=8, prefix=768, suffix=16, base_window_s=2.0, link=1.0),
}


def add_args(ap) -> None:
    ap.add_argument("--interference-streams", type=int, help="interference phase: decoding streams (default 8; --tiny 2)")
    ap.add_argument("--interference-prefix", type=int, help="interference phase: stored prefix tokens loaded (default 32768; --tiny 768)")
    ap.add_argument("--interference-link", type=float, help="interference phase: Gbit/s of the link to the store (default 100; --tiny 1)")


def workload(a) -> dict:
    """The phase's workload: :data:`WORKLOAD` for ``a.tiny``, with the command line's overrides
    (the prefix rounded down to whole chunks)."""
    w = dict(WORKLOAD[a.tiny])
    for k, v in (("streams", a.interference_streams), ("prefix", a.interference_prefix), ("link", a.interference_link)):
        if v is not None:
            w[k] = v
    w["prefix"] = w["prefix"] // CHUNK * CHUNK
    if w["prefix"] <= 0 or w["streams"] <= 0:
        raise ValueError(f"the interference phase needs a prefix of at least one chunk and a stream: {w}")
    return w


def paths(only: str | None = None) -> dict[str, dict | None | bool]:
    """Each path's ``kv_transfer_params``: ``baseline`` False (no request), then the methods
    (``only``: those named, as ``--methods`` says): ``recompute`` None (no cached KV read), every
    stored preset forced, ``auto`` {} (the cost model)."""
    return {"baseline": False, **methods(only)}


# --- the pure part: inter-token times in a window, and their summary -----------------------------


def token_gaps(stamps: list[tuple[float, int]]) -> list[tuple[float, float, float]]:
    """A stream's inter-token intervals from its outputs' (arrival time, tokens so far), in order:
    (start, end, seconds per token) per output after the first; an output that brought k > 1
    tokens (the consumer lagged one engine step) gives one interval of (end - start) / k a token,
    counted k times by :func:`window_gaps`. Outputs that brought no token are skipped."""
    out = []
    prev = None
    for t, n in stamps:
        if prev is not None and n > prev[1]:
            out.append((prev[0], t, (t - prev[0]) / (n - prev[1]), n - prev[1]))
        if prev is None or n > prev[1]:
            prev = (t, n)
    return [(s, e, g) for s, e, g, k in out for _ in range(k)]


def window_gaps(streams: list[list[tuple[float, int]]], start: float, end: float) -> list[float]:
    """The per-token inter-token seconds of every stream whose interval overlaps the window
    (``start``, ``end``): one that began before the request arrived and one that spans its first
    token (a decode stalled by the request) both count."""
    return [g for st in streams for s, e, g in token_gaps(st) if e > start and s < end]


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def gap_stats(gaps: list[float]) -> dict:
    """p50 / p99 / mean / max of inter-token seconds, in ms (None each without a gap), and their count."""
    if not gaps:
        return {"tpot_p50_ms": None, "tpot_p99_ms": None, "tpot_mean_ms": None, "tpot_max_ms": None, "gaps": 0}
    ms = lambda x: round(x * 1e3, 3)  # noqa: E731
    return {"tpot_p50_ms": ms(pct(gaps, 50)), "tpot_p99_ms": ms(pct(gaps, 99)), "tpot_mean_ms": ms(statistics.fmean(gaps)),
            "tpot_max_ms": ms(max(gaps)), "gaps": len(gaps)}


STATS = ("tpot_p50_ms", "tpot_p99_ms", "tpot_mean_ms", "tpot_max_ms", "ttft_s", "window_s")


def summarise(samples: list[dict]) -> dict[str, dict]:
    """Per path (in first-seen order): the median over its samples of each of :data:`STATS` a
    sample has (None where none has it), the samples' count, the tokens loaded and the sidecar's
    choices (:func:`decisions`) per sample, and each
    TPOT statistic over the baseline's median (``*_x``; None without a baseline). ``p50_within_target``:
    the p50 ratio is at most :data:`TARGET_P50`."""
    by: dict[str, list[dict]] = {}
    for s in samples:
        by.setdefault(s["path"], []).append(s)
    med = {p: {k: _median([s.get(k) for s in ss]) for k in STATS} for p, ss in by.items()}
    base = med.get("baseline", {})
    out = {}
    for p, ss in by.items():
        r = dict(med[p], samples=len(ss), loaded_tokens=[s.get("loaded_tokens") for s in ss], chose=[s.get("chose") for s in ss])
        for k in ("tpot_p50_ms", "tpot_p99_ms", "tpot_mean_ms", "tpot_max_ms"):
            r[k[:-3] + "_x"] = round(r[k] / base[k], 3) if r[k] is not None and base.get(k) else None
        r["p50_within_target"] = None if r["tpot_p50_x"] is None else r["tpot_p50_x"] <= TARGET_P50
        out[p] = r
    return out


def decisions(m0: dict[str, float], m1: dict[str, float]) -> list[str]:
    """The sidecar's fetch-time choices between two metric readings (``kvfetcher_preset_decisions_total``
    by preset: a preset or ``recompute``), each as often as it was made, sorted."""
    name = "kvfetcher_preset_decisions_total{"
    out = []
    for k, v in m1.items():
        if k.startswith(name) and 'preset="' in k:
            out += [k.split('preset="', 1)[1].split('"', 1)[0]] * int(v - m0.get(k, 0.0))
    return sorted(out)


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 4) if xs else None


# --- the engine side ------------------------------------------------------------------------------


async def decode(engine, rid: str, prompt: list[int], max_tokens: int, stamps: list) -> None:
    """One decoding stream (no cached KV read): appends (time, tokens so far) per output to ``stamps``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, skip_reading_prefix_cache=True)
    async for o in engine.generate(TokensPrompt(prompt_token_ids=prompt), sp, rid):
        stamps.append((time.perf_counter(), len(o.outputs[0].token_ids)))


async def first_token(engine, rid: str, prompt: list[int], params: dict | None) -> tuple[float, float, int]:
    """One request of one output token: (arrival, first token time, vLLM's num_cached_tokens).
    ``params``: its ``kv_transfer_params``; None: a recompute."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, skip_reading_prefix_cache=params is None,
                        extra_args={"kv_transfer_params": params} if params else None)
    t0, first, cached = time.perf_counter(), None, 0
    async for o in engine.generate(TokensPrompt(prompt_token_ids=prompt), sp, rid):
        first = first or time.perf_counter()
        cached = o.num_cached_tokens or 0
    return t0, first, cached


async def until(cond, timeout_s: float, what: str) -> None:
    """Poll ``cond`` every 5 ms; ``TimeoutError`` naming ``what`` past ``timeout_s``."""
    end = time.perf_counter() + timeout_s
    while not cond():
        if time.perf_counter() > end:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        await asyncio.sleep(0.005)


async def sample(engine, tag: str, path: str, params, prompt: list[int], stream_prompts: list[list[int]], w: dict, timeout_s: float) -> dict:
    """One sample: the streams decode to ``warm`` tokens, the path's request arrives (none for the
    baseline), the window closes at its first token, the streams run until each has a token past it
    and are cancelled. Returns the window's TPOT statistics (:func:`gap_stats`), its TTFT and loaded tokens."""
    stamps: list[list] = [[] for _ in stream_prompts]
    tasks = [asyncio.create_task(decode(engine, f"{tag}-s{i}", p, w["stream_max"], stamps[i])) for i, p in enumerate(stream_prompts)]
    try:
        await until(lambda: all(s and s[-1][1] >= w["warm"] for s in stamps), timeout_s, "the streams' first tokens")
        if params is False:
            start = time.perf_counter()
            await asyncio.sleep(w["base_window_s"])
            end, cached = time.perf_counter(), None
        else:
            start, end, cached = await first_token(engine, f"{tag}-req", prompt, params)
        await until(lambda: all(s[-1][0] > end or s[-1][1] >= w["stream_max"] for s in stamps), timeout_s, "a stream's token past the window")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    ended = sum(1 for s in stamps if s[-1][1] >= w["stream_max"] and s[-1][0] <= end)
    return dict(path=path, window_s=round(end - start, 4), ttft_s=None if params is False else round(end - start, 4), loaded_tokens=cached,
                streams_ended_in_window=ended, **gap_stats(window_gaps(stamps, start, end)))


async def probed(engine, client, url: str, look: dict, path: str, params, prompt: list[int], streams: list[list[int]], w: dict, rep: int,
                 timeout_s: float) -> dict:
    """One timed :func:`sample` of round ``rep``, the node having seen the prefix (an untimed refresh
    first), with what the sidecar reports of it: the request's TTFT breakdown (as in ``ttft``) and
    the sidecar's choices (:func:`decisions`; none for the baseline)."""
    await asyncio.to_thread(warm_index, client, prompt[:w["prefix"]], **look)
    probe = await asyncio.to_thread(Probe, client, url)
    s = await sample(engine, f"{path}-{rep}", path, params, prompt, streams, w, timeout_s)
    d = await asyncio.to_thread(probe.delta)
    if s["ttft_s"] is not None:
        s["breakdown"] = breakdown(s["ttft_s"], d)
        s["chose"] = decisions(probe.m0, await asyncio.to_thread(read_metrics, client))
    return dict(s, round=rep)


async def measure(a, model_dir: Path, opts: dict, sc, url: str, look: dict, prompt: list[int], w: dict) -> dict:
    """The engine, a warm-up of every path, then ``a.repeats`` rounds of one sample per path (fewer
    when the phase's time runs short): {"samples": [...], "max_num_batched_tokens": ..., "stopped_early": ...}.
    ``look``: the stored prefix's namespace (model, dtype, kv_shape) for the sidecar's lookups."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    rng = random.Random(7)
    streams = [[rng.randrange(100, 30000) for _ in range(w["stream_prompt"])] for _ in range(w["streams"])]
    dtype = dict(dtype="bfloat16", gpu_memory_utilization=0.85) if on_gpu() else dict(dtype="float32")
    args = AsyncEngineArgs(model=str(model_dir), enforce_eager=True, enable_prefix_caching=False,
                           max_model_len=max(len(prompt), w["stream_prompt"] + w["stream_max"]) + 16,
                           kv_transfer_config=connector(sc.socket, look["model"]), **dtype, **opts)
    with watchdog(a.start_timeout_s, "engine start"):
        engine = AsyncLLM.from_engine_args(args)
    client, samples = sc.client(), []
    try:
        with watchdog(a.call_timeout_s * (len(paths(a.methods)) + 1), "the warm-up"):
            for path, params in paths(a.methods).items():  # kernels, decoders, the prefill rate auto is fed, the index
                await asyncio.to_thread(warm_index, client, prompt[:w["prefix"]], **look)
                await sample(engine, f"warm-{path}", path, params, prompt, streams, dict(w, base_window_s=0.2), a.call_timeout_s)
        for rep in range(a.repeats):
            for path, params in paths(a.methods).items():
                if phase_left() < 60:
                    print(f"interference: the phase's time ran short; stopped before round {rep} {path}", flush=True)
                    return {"samples": samples, "max_num_batched_tokens": _batched(engine), "stopped_early": True}
                with watchdog(3 * a.call_timeout_s, f"interference {path} round {rep}"):
                    s = await probed(engine, client, url, look, path, params, prompt, streams, w, rep, a.call_timeout_s)
                samples.append(s)
                print(f"interference round {rep} {path:>12}: window {s['window_s']:.3f} s, loaded {s['loaded_tokens']}, TPOT p50 "
                      f"{s['tpot_p50_ms']} ms p99 {s['tpot_p99_ms']} ms max {s['tpot_max_ms']} ms over {s['gaps']} gaps", flush=True)
        return {"samples": samples, "max_num_batched_tokens": _batched(engine), "stopped_early": False}
    finally:
        client.close()
        engine.shutdown()


def _batched(engine) -> int | None:
    """vLLM's token budget per step (the size of a recompute's prefill chunks beside the decodes)."""
    try:
        return engine.vllm_config.scheduler_config.max_num_batched_tokens
    except AttributeError:
        return None


def phase_interference(a, work: Path) -> dict:
    from benchmarks.lib import fetchkit, linkserver
    from kvfetcher import keys

    w = workload(a)
    model_dir, opts = timing_model(a.tiny, work)
    shape = shape_of(model_dir)
    rng = random.Random(11)
    prompt = [rng.randrange(100, shape.vocab - 1) for _ in range(w["prefix"] + w["suffix"])]
    ns = keys.Namespace(model=fetchkit.FINGERPRINT, dtype=kv_dtype(), shape=(shape.layers, shape.kv_heads, shape.head_dim))
    with s3_sidecar(work, "interference", [prompt[:w["prefix"]]], ns, shape, a.workers, link_procs=a.link_procs,
                    discard_puts=on_gpu(), presets=presets_of(methods(a.methods))) as (sc, url, size):
        linkserver.set_rate(url, w["link"] * GBIT)
        res = asyncio.run(measure(a, model_dir, opts, sc, url, dict(model=ns.model, dtype=ns.dtype, kv_shape=ns.shape), prompt, w))
    return {"model": model_dir.name, "kv_dtype": ns.dtype, "workload": w, "chunk_tokens": CHUNK, "object_bytes_per_chunk": size,
            "repeats": a.repeats, "target_p50_x": TARGET_P50, "shadowserve_x": SHADOWSERVE, **res, "paths": summarise(res["samples"])}
