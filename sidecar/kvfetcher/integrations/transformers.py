"""Hugging Face transformers with remote KV reuse: fetch -> build the cache -> generate the rest.

:class:`CachedLM` wraps a loaded causal LM and a :class:`~kvfetcher.api.client.KVClient`. For each
prompt it looks up (the sidecar's listing and cost model give a plan), has the sidecar fetch what the plan
says into a shared KV buffer, builds a ``DynamicCache`` from it, prefills only the remaining tokens, and after that
prefill hands the prompt's KV back to the sidecar to store. The buffer is in the storage dtype
(fp16 by default, what a GPU server's cache holds); the model may run in another dtype.

A model on the CPU needs a client on the sidecar's Unix socket: its buffer is a sealed memfd whose
fd is passed at registration (:mod:`kvfetcher.ipc`); on a GPU either transport registers it.

The last prompt token is always computed (its logits give the first new token), so at most
``len(prompt) - 1`` tokens are fetched.

Hybrid attention (Gemma 3: sliding-window layers beside full ones): a stored chunk holds every
layer's KV of all its tokens, sliding-window layers included, because a chunk serves any later
prefix that contains it, and a reader continuing after ``N`` tokens needs each sliding layer's last
``window`` tokens before ``N`` — tokens a writer whose prompt ran further had already dropped. So
the cache built here keeps every token of every layer (a ``DynamicCache`` without the model's
config; the model's masks still restrict each sliding layer to its window, and its tokens match
those of the model's own cache), and stores and restores all of them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kvfetcher import ipc
from kvfetcher.api.client import KVClient, SidecarError
from kvfetcher.api.schemas import StoreReply
from kvfetcher.fetch.plan import FetchOptions, FetchReply
from kvfetcher.fetch.prefill import PrefillFit, terms

log = logging.getLogger("kvfetcher.integrations.transformers")


@dataclass
class Generation:
    tokens: list[int]
    ttft_s: float  # request start -> first new token (lookup + fetch + prefill of the rest)
    loaded_tokens: int  # prompt tokens restored from the store
    computed_tokens: int  # prompt tokens prefilled by the model
    fetch: FetchReply | None  # the sidecar's answer, when a fetch was attempted
    store: StoreReply | None  # the sidecar's answer to the store request


def _layer_kv(cache, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


class CachedLM:
    def __init__(
        self,
        model: torch.nn.Module,
        fingerprint: str,
        client: KVClient,
        capacity_tokens: int = 4096,
        kv_dtype: torch.dtype = torch.float16,
        tp_rank: int = 0,
        recompute_tps: float | None = None,
        prefill: PrefillFit | None = None,
    ):
        cfg = model.config
        heads = cfg.num_key_value_heads or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.model, self.client = model, client
        self.layers = cfg.num_hidden_layers
        self.capacity = capacity_tokens
        device = next(model.parameters()).device
        self.buffer = ipc.allocate((self.layers, 2, heads, capacity_tokens, head_dim), kv_dtype, device)
        self.buffer_id = client.register(self.buffer.handle, fingerprint, tp_rank)
        #: the model's prefill time, told to the sidecar's cost model: a constant rate (tokens/s) until
        #: ``prefill`` (another instance's of this model, or a new one) is fitted to the prefills timed here
        self.recompute_tps, self.prefill = recompute_tps, prefill or PrefillFit()

    def close(self) -> None:
        try:
            self.client.unregister(self.buffer_id)
        finally:
            self.buffer.close()

    @torch.inference_mode()
    def generate(self, ids: torch.Tensor, n_new: int = 32, *, store: bool = True, deadline_s: float | None = None) -> Generation:
        """Greedy generation of ``n_new`` tokens after ``ids`` (1-D token ids), reusing stored KV."""
        from transformers import DynamicCache

        t0 = time.perf_counter()
        prompt = [int(x) for x in ids]
        usable = min(len(prompt) - 1, self.capacity)
        loaded, fetched = 0, None
        try:
            if usable > 0:  # the lookup lists what the sidecar's index lacks (not when no fetch could pay); the fetch does not
                plan = self.client.lookup(self.buffer_id, prompt[:usable], FetchOptions(
                    recompute_tokens_per_s=self.recompute_tps, prefill_model=self.prefill.model(), deadline_s=deadline_s, refresh=True))
                fetched = self.client.fetch(self.buffer_id, prompt[:usable], plan, options=FetchOptions(deadline_s=deadline_s))
                loaded = fetched.loaded_tokens
        except (OSError, SidecarError) as e:  # no sidecar is no reason to fail a request: recompute
            log.warning("KV fetch failed, recomputing the prompt: %s", e)
        dtype = next(self.model.parameters()).dtype
        cache = DynamicCache()  # every layer keeps every token (module doc: hybrid attention)
        if loaded:
            for i in range(self.layers):
                kv = self.buffer.tensor[i, :, :, :loaded].to(dtype)
                cache.update(kv[0].unsqueeze(0), kv[1].unsqueeze(0), i)
        t_prefill = time.perf_counter()
        out = self.model(ids[loaded:].unsqueeze(0), past_key_values=cache, use_cache=True)
        tok = int(torch.argmax(out.logits[0, -1]))
        ttft = time.perf_counter() - t0
        computed = len(prompt) - loaded
        if computed >= 64:  # a few tokens measure overheads, not the prefill time
            self.prefill.observe(*terms([(loaded, computed)]), time.perf_counter() - t_prefill)

        stored = None
        chunk = self.client.chunk_tokens or 1
        n_store = min(len(prompt), self.capacity) // chunk * chunk
        if store and n_store > loaded:  # after prefill: hand the prompt's KV to the sidecar
            cache_kv = out.past_key_values
            for i in range(self.layers):
                k, v = _layer_kv(cache_kv, i)
                self.buffer.tensor[i, 0, :, :n_store] = k[0, :, :n_store]
                self.buffer.tensor[i, 1, :, :n_store] = v[0, :, :n_store]
            if self.buffer.tensor.is_cuda:  # the sidecar (another process) copies it next
                torch.cuda.synchronize(self.buffer.tensor.device)
            try:
                stored = self.client.store(self.buffer_id, prompt[:n_store])
            except (OSError, SidecarError) as e:
                log.warning("KV store request failed (the answer is unaffected): %s", e)

        tokens = [tok]
        cache = out.past_key_values
        for _ in range(n_new - 1):
            nxt = torch.tensor([[tokens[-1]]], device=ids.device)
            cache_out = self.model(nxt, past_key_values=cache, use_cache=True)
            cache = cache_out.past_key_values
            tokens.append(int(torch.argmax(cache_out.logits[0, -1])))
        return Generation(tokens, ttft, loaded, computed, fetched, stored)
