"""peers_load: the ``load`` phase's workload through a peer's connector, to set beside kvfetcher's.

Phase ``peer-load-<method>`` (:data:`PEERS_UNDER_LOAD`): the ``load`` phase's arrivals, stored
prefixes and fresh tokens (:func:`under_load.workload`; the stream of its deployed ``kvfetcher``
pass) through an ``AsyncLLM`` whose connector is the peer's, vLLM's prefix cache off as there, so
every reuse is the connector's. LMCache's remote sits behind the same paced link as in the ``peer-``
phases (:func:`peers.lmcache_remote`); vLLM's CPU tier (``native-cpu``) reads this machine's host
memory, no link: the local bound. First each shared prefix is sent once (at full speed), so that
the peer stores it (untimed; bytes stored per token from the uploads, or the CPU tier's
uncompressed copy), then the link is set to the workload's rate and the stream runs as deployed:
the peer looks up, loads what it holds whatever the link, and saves the fresh tokens. Reported as
the ``load`` phase reports a pass (TTFT p50 / p99, those with a stored prefix, output tokens/s,
tokens loaded), with the bytes the link sent during the stream. Its recompute reference is the
``load`` phase's ``recompute`` pass: same vLLM, workload and link server, in the same run.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from benchmarks.vllm_ttft import peers, under_load
from benchmarks.vllm_ttft.engine import GBIT, delivered_gbit, kv_dtype, phase_left, shape_of, timing_model, watchdog

PEERS_UNDER_LOAD = ("native-cpu", "lmcache-raw", "lmcache-cachegen")  # phase peer-load-<name>
CPU_TIER_MARGIN = 1.25  # the CPU tier holds every distinct token of the run, with this margin
STREAM = "kvfetcher"  # the load phase's pass whose stream a peer replays: its deployed one


def phase_peer_load(a, work: Path) -> dict:
    """One peer (``a.phase`` = ``peer-load-<method>``) under the ``load`` phase's workload."""
    method = a.phase.removeprefix("peer-load-")
    if method not in PEERS_UNDER_LOAD:
        raise ValueError(f"not a peer under load: {method!r} (one of {', '.join(PEERS_UNDER_LOAD)})")
    res = {"method": method}
    if why := peers.missing(method):
        print(f"{method} under load: {why}", flush=True)
        return dict(res, unavailable=why)
    model_dir, opts = timing_model(a.tiny, work)
    shape = shape_of(model_dir)
    w, prefixes, streams = under_load.workload(a, shape.vocab)
    res.update(model=model_dir.name, kv_dtype=kv_dtype(), workload=w)
    reqs = streams[STREAM]
    if method == "native-cpu":
        per_token = peers.kv_bytes_per_token(shape, kv_dtype())
        cpu_bytes = cpu_tier_bytes(prefixes, reqs, w, per_token)
        res.update(link="host memory of this machine, no link: the local bound", cpu_bytes_to_use=cpu_bytes)
        res.update(asyncio.run(replay(a, model_dir, opts, peers.offloading_config(cpu_bytes), None, prefixes, reqs, w, per_token)))
        return res
    res["link"] = peers.LINK[peers.REMOTE[method]]
    with peers.lmcache_remote(method, a, work) as link:
        res.update(asyncio.run(replay(a, model_dir, opts, peers.lmcache_connector(), link, prefixes, reqs, w)))
    return res


def cpu_tier_bytes(prefixes: list[list[int]], reqs: list[tuple[float, list[int], bool]], w: dict, per_token: int) -> int:
    """Host memory for vLLM's CPU tier to hold every distinct token the run stores (the prefixes,
    then each request less a stored prefix it shares), :data:`CPU_TIER_MARGIN` over: nothing the
    stream reuses is evicted, as nothing is from LMCache's remotes."""
    tokens = sum(map(len, prefixes)) + sum(len(p) - (w["prefix"] if shared else 0) for _, p, shared in reqs)
    return int(CPU_TIER_MARGIN * tokens * per_token)


async def replay(a, model_dir: Path, opts: dict, connector: dict, link, prefixes: list[list[int]], reqs: list[tuple[float, list[int], bool]],
                 w: dict, per_token: int | None = None) -> dict:
    """The prefixes stored through the engine (``link`` unpaced), then the stream ``reqs`` at the
    workload's link: its summary, bytes stored per prefix token and the link's bytes during it.
    ``link`` None (a local tier): stored bytes are ``per_token`` a token, nothing is sent."""
    engine = under_load.start_engine(a, model_dir, opts, w, connector)
    try:
        if link:
            link.set_rate(0)  # stores at full speed: only the stream's loads are paced
            before = link.stats()
        with watchdog(len(prefixes) * a.call_timeout_s, "storing the prefixes"):
            for i, p in enumerate(prefixes):
                await under_load.one(engine, f"store-{i}", time.perf_counter(), p, {}, 1)
            if link:
                stored = (await asyncio.to_thread(peers.wait_uploads, link, a.call_timeout_s))["bytes_received"] - before["bytes_received"]
        out = {"stored_bytes_per_token": round(stored / (len(prefixes) * w["prefix"]), 1) if link else per_token}
        stream_s = w["requests"] / w["rate"]
        if phase_left() < stream_s + 60:
            return dict(out, skipped="not run: the phase's time ran out")
        if link:
            link.set_rate(w["link"] * GBIT)
            sent0 = link.stats()["bytes_sent"]
        with watchdog(stream_s + 3 * a.call_timeout_s, "the stream"):
            t0 = time.perf_counter() + 0.5
            got = await asyncio.gather(*(under_load.one(engine, f"peer-{i}", t0 + at, p, {}, w["output"]) for i, (at, p, _) in enumerate(reqs)))
        out.update(under_load.summary(reqs, got, t0))
        if link:
            sent = link.stats()["bytes_sent"] - sent0
            out.update(link_bytes_sent=sent, delivered_gbit=delivered_gbit(sent, max(g["end"] for g in got) - t0))
        print(f"under load, peer: {out}", flush=True)
        return out
    finally:
        engine.shutdown()
