"""config: the sidecar's settings, read once from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvfetcher import keys
from kvfetcher.format.presets import PRESETS


@dataclass
class Config:
    """Sidecar settings. From the environment (:meth:`from_env`): ``KVFETCHER_CHUNK_TOKENS``,
    ``KVFETCHER_PRESET`` (comma-separated: every listed representation is stored),
    ``KVFETCHER_ALLOWED_PRESETS`` (what a fetch may choose among), ``KVFETCHER_TENANT`` (key salt;
    defaults to ``KVFETCHER_POOL``), ``KVFETCHER_RECOMPUTE_TPS``, ``KVFETCHER_ROPE_THETA`` (for pre-RoPE presets),
    ``KVFETCHER_TTFT_BUDGET_S`` (prefer a fetch within this TTFT to a faster recompute: see :mod:`choice`),
    ``KVFETCHER_WARM_UP`` (``0``: decode workers meet CUDA, NVDEC and a registered buffer on the first fetch)."""

    chunk_tokens: int = keys.DEFAULT_CHUNK_TOKENS
    presets: tuple[str, ...] = ("q8",)  # representations written for each chunk
    allowed_presets: tuple[str, ...] | None = None  # representations a fetch may use (None: any known)
    tenant: str = ""
    recompute_tps: float = 5000.0  # model prefill rate when a request does not say
    rope_theta: float | None = None  # the model's RoPE base: needed to store pre-RoPE presets
    deadline_s: float = 30.0  # default fetch deadline
    ttft_budget_s: float | None = None  # default TTFT budget (None: the fastest option wins)
    store_queue_chunks: int = 256  # bound of the store queue, in chunks
    decode_workers: int = 2
    decode_procs: int = 8 if torch.cuda.is_available() else 0
    device: str = "cuda" if torch.cuda.is_available() else "cpu"  # where the KV buffers live: decode workers warm up there
    # decode workers: restore a tiny chunk of each served preset at start, map a buffer when it is registered
    warm_up: bool = True
    io_workers: int = 32
    window: int = 4  # chunks in flight per fetch

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Config":
        env = dict(os.environ if env is None else env)
        c = cls()
        if env.get("KVFETCHER_CHUNK_TOKENS"):
            c.chunk_tokens = int(env["KVFETCHER_CHUNK_TOKENS"])
        names = lambda v: tuple(p.strip() for p in v.split(",") if p.strip())  # noqa: E731
        if env.get("KVFETCHER_PRESET") and env["KVFETCHER_PRESET"] != "auto":  # auto: the default set
            c.presets = names(env["KVFETCHER_PRESET"])
        if env.get("KVFETCHER_ALLOWED_PRESETS"):
            c.allowed_presets = names(env["KVFETCHER_ALLOWED_PRESETS"])
        c.tenant = env.get("KVFETCHER_TENANT", env.get("KVFETCHER_POOL", ""))
        if env.get("KVFETCHER_RECOMPUTE_TPS"):
            c.recompute_tps = float(env["KVFETCHER_RECOMPUTE_TPS"])
        if env.get("KVFETCHER_ROPE_THETA"):
            c.rope_theta = float(env["KVFETCHER_ROPE_THETA"])
        if env.get("KVFETCHER_DECODE_PROCS"):
            c.decode_procs = int(env["KVFETCHER_DECODE_PROCS"])
        if env.get("KVFETCHER_TTFT_BUDGET_S"):
            c.ttft_budget_s = float(env["KVFETCHER_TTFT_BUDGET_S"])
        if env.get("KVFETCHER_WARM_UP"):
            c.warm_up = env["KVFETCHER_WARM_UP"].strip().lower() not in ("0", "false", "no", "off")
        c.validate()
        return c

    def validate(self) -> None:
        if self.chunk_tokens <= 0:
            raise ValueError(f"chunk tokens must be positive, not {self.chunk_tokens}")
        if self.decode_procs < 0:
            raise ValueError(f"decode processes must be >= 0, not {self.decode_procs}")
        if self.ttft_budget_s is not None and not self.ttft_budget_s > 0:
            raise ValueError(f"the TTFT budget must be positive seconds, not {self.ttft_budget_s}")
        unknown = [p for p in self.presets + (self.allowed_presets or ()) if p not in PRESETS]
        if unknown or not self.presets:
            raise ValueError(f"unknown preset(s) {unknown}; known: {', '.join(PRESETS)}")
        need_theta = [p for p in self.presets if PRESETS[p].pre_rope]
        if need_theta and self.rope_theta is None:
            raise ValueError(f"preset(s) {need_theta} quantise keys before RoPE: set KVFETCHER_ROPE_THETA")
