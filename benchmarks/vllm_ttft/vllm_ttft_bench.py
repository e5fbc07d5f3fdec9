"""TTFT of a real vLLM engine with the kvfetcher connector: recompute, raw, balanced and auto.

One GPU, vLLM 0.26 (the GPU machine's), each phase a vLLM engine in its own process:

* ``identity``: SmolLM2 (the plain copy ``kvfetcher.eval.model`` makes) through vLLM with the
  connector and a real sidecar on a local store: a prompt is stored, then loaded by a second
  request; its tokens must equal a recompute's (``skip_reading_prefix_cache``).
* ``ttft``: a Llama-3-8B ``config.json`` with ``load_format="dummy"`` (random weights, timing only),
  prompts of 8K-64K random tokens, a real sidecar (``kvfetcher serve`` on a Unix socket) reading S3
  from ``linkserver`` (loopback, one paced link: 1/10/25/100 Gbit/s). Every chunk of every prompt
  is stored in ``raw`` and ``balanced`` beforehand (a few distinct synthetic chunks hard-linked
  under every chunk's name: sizes and decode work of real chunks without hours of x265). Per cell:
  ``recompute`` (a plain prefill), ``raw`` and ``balanced`` (that preset, forced with a huge TTFT
  budget through the request's ``kv_transfer_params``) and ``auto`` (the cost model, fed the
  engine's own measured prefill rate). TTFT = wall time of ``generate(max_tokens=1)``.
  A forced cell whose transfer alone would exceed ``--cap-s`` at that link is skipped.

    python -m benchmarks.vllm_ttft.vllm_ttft_bench --out results/        # both phases, < 8 min on an H100
    python -m benchmarks.vllm_ttft.vllm_ttft_bench --phase identity --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUCKET = "bench"
CHUNK = 256
GBIT = 1.25e8  # bytes/s of 1 Gbit/s
METHODS = {
    "recompute": None,
    "raw": {"presets": ["raw"], "ttft_budget_s": 1e6},
    "balanced": {"presets": ["balanced"], "ttft_budget_s": 1e6},
    "auto": {},
}
LLAMA3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}


def connector(socket: str, model: str) -> dict:
    return {"kv_connector": "KVFetcherConnector", "kv_connector_module_path": "kvfetcher.integrations.vllm", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"socket": socket, "model": model}}


def generate(llm, prompts, max_tokens: int, params: dict | None = {}):  # noqa: B006 (never mutated)
    """One batch, after vLLM forgot its own cached blocks; ``params``: the request's
    ``kv_transfer_params``, or None for a plain recompute (no cached KV read at all)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # vLLM 0.26 frees a request's blocks held for a save only on a later engine step, and a reset with
    # blocks still held is refused (the next request would then hit vLLM's own cache): step it first
    for _ in range(3):
        if llm.reset_prefix_cache():
            break
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=1), use_tqdm=False)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, skip_reading_prefix_cache=params is None,
                        extra_args={"kv_transfer_params": params} if params else None)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t0, [(list(o.outputs[0].token_ids), o.num_cached_tokens or 0) for o in out]


