"""engine: what the vLLM TTFT phases share: the connector's config, an engine under a watchdog, a
timed batch, and the runner that gives each phase a process of its own and a time limit.

A phase is one process (vLLM gives no GPU back within one). Every engine call in it runs under
:func:`watchdog`: past its limit the process prints every thread's stack and exits, so a hang
reports an error and the next phase still runs; :func:`run_phases` kills whatever the phase left
(vLLM's engine core, the sidecar) and stops starting phases before its own deadline.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.lib.cpuload import busy_cores, cpu_jiffies
from kvfetcher.eval.costmodel import ModelShape

GBIT = 1.25e8  # bytes/s of 1 Gbit/s
FORCE = 1e6  # a TTFT budget no load exceeds: the preset named is loaded whatever the cost model says
#: the sidecars' chunk tokens (``KVFETCHER_CHUNK_TOKENS`` as the run's environment gives it, else 256): a
#: whole number of vLLM blocks on a GPU (16) and a CPU (128)
CHUNK = int(os.environ.get("KVFETCHER_CHUNK_TOKENS") or 256)
LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}
LLAMA3_70B_CONFIG = dict(LLAMA3_8B_CONFIG, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
TIMING_MODELS = {"llama3-8b": LLAMA3_8B_CONFIG, "llama3-70b": LLAMA3_70B_CONFIG}  # random weights (load_format="dummy")
# --tiny at tensor parallelism: SmolLM2's 3 KV heads split over 1 or 3 ranks only; this splits over 2 or 4
TINY_TP_CONFIG = dict(LLAMA3_8B_CONFIG, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=4096, torch_dtype="float32",
                      bos_token_id=1, eos_token_id=2)


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def spawn_workers() -> None:
    """Every engine this benchmark starts makes its processes by spawn: a phase whose process
    touched CUDA before (encoding ``-ans`` chunks, ``on_gpu``) cannot fork them ("Cannot
    re-initialize CUDA in forked subprocess")."""
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"


def connector(socket: str, model: str) -> dict:
    """vLLM's ``kv_transfer_config`` of the kvfetcher connector; ``VLLM_TTFT_CONNECTOR_OPTIONS`` (a JSON
    object, e.g. ``{"idle_step_wait_s": 0}``) adds connector options for a run."""
    extra = {"socket": socket, "model": model, **json.loads(os.environ.get("VLLM_TTFT_CONNECTOR_OPTIONS") or "{}")}
    return {"kv_connector": "KVFetcherConnector", "kv_connector_module_path": "kvfetcher.integrations.vllm", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


#: seconds a benchmark's own call to a sidecar (not the engine's) may take before the phase ends with its stacks
SIDECAR_CALL_S = 120.0


@contextlib.contextmanager
def watchdog(seconds: float, what: str):
    """Exit the process (status 1, every thread's stack on stderr) if the block outlasts ``seconds``."""
    print(f"[watchdog] {what}: at most {seconds:.0f} s", file=sys.stderr, flush=True)
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def kv_dtype() -> str:
    return "bfloat16" if on_gpu() else "float32"


def sidecar(work: Path, name: str, **env):
    """``kvfetcher serve`` on a Unix socket in ``work`` (log beside it), chunks of :data:`CHUNK` tokens."""
    from benchmarks.lib.sidecar_proc import SidecarProcess

    return SidecarProcess(work / f"{name}.sock", work / f"{name}-sidecar.log", KVFETCHER_CHUNK_TOKENS=str(CHUNK), **env).start()


def timing_model(tiny: bool, work: Path, model: str = "llama3-8b", tp: int = 1) -> tuple[Path, dict]:
    """The model of the timing phases and the engine's options for it: ``tiny`` SmolLM2 (at ``tp``
    > 1 a tiny random-weight Llama of 4 KV heads), else ``model`` of :data:`TIMING_MODELS` with
    random weights (``load_format="dummy"``); ``tp`` ranks (``tensor_parallel_size``) must divide
    its KV heads."""
    if tiny and tp == 1:
        return smollm2_dir(), dict(skip_tokenizer_init=True)
    name, config = ("tiny-llama-tp", TINY_TP_CONFIG) if tiny else (model, TIMING_MODELS[model])
    if config["num_key_value_heads"] % tp:
        raise ValueError(f"tensor parallelism {tp} does not divide {name}'s {config['num_key_value_heads']} KV heads")
    d = work / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    opts = dict(load_format="dummy", skip_tokenizer_init=True)
    return d, opts if tp == 1 else dict(opts, tensor_parallel_size=tp, distributed_executor_backend="mp")


def ttft_prompts(contexts: list[int], vocab: int) -> dict[int, list[int]]:
    """The timing phases' prompts: random token ids (seed 0), one prompt per context length."""
    import random

    rng = random.Random(0)
    return {n: [rng.randrange(100, vocab - 1) for _ in range(n)] for n in contexts}


def stored_presets() -> list[str]:
    """The presets the timing phases store every chunk in: ``raw`` and ``balanced`` (HEVC), and
    on a GPU ``balanced-ans`` and ``compact-ans`` too (nvCOMP: no CPU decoder)."""
    return ["raw", "balanced", "balanced-ans", "compact-ans"] if on_gpu() else ["raw", "balanced"]


def methods(only: str | None = None) -> dict[str, dict | None]:
    """recompute, every stored preset forced, and the cost model's choice (``only``: those of
    these names, comma-separated; ``ValueError`` for a name that is none of them)."""
    every = {"recompute": None, **{p: {"presets": [p], "ttft_budget_s": FORCE} for p in stored_presets()}, "auto": {}}
    if only is None:
        return every
    names = only.split(",")
    if unknown := [n for n in names if n not in every]:
        raise ValueError(f"unknown methods {unknown}: choose among {list(every)}")
    return {n: every[n] for n in names}


def turns(n: int, rounds: int) -> list[list[int]]:
    """The order of ``n`` methods in each of ``rounds`` rounds: rows of a balanced Latin square
    (Williams'), so that across ``n`` rounds (``2n`` for an odd ``n``) every method follows every
    other equally often and is first once. A rotation would keep each method behind the same other."""
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]
    rows = [[(m + r) % n for m in first] for r in range(n)]
    rows += [row[::-1] for row in rows] if n % 2 else []
    return [rows[r % len(rows)] for r in range(rounds)]


def presets_of(chosen: dict[str, dict | None]) -> list[str]:
    """The presets to store for ``chosen`` methods: those forced, or (none forced: ``auto`` alone
    and recompute) every stored preset, for ``auto`` to choose among."""
    return [p["presets"][0] for p in chosen.values() if p] or stored_presets()


def rank_namespace(ns, rank: int, tp: int):
    """Tensor-parallel rank ``rank``'s namespace of the model's ``ns`` (its whole KV geometry): the
    rank's KV heads (``kv_heads // tp``) under ``tp_rank``, as rank ``rank``'s worker registers its
    buffer and its sidecar names its chunks."""
    from dataclasses import replace

    layers, heads, dim = ns.shape
    return replace(ns, tp_rank=rank, shape=(layers, heads // tp, dim))


def shard_shape(shape: ModelShape, tp: int) -> ModelShape:
    """The KV geometry one of ``tp`` ranks holds: ``kv_heads // tp`` heads of ``shape``."""
    from dataclasses import replace

    return replace(shape, kv_heads=shape.kv_heads // tp)


def store_prefixes(root: Path, prefixes: list[list[int]], ns, shape: ModelShape, workers: int, presets: list[str] | None = None) -> dict[str, int]:
    """Every whole chunk of every token list in each of ``presets`` (default :func:`stored_presets`)
    under ``root/bench`` (an S3 bucket for ``linkserver``), named in namespace ``ns`` (of geometry
    ``shape``'s KV heads), as hard links to two synthetic encoded chunks per preset and geometry
    (real sizes and decode work, not real values); the bytes of one chunk per preset."""
    import torch

    from benchmarks.lib import fetchkit
    from kvfetcher import keys

    size = {}
    objects = root / "_objects" / f"{shape.layers}x{shape.kv_heads}x{shape.head_dim}-{ns.dtype}"
    objects.mkdir(parents=True, exist_ok=True)
    for preset in presets or stored_presets():
        src = sorted(objects.glob(f"{preset}-*"))
        if not src:  # encoded once per store (a phase may store more prefixes later)
            objs = fetchkit.encode_objects(shape, preset, CHUNK, distinct=2, workers=workers, dtype=getattr(torch, ns.dtype))
            for i, o in enumerate(objs):
                (p := objects / f"{preset}-{i}").write_bytes(o)
                src.append(p)
        size[preset] = sum(p.stat().st_size for p in src) // len(src)
        for ids in prefixes:
            for j, k in enumerate(keys.chunk_keys(ns, ids, CHUNK)):
                dst = root / "bench" / keys.object_name(k, preset)
                dst.parent.mkdir(parents=True, exist_ok=True)
                if not dst.exists():
                    os.link(src[j % len(src)], dst)
    return size


@contextlib.contextmanager
def s3_sidecar(work: Path, name: str, prefixes: list[list[int]], ns, shape: ModelShape, workers: int, *, link_procs: int = 0,
               writes: str = "raw", discard_puts: bool = False, presets: list[str] | None = None):
    """The prefixes stored in ``presets`` (:func:`store_prefixes`), ``linkserver`` serving them over
    one paced link (``link_procs`` server processes; 0: :func:`linkserver.default_procs`) and a
    sidecar reading it and writing new prefixes in ``writes`` through it (saves on, as deployed;
    ``discard_puts``: the server counts uploads without keeping them): yields (sidecar, link url,
    bytes of a chunk per preset)."""
    with s3_sidecars(work, name, prefixes, ns, shape, workers, link_procs=link_procs, writes=writes, discard_puts=discard_puts,
                     presets=presets) as (scs, url, size):
        yield scs[0], url, size


@contextlib.contextmanager
def s3_sidecars(work: Path, name: str, prefixes: list[list[int]], ns, shape: ModelShape, workers: int, *, tp: int = 1, link_procs: int = 0,
                writes: str = "raw", discard_puts: bool = False, presets: list[str] | None = None, pin: bool = True):
    """:func:`s3_sidecar` for ``tp`` tensor-parallel ranks: each rank's shard of every prefix stored
    under its namespace (:func:`rank_namespace` of the model's ``ns`` and ``shape``) in
    ``presets`` (default :func:`stored_presets`), one link server for all, and one sidecar per rank
    (:func:`rank_sidecars`, ``pin`` as there; ``tp`` 1: the one sidecar, as :func:`s3_sidecar` has it): yields
    ([sidecar of rank r], link url, bytes of one rank's chunk per preset)."""
    from benchmarks.lib import linkserver

    t0 = time.perf_counter()
    for r in range(tp):
        size = store_prefixes(work / f"{name}-s3", prefixes, rank_namespace(ns, r, tp), shard_shape(shape, tp), workers, presets)
    print(f"stored {len(prefixes)} prefixes x {tp} rank(s) in {', '.join(size)} ({size} bytes a chunk) in {time.perf_counter() - t0:.0f} s",
          flush=True)
    url, server = linkserver.start_process(work / f"{name}-s3", procs=link_procs or linkserver.default_procs(), discard_puts=discard_puts)
    try:
        with rank_sidecars(work, name, tp, pin, KVFETCHER_S3_ENDPOINT=url, KVFETCHER_S3_BUCKET="bench", KVFETCHER_S3_ACCESS_KEY="bench",
                           KVFETCHER_S3_SECRET_KEY="bench", KVFETCHER_PRESET=writes) as scs:
            yield scs, url, size
    finally:
        server.terminate()


def socket_template(work: Path, name: str, tp: int) -> str:
    """The connector's ``socket``: rank ``r``'s sidecar at ``{rank}`` replaced by ``r`` (``tp`` 1: the one socket)."""
    return str(work / f"{name}.sock") if tp == 1 else str(work / f"{name}-{{rank}}.sock")


@contextlib.contextmanager
def rank_sidecars(work: Path, name: str, tp: int, pin: bool = True, **env):
    """One sidecar per tensor-parallel rank (``tp`` 1: :func:`sidecar` ``name``), rank ``r``'s at
    :func:`socket_template` with ``r``, all with ``env``, sharing one link directory
    (``KVFETCHER_LINK_DIR``: their cost models split the node's one link among the ranks' fetches),
    each pinned to its rank's GPU on a GPU (``CUDA_VISIBLE_DEVICES``; vLLM's rank ``r`` runs on
    device ``r``, which the pinned sidecar finds by the handle's GPU UUID as its device 0; ``pin``
    False: every sidecar sees every GPU and opens rank ``r``'s blocks as device ``r``): yields
    [sidecar of rank r]; stops them all."""
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.lib.sidecar_proc import SidecarProcess

    if tp == 1:
        scs = [sidecar(work, name, **env)]
    else:
        link = work / f"{name}-link"
        link.mkdir(exist_ok=True)
        gpu = (lambda r: dict(CUDA_VISIBLE_DEVICES=str(r))) if pin and on_gpu() else (lambda r: {})
        scs = [SidecarProcess(work / f"{name}-{r}.sock", work / f"{name}-{r}-sidecar.log", KVFETCHER_CHUNK_TOKENS=str(CHUNK),
                              KVFETCHER_LINK_DIR=str(link), **gpu(r), **env) for r in range(tp)]
    try:
        with ThreadPoolExecutor(tp) as pool:  # each starts its decode workers: at once, not in turn
            list(pool.map(lambda sc: sc.proc or sc.start(), scs))
        yield scs
    finally:
        for sc in scs:
            sc.stop()


def warm_index(client, tokens: list[int], **ns) -> int:
    """The stored tokens of ``tokens``, the sidecar listing what its index lacks first (a refresh):
    the objects this benchmark hard-links into the store are unknown to a sidecar whose lookups
    answer from its index, as they would be known to a node that has seen the prefix before."""
    return client.hit_tokens(None, tokens, refresh=True, **ns)


def warm_ranks(clients: list, tokens: list[int], **ns) -> int:
    """:func:`warm_index` on every rank's sidecar (``clients[r]``, ``tp_rank`` r; ``ns`` one rank's
    model, dtype and ``kv_shape``): the tokens every rank has stored. Under a :func:`watchdog`: a
    sidecar that stops answering ends the phase with every thread's stack, not at its kill."""
    with watchdog(SIDECAR_CALL_S, f"ask {len(clients)} sidecar(s) for a {len(tokens)}-token prefix"):
        return min(warm_index(c, tokens, tp_rank=r, **ns) if len(clients) > 1 else warm_index(c, tokens, **ns) for r, c in enumerate(clients))


# --- what the sidecar and the link say, before and after a cell ---------------------------------


def read_metrics(client) -> dict[str, float]:
    """The sidecar's metrics: {series (name and labels, as exposed): value}."""
    out = {}
    for line in client.metrics().splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            try:
                out[k] = float(v)
            except ValueError:
                pass
    return out


def metric(m: dict[str, float], name: str, **labels) -> float:
    """``name`` summed over the series whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in m.items() if (k == name or k.startswith(name + "{")) and all(w in k for w in want))


def by_label(m: dict[str, float], name: str, label: str) -> dict[str, float]:
    """The series of ``name`` by the value of their ``label``."""
    return {k.split(f'{label}="', 1)[1].split('"', 1)[0]: v for k, v in m.items() if k.startswith(name + "{") and f'{label}="' in k}


def bucket_quantile(m0: dict[str, float], m1: dict[str, float], name: str, q: float) -> float | None:
    """The ``q`` quantile of the observations a histogram got between two readings, as the upper
    bound of its bucket (``inf`` past the last bound; None without observations)."""
    def buckets(m):
        out = {}
        for k, v in m.items():
            if k.startswith(name + "_bucket{"):
                le = k.split('le="', 1)[1].split('"', 1)[0]
                out[float(le)] = out.get(float(le), 0.0) + v
        return out

    b0, b1 = buckets(m0), buckets(m1)
    counts = sorted((le, b1[le] - b0.get(le, 0.0)) for le in b1)
    if not counts or counts[-1][1] <= 0:
        return None
    return next(le for le, c in counts if c >= q * counts[-1][1])


#: the environment a run's report states: the sidecars' settings (they inherit them), the connector options the bench adds,
#: and whether every process is a client of a CUDA MPS server (benchmarks/lib/with_mps.sh) rather than time-sliced
STATED = ("KVFETCHER_", "VLLM_TTFT_CONNECTOR_OPTIONS", "CUDA_MPS_PIPE_DIRECTORY")


def run_settings(env=None) -> dict[str, str]:
    """The variables of ``env`` (default: this process') that :data:`STATED` names, sorted."""
    return {k: v for k, v in sorted((os.environ if env is None else env).items()) if k.startswith(STATED)}


class Probe:
    """The sidecar's counters, the link server's bytes and the machine's CPU time before a request
    (or a stream), and :meth:`delta` after it: what the sidecar reports of that time, and
    ``cpu_busy_cores`` (:func:`busy_cores`). ``client`` may be a list, one sidecar per
    tensor-parallel rank: :meth:`delta` is then the ranks' together (:func:`ranks_delta`)."""

    def __init__(self, client, url: str | None):
        from benchmarks.lib import linkserver

        self.clients, self.url = (list(client) if isinstance(client, (list, tuple)) else [client]), url
        self.m0s, self.l0 = [read_metrics(c) for c in self.clients], (linkserver.stats(url) if url else {})
        self.m0 = self.m0s[0]  # the metrics before, of the one sidecar (rank 0's)
        self.cpu0 = cpu_jiffies()

    def delta(self) -> dict:
        from benchmarks.lib import linkserver

        m1, l1 = [read_metrics(c) for c in self.clients], (linkserver.stats(self.url) if self.url else {})
        link = {k: l1.get(k, 0) - self.l0.get(k, 0) for k in ("bytes_sent", "bytes_received", "objects_put")}
        each = [sidecar_delta(m0, m, link) for m0, m in zip(self.m0s, m1)]
        return dict(each[0] if len(each) == 1 else ranks_delta(each), cpu_busy_cores=busy_cores(self.cpu0, cpu_jiffies()))


#: how :func:`ranks_delta` joins the ranks' sidecars: seconds by the slowest rank (the ranks run at once, a TP step
#: waits for all), tokens loaded by the rank that loaded least (what the group holds), the rest summed
SLOWEST = ("lookup_s", "listing_s", "load_s", "fetch_s", "read_s", "decode_s", "lookup_p50_le_s", "lookup_p99_le_s", "warming")
LEAST = ("loaded_tokens",)
ONCE = ("link_bytes_sent", "link_bytes_received", "link_objects_put", "predicted_s", "prefill_model", "stages", "load_overhead_s")  # the link's, rank 0's


def ranks_delta(each: list[dict]) -> dict:
    """The tensor-parallel ranks' sidecar deltas (:meth:`Probe.delta` of each) as one: :data:`SLOWEST`
    the most of any rank (None where no rank has it), :data:`LEAST` the least, :data:`ONCE` the link
    server's (it serves all ranks) or rank 0's, the others summed; ``ranks``: each rank's own."""
    out = {}
    for k, v in each[0].items():
        vals = [d[k] for d in each]
        if k in SLOWEST:
            out[k] = max((x for x in vals if x is not None), default=None)
        elif k in LEAST:
            out[k] = min(vals)
        elif k in ONCE:
            out[k] = v
        elif isinstance(v, dict):
            out[k] = {n: sum(d[k].get(n, 0) for d in each) for n in {n for d in each for n in d[k]}}
        else:
            out[k] = sum(vals)
    return dict(out, ranks=each)


def sidecar_delta(m0: dict[str, float], m1: dict[str, float], link: dict[str, int]) -> dict:
    """What one sidecar's metrics say of the time between two readings (``m0``, ``m1``), with the
    link server's byte counts over that time (``link``)."""
    d = lambda name, **lb: metric(m1, name, **lb) - metric(m0, name, **lb)  # noqa: E731
    ld = lambda k: link.get(k, 0)  # noqa: E731

    def counted(name: str, label: str) -> dict[str, int]:  # a counter's growth per label value, where it grew
        before = by_label(m0, name, label)
        return {x: int(v - before.get(x, 0)) for x, v in by_label(m1, name, label).items() if v - before.get(x, 0) > 0}

    return {
        "lookups": int(d("kvfetcher_lookups_total")), "lookup_s": d("kvfetcher_lookup_seconds_sum"),
        "listings": int(d("kvfetcher_listing_seconds_count")), "listing_s": d("kvfetcher_listing_seconds_sum"),
        "lookup_p50_le_s": bucket_quantile(m0, m1, "kvfetcher_lookup_seconds", 0.5),
        "lookup_p99_le_s": bucket_quantile(m0, m1, "kvfetcher_lookup_seconds", 0.99),
        "loads": int(d("kvfetcher_fetch_seconds_count")),
        "load_s": d("kvfetcher_fetch_seconds_sum"), "fetch_s": d("kvfetcher_fetch_busy_seconds_total", stage="fetch"),
        "read_s": d("kvfetcher_fetch_busy_seconds_total", stage="read"), "decode_s": d("kvfetcher_fetch_busy_seconds_total", stage="decode"),
        "loaded_tokens": int(d("kvfetcher_loaded_tokens_total")), "bytes_read": int(d("kvfetcher_bytes_read_total")),
        "kv_bytes": int(d("kvfetcher_kv_bytes_restored_total")), "link_bytes_sent": int(ld("bytes_sent")),
        "stored_chunks": int(d("kvfetcher_store_seconds_count")), "bytes_written": int(d("kvfetcher_bytes_written_total")),
        "link_bytes_received": int(ld("bytes_received")), "link_objects_put": int(ld("objects_put")),
        "dropped_chunks": int(d("kvfetcher_store_dropped_chunks_total")), "errors": int(d("kvfetcher_errors_total")),
        "fallbacks": counted("kvfetcher_fallbacks_total", "reason"),
        # the cost model's predicted seconds per option at the cell's last lookup (auto's reasons)
        "predicted_s": {k: round(v, 4) for k, v in by_label(m1, "kvfetcher_lookup_option_seconds", "option").items()}
                       if d("kvfetcher_lookups_total") else {},
        # the engine's prefill model the scheduler sent with it (the recompute side of that choice)
        "prefill_model": by_label(m1, "kvfetcher_prefill_model", "term"),
        "warming": m1.get("kvfetcher_decode_warming", 0.0),  # auto's choice was limited to raw and recompute
        "load_overhead_s": m1.get("kvfetcher_load_overhead_seconds"),  # what the scheduler's last lookup said a load costs the engine
        # the last load's chunks in each step of their restore, on average (the step at its concurrency bounds it)
        "stages": by_label(m1, "kvfetcher_fetch_stage_chunks_in_flight", "stage") if d("kvfetcher_fetch_seconds_count") else {},
        # the presets its loads took (none: the request recomputed)
        "decisions": counted("kvfetcher_preset_decisions_total", "preset"),
    }


def breakdown(ttft_s: float, d: dict) -> dict:
    """A request's TTFT broken down by what the sidecar reports (a cell has one request):
    ``lookup`` the sidecar's time answering the scheduler's lookup (from its index; before the
    index, the store listing); ``wait`` the sidecar's load request outside its fetch (looking up
    again where the plan chose no preset, the link's share); ``download`` time with a store read in flight; ``decode`` time with a decode or
    restore in flight (raw: the copy into the blocks); ``restore`` the fetch's wall time (download
    and decode overlap inside it); ``prefill`` the rest of the TTFT: the remainder's prefill and
    the engine's own work. ``delivered_gbit``: the link server's bytes over the download time;
    ``cpu_busy_cores``: the machine's busy cores over the request (every process on it)."""
    lookup, load = d["lookup_s"], d["load_s"]
    r = lambda x: round(x, 4)  # noqa: E731
    return {"lookup_s": r(lookup), "wait_s": r(max(0.0, load - d["fetch_s"])), "download_s": r(d["read_s"]), "decode_s": r(d["decode_s"]),
            "restore_s": r(d["fetch_s"]), "prefill_s": r(max(0.0, ttft_s - lookup - load)),
            "delivered_gbit": delivered_gbit(d["link_bytes_sent"], d["read_s"]), "cpu_busy_cores": d.get("cpu_busy_cores")}


def delivered_gbit(nbytes: float, seconds: float) -> float | None:
    """``nbytes`` over ``seconds`` in Gbit/s (None for no time)."""
    return round(nbytes * 8 / seconds / 1e9, 3) if seconds > 0 else None


def smollm2_dir() -> Path:
    """The plain SmolLM2 copy vLLM loads (made from the shipped GGUF file once)."""
    from kvfetcher.eval import model

    d = model.cache_dir() / "smollm2-135m"
    if not (d / "config.json").exists():
        model.load()
    return d


def shape_of(model_dir: Path) -> ModelShape:
    """The KV geometry (and size) of the model a ``config.json`` describes."""
    c = json.loads((model_dir / "config.json").read_text())
    return ModelShape(model_dir.name, c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                      c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"], c["intermediate_size"], c["vocab_size"],
                      float(c.get("rope_theta", 10000.0)))


#: NVLink multicast stays off under tensor parallelism (the lent multi-GPU machines' rule: it can take a host's shared GPUs
#: out of service): NCCL's NVLS, PyTorch's and NVSHMEM's multicast, and vLLM's symmetric-memory all-reduce (multimem)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}


def start_llm(model_dir: Path, socket: str, fingerprint: str, *, prefix_caching: bool, max_model_len: int, timeout_s: float, **kw):
    """``vllm.LLM`` with the connector: bf16 on a GPU, fp32 on a CPU (bf16 is slow without AVX-512).
    ``prefix_caching`` False: vLLM's own prefix cache never answers, so every hit is kvfetcher's.
    ``tensor_parallel_size`` > 1 (in ``kw``): on a GPU without NVLink multicast (:data:`NO_MULTICAST`),
    on a CPU with the ranks' threads unbound."""
    from vllm import LLM

    gpu = on_gpu()
    opts = dict(dtype="bfloat16", gpu_memory_utilization=kw.pop("gpu_memory_utilization", 0.85)) if gpu else dict(dtype="float32")
    if kw.get("tensor_parallel_size", 1) > 1:
        os.environ.update(NO_MULTICAST if gpu else {})
        if not gpu:  # the ranks share the CPUs (vLLM binds one NUMA node per rank otherwise), their OpenMP
            # threads split between them: more threads than cores spin against each other (10x slower steps)
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // kw["tensor_parallel_size"])))
    with watchdog(timeout_s, "engine start"):
        return LLM(model=str(model_dir), enforce_eager=True, max_model_len=max_model_len, enable_prefix_caching=prefix_caching,
                   kv_transfer_config=connector(socket, fingerprint), **opts, **kw)


def generate(llm, prompts: list[list[int]], max_tokens: int, params: dict | None, timeout_s: float) -> tuple[float, list]:
    """One batch, greedy: (wall seconds, [(tokens, num_cached_tokens), ...]). ``params``: the
    requests' ``kv_transfer_params``; None: a plain recompute (``skip_reading_prefix_cache``: no
    cached KV read, vLLM's or kvfetcher's)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, skip_reading_prefix_cache=params is None,
                        extra_args={"kv_transfer_params": params} if params else None)
    with watchdog(timeout_s, f"generate {len(prompts)} x {max(map(len, prompts))} tokens"):
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        s = time.perf_counter() - t0
    return s, [(list(o.outputs[0].token_ids), o.num_cached_tokens or 0) for o in out]


def wait_stored(client, tokens: list[int], n: int, ns: dict, timeout_s: float = 120) -> None:
    """Wait until the sidecar has the first ``n`` tokens of ``tokens`` stored (saves run in the background)."""
    deadline = time.time() + timeout_s
    client.flush()
    while (have := warm_index(client, tokens, **ns)) < n:
        if time.time() > deadline:
            raise RuntimeError(f"{n} tokens were never stored (have {have})")
        time.sleep(0.5)


def phase_left() -> float:
    """Seconds left before :func:`run_phases` kills this phase (inf when run on its own)."""
    end = os.environ.get("VLLM_TTFT_PHASE_END")
    return float(end) - time.time() if end else float("inf")


def counter(client, name: str) -> float:
    """A counter of the sidecar's metrics, summed over its labels."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in client.metrics().splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def run_phases(module: str, phases: list[str], argv: list[str], out: Path, timeout_s: dict[str, float], deadline_s: float,
               work: Path | None = None) -> dict:
    """Run ``python -m module --phase P argv`` for each phase, each in a new process group killed
    when it ends; a phase that fails, hangs past its ``timeout_s`` or would start after
    ``deadline_s`` is recorded as such. One killed at its limit is first sent ``SIGABRT``: every
    Python process of its group (the phase, vLLM's engine core, the sidecars) runs with
    ``PYTHONFAULTHANDLER``, so each prints every thread's stack (the sidecars' go to their logs). The last lines of the sidecar logs in ``work``
    that the phase wrote go to ``out`` beside its results (``<phase>-<log>.tail``). Returns {phase:
    "ok" | why not}."""
    t_end, status = time.monotonic() + deadline_s, {}
    for phase in phases:
        left = t_end - time.monotonic()
        if left < 60:
            status[phase] = "not run: the deadline came first"
            continue
        limit = min(timeout_s.get(phase, 600), left)
        env = dict(os.environ, VLLM_TTFT_PHASE_END=str(time.time() + limit),  # the phase stops starting work before its kill
                   PYTHONFAULTHANDLER="1")
        started = time.time()
        p = subprocess.Popen([sys.executable, "-m", module, "--phase", phase, *argv], start_new_session=True, env=env)
        try:
            rc = p.wait(limit)
            status[phase] = "ok" if rc == 0 else f"failed: exit status {rc} (its stacks and error are above)"
        except subprocess.TimeoutExpired:
            status[phase] = f"killed after {limit:.0f} s (its stacks are above)"
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGABRT)
                time.sleep(3)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # the engine core and the sidecar too
            p.wait()
        print(f"== phase {phase}: {status[phase]}", flush=True)
        if work is not None:
            keep_log_tails(work, out, phase, started)
    (out / "status.json").write_text(json.dumps(status, indent=1))
    return status


def keep_log_tails(work: Path, out: Path, phase: str, since: float, lines: int = 200) -> None:
    """The last ``lines`` of each sidecar log in ``work`` written since ``since`` (epoch seconds), as
    ``out/<phase>-<log>.tail``: the logs stay on the machine that ran the phase, its results do not."""
    for log in sorted(work.glob("*-sidecar*.log")):
        if log.stat().st_mtime >= since:
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            (out / f"{phase}-{log.name}.tail").write_text("\n".join(tail) + "\n")
