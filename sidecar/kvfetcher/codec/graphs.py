"""graphs: a quantised chunk's pack on a GPU, replayed from a CUDA graph.

The pack of a quantised layout is about a hundred small GPU operations launched one by one from
Python: the launches can take longer than the GPU takes to run them, and the store's encode
threads share one GIL (docs/architecture.md, "Store-time encode", has the figures). So the second time a chunk of
one kind (device, shape, dtype, layout) is packed, the pack is captured into a CUDA graph, and
later chunks of that kind replay it: the chunk is copied into the graph's own input and its first
position into a device scalar, and one call launches the rest. The objects are the same byte for
byte.

A graph's tensors are reused, so :func:`packed` lends one for a ``with`` block: its result is
valid inside the block only. Graphs are shared by all threads, one user at a time each; at most
``KVFETCHER_ENCODE_GRAPHS`` exist (each holds GPU memory for its intermediates, many times the
chunk's size); with none free for a chunk's kind, or where a capture fails, a chunk is packed
eagerly.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvfetcher import config
from kvfetcher.codec import layout
from kvfetcher.codec.params import LayoutParams

log = logging.getLogger(__name__)

_lock = threading.Lock()  # the state below
_capturing = threading.Lock()  # one capture at a time
_idle: dict[tuple, list[_Graph]] = {}  # free graphs by kind
_alive = 0  # graphs made (lent or idle)
_seen: set[tuple] = set()  # kinds packed once (the next one is captured)
_failed: set[tuple] = set()  # kinds whose capture failed: packed eagerly from then on


@dataclass
class _Graph:
    kv: torch.Tensor  # the graph's input: each chunk is copied here
    start: torch.Tensor  # the chunk's first position, float64, 0-dim
    graph: torch.cuda.CUDAGraph
    out: layout.Packed
    free: torch.cuda.Event = field(default_factory=torch.cuda.Event)  # the last user is done with ``out``


def enabled(kv: torch.Tensor, params: LayoutParams) -> bool:
    """Whether :func:`packed` may replay ``kv``'s pack: a CUDA chunk, a quantised layout (the
    others are one or two operations), and graphs allowed (``KVFETCHER_ENCODE_GRAPHS`` > 0)."""
    return kv.is_cuda and params.mode == "quant" and config.ENCODE_GRAPHS.read() > 0


@contextlib.contextmanager
def packed(kv: torch.Tensor, params: LayoutParams, start: int = 0) -> Iterator[layout.Packed]:
    """:func:`layout.pack` of ``kv`` for the ``with`` block, replayed from a graph of its kind where
    one is free or can be made; the work is ordered on the current stream."""
    kind = (kv.device, tuple(kv.shape), kv.dtype, params)
    g = _take(kind, kv, params) if enabled(kv, params) else None
    if g is None:
        yield layout.pack(kv, params, start)
        return
    stream = torch.cuda.current_stream(kv.device)
    try:
        stream.wait_event(g.free)
        g.kv.copy_(kv)
        g.start.fill_(start)
        g.graph.replay()
        yield g.out
    finally:
        g.free.record(stream)
        with _lock:
            _idle.setdefault(kind, []).append(g)


def _take(kind: tuple, kv: torch.Tensor, params: LayoutParams) -> _Graph | None:
    """An idle graph of ``kind``; or a new one from its second chunk on, while fewer than the
    allowed number exist (graphs are kept: a sidecar packs a few kinds, and a capture waits for
    the whole GPU); else None."""
    global _alive
    with _lock:
        if _idle.get(kind):
            return _idle[kind].pop()
        if kind in _failed or kind not in _seen:
            if len(_seen) >= 256:
                _seen.clear()  # a bound on what is remembered
            _seen.add(kind)
            return None
        if _alive >= config.ENCODE_GRAPHS.read():
            return None  # as many graphs as allowed, none of them free for this kind: packed eagerly
        _alive += 1
    try:
        with _capturing:
            return _capture(kv, params)
    except RuntimeError as e:  # an operation the capture refuses: this kind stays eager
        with _lock:
            _alive -= 1
            _failed.add(kind)
        log.warning("packing %s chunks of %s eagerly: capturing the pack failed: %s", params.mode, tuple(kv.shape), e)
        return None


def _capture(kv: torch.Tensor, params: LayoutParams) -> _Graph:
    """Capture ``kv``'s pack after one eager run on the capture's stream (which makes the tables
    the pack caches and compiles its kernels: a capture may do neither)."""
    static = kv.clone()
    start = torch.zeros((), dtype=torch.float64, device=kv.device)
    stream = torch.cuda.Stream(kv.device)
    stream.wait_stream(torch.cuda.current_stream(kv.device))
    with torch.cuda.stream(stream):
        layout.pack(static, params, start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        out = layout.pack(static, params, start)
    torch.cuda.current_stream(kv.device).wait_stream(stream)
    return _Graph(static, start, graph, out)
