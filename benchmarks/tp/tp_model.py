"""tp_model: the Llama-shaped model of ``benchmarks.lib.llama_shape`` split across tensor-parallel ranks.

Megatron-style, by heads: rank ``r`` of ``W`` holds its ``heads / W`` query heads and ``kv_heads /
W`` KV heads (q, k, v columns and the matching rows of ``o``) and ``1 / W`` of the MLP (gate and
up columns, down rows); the outputs of ``o`` and ``down`` are all-reduced, two all-reduces per
layer. Embedding and LM head are replicated (one token's head; their cost is the same on every
rank). Random weights: only the shape matters for time. The KV a rank writes is its shard,
``[layers, 2, kv_heads / W, tokens, head_dim]``: what its sidecar stores and fetches.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from benchmarks.lib.llama_shape import LlamaShape, ModelShape, full_depth, subset


def shard(shape: ModelShape, world: int) -> ModelShape:
    """One rank's part of ``shape`` split ``world`` ways by heads."""
    if shape.kv_heads % world or shape.heads % world or shape.intermediate % world:
        raise ValueError(f"{shape.name}: {shape.kv_heads} KV heads, {shape.heads} heads and {shape.intermediate} MLP "
                         f"columns do not split {world} ways")
    return dataclasses.replace(shape, heads=shape.heads // world, kv_heads=shape.kv_heads // world,
                               intermediate=shape.intermediate // world)


class TPLlama(LlamaShape):
    """This process' rank of a ``world``-way tensor-parallel ``shape`` (the process group must be up)."""

    def __init__(self, shape: ModelShape, world: int, device: str | torch.device, dtype: torch.dtype = torch.bfloat16):
        super().__init__(shard(shape, world), device, dtype, seed=dist.get_rank())

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(partial)
        return partial


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_prefill(model: TPLlama, tokens: int, repeats: int) -> float:
    """The group's prefill of ``tokens`` tokens: best of ``repeats``, each the slowest rank's time."""
    s = model.shape
    kv = torch.empty((s.layers, 2, s.kv_heads, tokens, s.head_dim), dtype=model.dtype, device=model.device)
    ids = torch.randint(0, s.vocab, (tokens,), generator=torch.Generator().manual_seed(tokens)).to(model.device)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        model.prefill(ids, kv)
        _sync(model.device)
        took = torch.tensor([time.perf_counter() - t], dtype=torch.float64, device=model.device)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        best = min(best, took.item())
    return best


def recompute_seconds(shape: ModelShape, world: int, depths: tuple[int, int], contexts: list[int], device: torch.device,
                      dtype: torch.dtype) -> tuple[dict[int, float], dict]:
    """The full-depth tensor-parallel prefill time per context, from two subset depths (``full_depth``),
    and the subset times themselves."""
    sweep: dict = {}
    for k in depths:
        model = TPLlama(subset(shape, k), world, device, dtype)
        time_prefill(model, min(2048, contexts[0]), 1)  # kernels, allocator, communicators
        sweep[k] = {T: time_prefill(model, T, 2 if T <= 32768 else 1) for T in contexts}
        if dist.get_rank() == 0:
            print(f"prefill TP{world} layers={k}: " + ", ".join(f"{T}: {v:.3f} s" for T, v in sweep[k].items()), flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return full_depth(shape, sweep), sweep
