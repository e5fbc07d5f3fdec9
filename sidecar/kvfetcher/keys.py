"""keys: chained prefix keys for chunks of a prompt.

A chunk's key is ``sha256(parent key || its token ids)``, and the first parent is the hash
of a namespace (model fingerprint, KV dtype, layout version, tensor-parallel rank, tenant
salt, the KV geometry ``(layers, kv_heads, head_dim)``) and the chunk size. So a key names a
chunk *and everything before it*: two prompts share a key exactly when they share the whole
prefix up to that chunk, in the same model, tenant and geometry. Buffers of different shapes
therefore never share an object: a chunk that does not fit its reader's buffer is that reader's
miss, never a bad object. Token ids
are hashed as little-endian int64 bytes — never Python's ``hash()``, which is salted per
process — so keys agree across processes and machines.

Only complete chunks get keys: a partial tail is cheap to recompute and rarely shared.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from kvfetcher.codec.params import LAYOUT_VERSION
from kvfetcher.config import CHUNK_TOKENS

DEFAULT_CHUNK_TOKENS: int = CHUNK_TOKENS.default


@dataclass(frozen=True)
class Namespace:
    """What must match for a stored chunk to be usable by a reader."""

    model: str
    dtype: str
    layout_version: int = LAYOUT_VERSION
    tp_rank: int = 0
    tenant: str = ""
    shape: tuple[int, ...] = ()  # (layers, kv_heads, head_dim) of the KV buffer; the sidecar always sets it

    def root(self, chunk_tokens: int) -> str:
        """The parent key of a prompt's first chunk, for chunks of ``chunk_tokens`` tokens."""
        canon = json.dumps({**asdict(self), "chunk_tokens": chunk_tokens}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(b"kvfetcher/ns\0" + canon.encode()).hexdigest()


def chunk_keys(ns: Namespace, tokens: Sequence[int], chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> list[str]:
    """Keys of the complete chunks of ``tokens``, first chunk first."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, not {chunk_tokens}")
    ids = np.asarray(tokens, dtype="<i8")
    if ids.ndim != 1:
        raise ValueError(f"tokens must be a flat sequence of ids, got shape {ids.shape}")
    keys, parent = [], ns.root(chunk_tokens)
    for start in range(0, len(ids) - chunk_tokens + 1, chunk_tokens):
        h = hashlib.sha256(bytes.fromhex(parent))
        h.update(ids[start : start + chunk_tokens].tobytes())
        parent = h.hexdigest()
        keys.append(parent)
    return keys


def object_name(key: str, preset: str) -> str:
    """Where one representation of a chunk lives; all of a chunk's representations share a prefix."""
    return f"{chunk_prefix(key)}{preset}.kvfc"


def chunk_prefix(key: str) -> str:
    return f"kv/{key[:2]}/{key}/"


def preset_of(name: str) -> str:
    """Inverse of :func:`object_name` for the last path element."""
    leaf = name.rsplit("/", 1)[-1]
    if not leaf.endswith(".kvfc"):
        raise ValueError(f"not a chunk object name: {name!r}")
    return leaf[: -len(".kvfc")]