def wait_stored(client, tokens, n: int, ns: dict, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while client.lookup(None, tokens, **ns) < n:
        if time.time() > deadline:
            raise RuntimeError(f"{n} tokens were never stored")
        time.sleep(0.5)


# --- phase identity ------------------------------------------------------------------------------


def phase_identity(tmp: Path, tokens: int = 1100) -> dict:
    from vllm import LLM

    from benchmarks.lib.sidecar_proc import SidecarProcess
    from kvfetcher.eval import model

    lm = model.load()  # the plain copy vLLM loads
    ids = [int(i) for i in model.tokenize(lm, model.sample_text("code.txt"), tokens)]
    sc = SidecarProcess(tmp / "id.sock", tmp / "id-sidecar.log", KVFETCHER_STORE_DIR=str(tmp / "id-store"), KVFETCHER_PRESET="raw",
                        KVFETCHER_CHUNK_TOKENS=str(CHUNK)).start()
    try:
        llm = LLM(model=str(model.cache_dir() / "smollm2-135m"), enforce_eager=True, max_model_len=4096, gpu_memory_utilization=0.3,
                  kv_transfer_config=connector(sc.socket, "smollm2"))
        _, [(first, c0)] = generate(llm, [ids], 32)
        stored = (len(ids) // CHUNK) * CHUNK
        wait_stored(sc.client(), ids, stored, dict(model="smollm2", dtype="bfloat16", kv_shape=(30, 3, 64)))
        _, [(second, c1)] = generate(llm, [ids], 32, {})
        _, [(ref, c2)] = generate(llm, [ids], 32, None)
    finally:
        sc.stop()
    res = {"prompt_tokens": len(ids), "cached_first": c0, "cached_second": c1, "expected_loaded": (len(ids) - 1) // CHUNK * CHUNK,
           "tokens_identical_to_recompute": second == ref == first, "first_tokens": first[:8]}
    print(f"identity: loaded {c1} of {len(ids)} tokens; 32 generated tokens identical to recompute: {res['tokens_identical_to_recompute']}")
    return res


# --- phase ttft ----------------------------------------------------------------------------------


def store_prompts(root: Path, prompts: dict[int, list[int]], ns, workers: int) -> dict[str, int]:
    """Every chunk of every prompt in raw and balanced under ``root/BUCKET`` (hard links to a few
    encoded chunks); the bytes of one chunk per preset."""
    from benchmarks.lib import fetchkit
    from kvfetcher import keys
    from kvfetcher.eval.costmodel import LLAMA3_8B

    size = {}
    for preset in ("raw", "balanced"):
        objs = fetchkit.encode_objects(LLAMA3_8B, preset, CHUNK, distinct=2, workers=workers)
        size[preset] = sum(map(len, objs)) // len(objs)
        src = []
        for i, o in enumerate(objs):
            (root / "_objects").mkdir(parents=True, exist_ok=True)
            (p := root / "_objects" / f"{preset}-{i}").write_bytes(o)
            src.append(p)
        for ids in prompts.values():
            for j, k in enumerate(keys.chunk_keys(ns, ids[:-1], CHUNK)):
                dst = root / BUCKET / keys.object_name(k, preset)
                dst.parent.mkdir(parents=True, exist_ok=True)
                if not dst.exists():
                    os.link(src[j % len(src)], dst)
    return size


def phase_ttft(tmp: Path, contexts: list[int], links: list[float], cap_s: float, workers: int) -> dict:
    from vllm import LLM

    from benchmarks.lib import fetchkit, linkserver
    from benchmarks.lib.sidecar_proc import SidecarProcess
    from kvfetcher import keys

    model_dir = tmp / "llama3-8b"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
    rng = random.Random(0)
    prompts = {n: [rng.randrange(1000, 120000) for _ in range(n)] for n in contexts}
    ns = keys.Namespace(model=fetchkit.FINGERPRINT, dtype="bfloat16", shape=(32, 8, 128))  # the objects' fingerprint
    t0 = time.perf_counter()
    size = store_prompts(tmp / "s3", prompts, ns, workers)
    print(f"stored {len(prompts)} prompts in raw and balanced ({size}) in {time.perf_counter() - t0:.0f} s", flush=True)
    url, server = linkserver.start_process(tmp / "s3")
    sc = SidecarProcess(tmp / "ttft.sock", tmp / "ttft-sidecar.log", KVFETCHER_S3_ENDPOINT=url, KVFETCHER_S3_BUCKET=BUCKET,
                        KVFETCHER_S3_ACCESS_KEY="bench", KVFETCHER_S3_SECRET_KEY="bench", KVFETCHER_PRESET="raw",
                        KVFETCHER_CHUNK_TOKENS=str(CHUNK)).start()
    rows = []
    try:
        llm = LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
                  max_model_len=max(contexts) + 256, gpu_memory_utilization=0.85, kv_transfer_config=connector(sc.socket, ns.model))
        for n in sorted(contexts)[:2]:  # warm-up: kernels, the connector's prefill rate, the sidecar's estimator
            generate(llm, [prompts[n]], 1, None)
            generate(llm, [prompts[n]], 1, METHODS["raw"])
        for gbit in links:
            linkserver.set_rate(url, gbit * GBIT)
            for n in contexts:
                for method, params in METHODS.items():
                    preset = (params or {}).get("presets", [None])[0]
                    transfer_s = (n // CHUNK) * size[preset] / (gbit * GBIT) if preset else 0.0
                    if transfer_s > cap_s:
                        rows.append(dict(link_gbit=gbit, context=n, method=method, skipped=f"transfer alone {transfer_s:.0f} s > cap"))
                        continue
                    s, [(_, cached)] = generate(llm, [prompts[n]], 1, params)
                    rows.append(dict(link_gbit=gbit, context=n, method=method, ttft_s=round(s, 4), loaded_tokens=cached))
                    print(f"{gbit:>5g} Gbit/s {n:>6} tokens {method:>9}: {s:7.3f} s, loaded {cached}", flush=True)
    finally:
        sc.stop()
        server.terminate()
    return {"object_bytes_per_chunk": size, "chunk_tokens": CHUNK, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--phase", choices=["all", "identity", "ttft"], default="all")
    ap.add_argument("--contexts", default="8192,16384,32768,65536")
    ap.add_argument("--links", default="100,25,10,1", help="Gbit/s")
    ap.add_argument("--cap-s", type=float, default=12.0, help="skip a forced load whose transfer alone takes longer")
    ap.add_argument("--workers", type=int, default=8, help="processes encoding the balanced chunks")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.phase == "all":  # one engine per process: vLLM does not give a GPU back within one
        for phase in ("identity", "ttft"):
            subprocess.run([sys.executable, "-m", "benchmarks.vllm_ttft.vllm_ttft_bench", *sys.argv[1:], "--phase", phase], check=True)
        return
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    with tempfile.TemporaryDirectory() as tmp:
        if a.phase == "identity":
            res = phase_identity(Path(tmp))
        else:
            res = phase_ttft(Path(tmp), [int(x) for x in a.contexts.split(",")], [float(x) for x in a.links.split(",")], a.cap_s, a.workers)
    import torch
    import vllm

    res.update(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", vllm=vllm.__version__,
               date=time.strftime("%Y-%m-%d"))
    (out / f"{a.phase}.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out / (a.phase + '.json')}")


if __name__ == "__main__":
    main()
