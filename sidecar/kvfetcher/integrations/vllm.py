"""vLLM with remote KV reuse: ``KVFetcherConnector``, a vLLM V1 KV connector backed by the sidecar.

Configured the ordinary way (vLLM 0.26 and 0.32 checked; see docs/operations.md)::

    --kv-transfer-config '{"kv_connector": "KVFetcherConnector",
                           "kv_connector_module_path": "kvfetcher.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"socket": "/run/kvfetcher/kvfetcher.sock"}}'

vLLM builds one instance in the scheduler and one per worker; each delegates to its side:
:class:`~kvfetcher.integrations.vllm_scheduler.SchedulerSide` (lookups, block tables, stores to ask
for, KV events, the engine's prefill model) and :class:`~kvfetcher.integrations.vllm_worker.WorkerSide`
(registers the KV cache, fetches and stores in background threads). ``kv_role``: ``kv_both`` loads
and stores, ``kv_consumer`` only loads, ``kv_producer`` only stores. Contract with the engine: a fetch
is asynchronous and reports its request finished only when it is over; blocks it did not write are
reported as load errors, so vLLM recomputes them and never reads an unverified block. A failing or
absent sidecar makes every request a plain recompute.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvfetcher.integrations.vllm_meta import Options, StepMeta, WorkerReport
from kvfetcher.integrations.vllm_scheduler import SchedulerSide
from kvfetcher.integrations.vllm_worker import WorkerSide

__all__ = ["KVFetcherConnector", "Options", "StepMeta", "WorkerReport"]


class KVFetcherConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        options = Options.parse(self._kv_transfer_config.kv_connector_extra_config or {}, vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            self._s, self._w = SchedulerSide(vllm_config, kv_cache_config, options), None
        else:
            self._s, self._w = None, WorkerSide(vllm_config, options)

    # vLLM 0.26 gives one tensor for all layers when the connector asks for it (ignored by 0.32)
    @property
    def prefer_cross_layer_blocks(self) -> bool:
        return True

    @property
    def requires_kv_delivery(self) -> bool:  # a dropped store is a future miss, not a lost hand-off
        return False

    # --- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._s.allocated(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> StepMeta:
        return self._s.step(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._s.loads_done(getattr(connector_output, "finished_recving", None))
        self._s.report(getattr(connector_output, "kv_connector_worker_meta", None))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._s.finished(request.request_id, request.num_computed_tokens >= request.num_prompt_tokens), None

    def take_events(self):
        return self._s.take_events() if self._s else ()

    def has_pending_push_work(self) -> bool:  # vLLM 0.32: keep stepping until the workers report the stores
        return bool(self._s and self._s.storing)

    # --- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        self._w.register(kv_caches)

    def register_cross_layers_kv_cache(self, kv_cache, attn_backend) -> None:
        self._w.register_cross_layer(kv_cache, attn_backend)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._w.start_step(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._w.layer_start(self._get_connector_metadata())  # loads complete before vLLM schedules their request

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # a finished prefill is saved whole, after the step (wait_for_save)

    def wait_for_save(self) -> None:
        self._w.end_step(self._get_connector_metadata())

    def handle_preemptions(self, kv_connector_metadata) -> None:
        self._w.preempted(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._w.finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w.load_errors()

    def build_connector_worker_meta(self) -> WorkerReport | None:
        return self._w.take_report()

    def shutdown(self) -> None:
        (self._w or self._s).close()
