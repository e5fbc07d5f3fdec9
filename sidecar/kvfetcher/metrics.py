"""metrics: the sidecar's Prometheus metrics, one registry per sidecar instance.

Names follow ``kvfetcher_<what>_<unit>`` (``_total`` for counters). A registry per instance
lets two sidecars share a process (the embedded demo, tests) without mixing their numbers.
"""

from __future__ import annotations

import contextlib
import platform
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def _version() -> str:
    try:
        return version("kvfetcher")
    except PackageNotFoundError:
        return "unknown"


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.build = Info("kvfetcher_build", "The sidecar's version and Python", registry=r)
        self.build.info({"version": _version(), "python": platform.python_version()})
        self.lookups = Counter("kvfetcher_lookups_total", "Prefix lookups", registry=r)
        self.lookup_tokens = Counter(
            "kvfetcher_lookup_tokens_total", "Prompt tokens looked up (the hit rate: hit_tokens_total over this)", registry=r
        )
        self.hit_tokens = Counter("kvfetcher_hit_tokens_total", "Leading prompt tokens found stored", registry=r)
        self.loaded_tokens = Counter("kvfetcher_loaded_tokens_total", "Tokens written into KV buffers", registry=r)
        self.fetch_seconds = Histogram("kvfetcher_fetch_seconds", "Wall time of a fetch", buckets=_LATENCY, registry=r)
        self.lookup_seconds = Histogram(
            "kvfetcher_lookup_seconds", "Time the sidecar took to answer a lookup (from its index; with refresh, listing included)",
            buckets=_FAST, registry=r)
        self.listing_seconds = Histogram(
            "kvfetcher_listing_seconds", "Time to list a prefix's chunks the index did not know (one LIST per chunk), in the background "
            "or before a fetch", buckets=_LATENCY, registry=r)
        self.lookup_options = Gauge("kvfetcher_lookup_option_seconds", "The last lookup's predicted seconds until the prefix is in "
                                    "the buffer, per option the cost model weighed (a preset, or recompute)", ["option"], registry=r)
        self.index_keys = Gauge("kvfetcher_index_keys", "Chunk keys the sidecar's index of the store knows (stored or absent)", registry=r)
        self.store_seconds = Histogram("kvfetcher_store_seconds", "Encode + upload time of one chunk", buckets=_LATENCY, registry=r)
        self.bytes_read = Counter("kvfetcher_bytes_read_total", "Bytes read from the store", registry=r)
        # a fetch's stages (executor.Outcome), summed: with the fetch count, a load's time broken down
        self.fetch_busy = Counter(
            "kvfetcher_fetch_busy_seconds_total", "Seconds with at least one store read (stage=read) or one decode/restore (stage=decode) of a "
            "fetch in flight, and the fetches' own wall time (stage=fetch); the stages overlap", ["stage"], registry=r,
        )
        self.kv_bytes = Counter("kvfetcher_kv_bytes_restored_total", "KV bytes written into KV buffers by fetches", registry=r)
        self.engine_objects = Counter("kvfetcher_engine_objects_total", "Verified stored objects written for an engine that decodes "
                                      "itself (engine-decode mode), by preset", ["preset"], registry=r)
        self.engine_kv_bytes = Counter("kvfetcher_engine_kv_bytes_total", "KV bytes engines that decode themselves reported restoring, "
                                       "by preset", ["preset"], registry=r)
        self.engine_decode_seconds = Counter("kvfetcher_engine_decode_seconds_total", "Seconds engines that decode themselves reported "
                                             "decoding and writing, by preset", ["preset"], registry=r)
        self.bytes_written = Counter("kvfetcher_bytes_written_total", "Bytes written to the store", registry=r)
        self.compression_ratio = Gauge(
            "kvfetcher_compression_ratio", "KV bytes / stored bytes of the last chunk stored, by preset", ["preset"], registry=r
        )
        self.decode_rate = Gauge(
            "kvfetcher_decode_bytes_per_second", "KV bytes restored per second of decoding, last fetch, by preset", ["preset"], registry=r
        )
        self.decisions = Counter("kvfetcher_preset_decisions_total", "Fetch-time choices (a preset or recompute)", ["preset"], registry=r)
        self.predicted_seconds = Histogram(
            "kvfetcher_fetch_predicted_seconds", "Cost model's predicted fetch time of the chosen preset", buckets=_LATENCY, registry=r
        )
        self.actual_seconds = Histogram(
            "kvfetcher_fetch_actual_seconds", "Measured fetch time of fetches that ran a preset", buckets=_LATENCY, registry=r
        )
        self.last_predicted = Gauge("kvfetcher_fetch_last_predicted_seconds", "Predicted time of the last fetch", ["preset"], registry=r)
        self.last_actual = Gauge("kvfetcher_fetch_last_actual_seconds", "Actual time of the last fetch", ["preset"], registry=r)
        self.stage_in_flight = Gauge(
            "kvfetcher_fetch_stage_chunks_in_flight", "The last fetch's chunks in each step of their restore on average (stage: the "
            "step that ends there: admitted by the window, header, read, decoded, started by the thread that writes it, written); a step at its "
            "concurrency bounds the fetch",
            ["stage"], registry=r)
        self.stage_seconds = Gauge("kvfetcher_fetch_stage_median_seconds", "The last fetch's median seconds a chunk spent in each step "
                                   "of its restore (stage as in kvfetcher_fetch_stage_chunks_in_flight)", ["stage"], registry=r)
        self.fit = Gauge(
            "kvfetcher_cost_model_fit", "Scale of the cost model's fitted line, actual = scale * modelled + overhead (decayed, on this sidecar's store endpoint), by preset", ["preset"],
            registry=r,
        )
        self.fit_overhead = Gauge(
            "kvfetcher_cost_model_overhead_seconds", "Fixed seconds of the cost model's fitted line (pipeline fill and drain), by preset", ["preset"],
            registry=r,
        )
        self.fetch_ratio = Gauge(
            "kvfetcher_cost_model_ratio", "KV bytes per stored byte the cost model has learnt from this sidecar's fetches (decayed), by preset",
            ["preset"], registry=r,
        )
        self.prefill_model = Gauge(
            "kvfetcher_prefill_model", "The engine's prefill model as the last request that carried one gave it: seconds = c0 + c1 * new "
            "+ c2 * new * (cached + new / 2), by term", ["term"], registry=r,
        )
        self.load_overhead = Gauge("kvfetcher_load_overhead_seconds", "Seconds a load costs the engine beyond the fetch and the prefill "
                                   "after it, as the last lookup that carried it gave it: every load option pays it", registry=r)
        self.prefill_error = Gauge("kvfetcher_prefill_error_ratio", "How far the engine's prefill model was lately off its whole "
                                   "prefills, a share of their time, as the last lookup with a prefill model gave it: a load must beat "
                                   "recompute by more than this", registry=r)
        self.bandwidth = Gauge("kvfetcher_store_bandwidth_bytes_per_second", "Estimated read throughput by endpoint", ["endpoint"], registry=r)
        self.read_rate = Gauge("kvfetcher_store_read_rate_bytes_per_second", "Read rate the cost model plans a bitstream format's "
                               "fetches at (at most the link's ceiling after a slow, read-bound fetch), by endpoint and format",
                               ["endpoint", "format"], registry=r)
        self.fallbacks = Counter("kvfetcher_fallbacks_total", "Tokens-to-recompute outcomes, by reason", ["reason"], registry=r)
        self.errors = Counter("kvfetcher_errors_total", "Errors, by reason", ["reason"], registry=r)
        self.released_buffers = Counter("kvfetcher_released_buffers_total", "Registered buffers released because the process that "
                                        "registered them exited without unregistering (a crashed or restarted engine)", registry=r)
        self.warming = Gauge("kvfetcher_decode_warming", "1 while a registered buffer's warm-up holds the decode workers (auto then "
                             "considers only raw and recompute)", registry=r)
        self.warm_up_seconds = Gauge(
            "kvfetcher_decode_warm_up_seconds", "Seconds the slowest decode worker took to warm up at start", registry=r
        )
        self.store_up = Gauge(
            "kvfetcher_store_up", "1 when the store answered the sidecar's last check, 0 when it did not, NaN before the first (never the pod's readiness)",
            registry=r,
        )
        self.store_up.set(float("nan"))
        self.store_queue_depth = Gauge("kvfetcher_store_queue_depth", "Chunks waiting to be encoded and uploaded", registry=r)
        self.store_dropped_chunks = Counter(
            "kvfetcher_store_dropped_chunks_total", "Chunks of store requests dropped because the store queue was full", registry=r
        )

    def stages(self, summary: dict[str, dict[str, float]], names: tuple[str, ...]) -> None:
        """The last fetch's steps (:func:`~kvfetcher.fetch.executor.stage_summary`; ``names``: every
        step there is); a step it did not take (raw's decode) is no longer shown, rather than an
        earlier fetch's."""
        for stage in names:
            if stage in summary:
                self.stage_in_flight.labels(stage).set(summary[stage]["in_flight"])
                self.stage_seconds.labels(stage).set(summary[stage]["median_ms"] / 1e3)
            else:
                for g in (self.stage_in_flight, self.stage_seconds):
                    with contextlib.suppress(KeyError):
                        g.remove(stage)

    def link(self, endpoint: str, bandwidth: float, by_format: dict[str, float]) -> None:
        """Show the cost model's read rates of ``endpoint``: the link's, and each format's."""
        self.bandwidth.labels(endpoint).set(bandwidth)
        for fmt, rate in by_format.items():
            self.read_rate.labels(endpoint, fmt).set(rate)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
