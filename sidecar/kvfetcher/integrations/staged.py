"""Host staging: KV moved between the sidecar and a serving engine's paged blocks that the sidecar
cannot map, through a bounded flat buffer in host memory.

The engine process owns the blocks (a CPU cache no other process can map, or a GPU the sidecar
does not see: a device-plugin GPU given to the model container only). :class:`Staging` registers a
flat buffer ``[layers, 2, kv_heads, tokens, head_dim]`` (a memfd, :func:`kvfetcher.ipc.allocate`)
with the sidecar and copies between it and the blocks itself (on a GPU, host-to-device and back, on
its own CUDA stream). A fetch or store longer than the buffer goes through it in windows: each window
is one sidecar call of the prompt's tokens up to the window's end, with ``first_token`` at the
window's start and ``offset = -first_token`` (the window's first token in slot 0), so nothing of
the prompt's earlier tokens is fetched, written or read again.

Contracts: a fetch writes only tokens ``first .. end`` into the blocks, in whole blocks, and returns
the end of what it wrote (the caller recomputes the rest); a store has copied its blocks out before
it returns. Both hold the staging's lock: one fetch or store uses it at a time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace

import torch

from kvfetcher import ipc, kvbuffer
from kvfetcher.api.client import KVClient, SidecarError
from kvfetcher.fetch.plan import FetchOptions, FetchPlan

log = logging.getLogger("kvfetcher.integrations.staged")

COPY_BYTES = 64 << 20  # a copy between the staging and the blocks moves at most this much at once (its transient device tensor)


def register(client: KVClient, tensors: torch.Tensor | Sequence[torch.Tensor], layout: kvbuffer.PagedLayout, model: str, tp_rank: int,
             staging_tokens: int, staging: Staging | None = None) -> tuple[str, Staging | None, str]:
    """Register paged KV ``tensors`` with the sidecar: straight (CUDA IPC) where the sidecar opens
    them, else (host memory, or a sidecar answering ``no_device``) the host ``staging`` given, or a
    new one of ``staging_tokens`` slots. The buffer id, the staging (None: direct) and why this
    mode; a refusal other than ``no_device`` raises (:class:`SidecarError`, ``OSError``)."""
    if staging is None:
        t0 = tensors if isinstance(tensors, torch.Tensor) else tensors[0]
        if t0.device.type == "cuda":
            try:
                return client.register_paged(tensors, layout, model, tp_rank), None, "the sidecar opens the GPU KV blocks by CUDA IPC"
            except SidecarError as e:
                if not e.no_device:
                    raise
                why = f"the sidecar cannot open the GPU's memory ({e.detail})"
        else:
            why = "the KV cache is in host memory, which no other process can map"
        fresh = staging = Staging(tensors, layout, staging_tokens)
    else:
        fresh, why = None, "host staging, as before"
    try:
        return client.register(staging.handle, model, tp_rank), staging, why
    except BaseException:
        if fresh is not None:
            fresh.close()
        raise


class Staging:
    """A flat host buffer of ``tokens`` token slots for the paged KV ``tensors`` (as
    :class:`kvbuffer.PagedKV` sees them through ``layout``), and the windowed fetches and
    stores through it. ``handle`` is what the sidecar registers (:meth:`KVClient.register`)."""

    def __init__(self, tensors: torch.Tensor | Sequence[torch.Tensor], layout: kvbuffer.PagedLayout, tokens: int):
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"staging tokens must be a positive integer, not {tokens!r}")
        self.paged = kvbuffer.PagedKV(tensors, layout)
        L, H, D = self.paged.shape
        self.buffer = ipc.allocate((L, 2, H, tokens, D), self.paged.dtype)
        self.tokens, self.handle = tokens, self.buffer.handle
        self.lock = threading.Lock()
        self.stream = torch.cuda.Stream(self.paged.device) if self.paged.device.type == "cuda" else None
        bs = layout.block_size
        per_token = L * 2 * H * D * kvbuffer.bytes_per_value(self.paged.dtype)
        self.copy_tokens = max(bs, COPY_BYTES // per_token // bs * bs)
        self._warned = False

    def close(self) -> None:
        self.buffer.close()

    # --- fetches ---------------------------------------------------------------------------

    def fetch(self, client: KVClient, buffer: str, tokens: Sequence[int], block_ids: Sequence[int], first: int, end: int,
              plan: FetchPlan | None = None, options: FetchOptions | None = None) -> int:
        """Fetch tokens ``first .. end`` of ``tokens`` (``first`` whole blocks) into ``block_ids`` (the
        prompt's blocks from token 0) through the registered staging ``buffer``, window by window
        until one loads less than it asked for; the end of the tokens written (whole blocks, at
        least ``first``). ``plan`` (made for exactly ``tokens``) is used when one window holds
        them all; other windows look up with ``options`` (``options.deadline_s`` bounds the whole fetch)."""
        o = options or FetchOptions()
        bs, done, t0 = self.paged.layout.block_size, first, time.monotonic()
        with self.lock:
            while done < end:
                left = None if o.deadline_s is None else o.deadline_s - (time.monotonic() - t0)
                if left is not None and left <= 0:
                    break
                stop = min(len(tokens), done + self.tokens)
                use = plan if stop == len(tokens) else None  # a plan is bound to all of its tokens
                chosen = use is not None and use.preset is not None  # then only the deadline goes with it
                window = FetchOptions(deadline_s=left) if chosen else replace(o, deadline_s=left)
                reply = client.fetch(buffer, tokens[:stop], use, options=window, offset=-done, first_token=done)
                self._check_size(reply.chunk_tokens)
                upto = min(reply.loaded_tokens, end) // bs * bs
                if upto > done:
                    self._to_blocks(block_ids, done, upto)
                if upto <= done or reply.loaded_tokens < reply.requested_tokens:
                    return max(done, upto)
                done = upto
        return done

    def _to_blocks(self, block_ids: Sequence[int], start: int, end: int) -> None:
        """Copy tokens ``start .. end`` from the staging (token ``start`` in slot 0) into their blocks,
        finished when this returns."""
        with self._on_stream():
            for a in range(start, end, self.copy_tokens):
                b = min(end, a + self.copy_tokens)
                kv = self.buffer.tensor[:, :, :, a - start : b - start]
                self.paged.write(self.paged.blocks_of(block_ids, a, b - a), kv)
            self._sync()

    # --- stores ----------------------------------------------------------------------------

    def store(self, client: KVClient, buffer: str, tokens: Sequence[int], block_ids: Sequence[int], chunk_tokens: int) -> int:
        """Store ``tokens`` (whole chunks of ``chunk_tokens``) from ``block_ids`` through the staging
        ``buffer``, in windows of whole chunks, until the sidecar drops one (the store queue is
        full: later chunks would follow a gap); the chunks it took (queued, or stored already).
        Every block has been copied out when this returns."""
        window = self.tokens // chunk_tokens * chunk_tokens
        if not window:
            self._check_size(chunk_tokens)
            return 0
        taken = 0
        with self.lock:
            for a in range(0, len(tokens) // chunk_tokens * chunk_tokens, window):
                b = min(len(tokens), a + window)
                self._from_blocks(block_ids, a, b)
                rep = client.store(buffer, tokens[:b], offset=-a, first_token=a)
                taken = rep.queued_chunks + rep.skipped_chunks
                if rep.dropped_chunks or rep.dropped:
                    break
        return taken

    def _from_blocks(self, block_ids: Sequence[int], start: int, end: int) -> None:
        """Copy tokens ``start .. end`` from their blocks into the staging (token ``start`` in slot 0)."""
        with self._on_stream():
            for a in range(start, end, self.copy_tokens):
                b = min(end, a + self.copy_tokens)
                self.buffer.tensor[:, :, :, a - start : b - start].copy_(self.paged.read(self.paged.blocks_of(block_ids, a, b - a)))
            self._sync()

    # --- helpers ---------------------------------------------------------------------------

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def _sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def _check_size(self, chunk_tokens: int | None) -> None:
        if chunk_tokens and self.tokens < chunk_tokens and not self._warned:
            self._warned = True
            log.warning("kvfetcher: the staging buffer of %d tokens holds no whole chunk of %d tokens: nothing is fetched or stored "
                        "through it; raise staging_tokens", self.tokens, chunk_tokens)
