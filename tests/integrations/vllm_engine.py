"""A real vLLM engine with the kvfetcher connector, driven over stdin/stdout by the tests.

Run by ``tests/integrations/test_vllm.py`` with the vLLM venv's Python (``.venv-vllm``, built by
``make``), so that the tests themselves run in the project's venv. The model runs in float32 (bf16
is slow on CPUs without AVX-512, and greedy tokens near a tie are steadier). ``argv[1]`` is a JSON object:
``model`` (a directory vLLM loads), ``name`` (the model's name in chunk keys), ``socket`` (the
sidecar's), ``max_model_len``, ``events`` (a free TCP port for vLLM's KV-event publisher), optionally
``tp`` (tensor-parallel ranks, each a worker process) and ``staging_tokens`` (the connector's host staging). Each stdin line is a JSON command, answered by one
stdout line starting with :data:`MARK` (vLLM's own output goes to stderr):

* ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": n, "reference": false, "params": {...}}`` ->
  ``{"outputs": [{"tokens": [...], "cached": num_cached_tokens}, ...]}``, greedy; ``reference``:
  read no cached KV at all (``skip_reading_prefix_cache``), a plain recompute; ``params``
  (optional): the requests' ``kv_transfer_params``;
* ``{"op": "reset_prefix_cache"}`` -> ``{"ok": true}`` (vLLM forgets its own cached blocks);
* ``{"op": "events"}`` -> ``{"events": [...]}``: the ``BlockStored`` events of medium OBJ published
  since the last call, as ``{"block_hashes", "parent", "tokens", "block_size"}``.
"""

from __future__ import annotations

import json
import os
import sys
import threading

MARK = "@@kvfetcher-engine@@ "


def _subscriber(port: int, sink: list, lock: threading.Lock) -> None:
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.bind(f"tcp://127.0.0.1:{port}")  # vLLM's publisher connects to an endpoint with a host (binds to tcp://*:port)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    while True:
        frames = sub.recv_multipart()
        for e in decoder.decode(frames[-1]).events:
            if isinstance(e, BlockStored) and e.medium == "OBJ":
                with lock:
                    sink.append({"block_hashes": [h if isinstance(h, int) else h.hex() for h in e.block_hashes],
                                 "parent": e.parent_block_hash if not isinstance(e.parent_block_hash, bytes) else e.parent_block_hash.hex(),
                                 "tokens": list(e.token_ids), "block_size": e.block_size})


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if cfg.get("tp", 1) > 1:  # ranks share the CPUs (vLLM binds one NUMA node per rank otherwise), their
        # OpenMP threads split between them: more threads than cores spin against each other (10x slower steps)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg["tp"])))
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # everything else anyone prints goes to stderr
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    events: list = []
    lock = threading.Lock()
    threading.Thread(target=_subscriber, args=(cfg["events"], events, lock), daemon=True).start()
    llm = LLM(
        model=cfg["model"], max_model_len=cfg["max_model_len"], enforce_eager=True, dtype="float32",
        tensor_parallel_size=cfg.get("tp", 1), distributed_executor_backend="mp" if cfg.get("tp", 1) > 1 else None,
        kv_transfer_config={
            "kv_connector": "KVFetcherConnector", "kv_connector_module_path": "kvfetcher.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket": cfg["socket"], "model": cfg["name"], "lookup_timeout_s": 10,
                                          "listing_wait_s": 5,  # a 2-core CPU shared with the engine: answers, not timing
                                          # loads, not auto's choice: on this CPU a fresh sidecar's prior rates make a load and a
                                          # recompute a near-tie, which auto may decide either way
                                          "ttft_budget_s": 1e6,
                                          **({"staging_tokens": cfg["staging_tokens"]} if "staging_tokens" in cfg else {}),
                                          **cfg.get("options", {})},
        },
        kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{cfg['events']}",
                          "topic": "kv"},
    )
    print(MARK + json.dumps({"ready": True}), file=out)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "generate":
            params = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True,
                                    skip_reading_prefix_cache=cmd.get("reference", False),
                                    extra_args={"kv_transfer_params": cmd["params"]} if cmd.get("params") else None)
            res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]], params, use_tqdm=False)
            reply = {"outputs": [{"tokens": list(r.outputs[0].token_ids), "cached": r.num_cached_tokens or 0} for r in res]}
        elif cmd["op"] == "reset_prefix_cache":
            reply = {"ok": bool(llm.reset_prefix_cache())}
        elif cmd["op"] == "events":
            with lock:
                reply = {"events": list(events)}
                events.clear()
        else:
            reply = {"error": f"unknown op {cmd['op']!r}"}
        print(MARK + json.dumps(reply), file=out)


if __name__ == "__main__":  # the guard the tensor-parallel workers (spawned) need
    main()
