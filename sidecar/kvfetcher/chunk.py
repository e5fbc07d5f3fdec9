"""chunk: the whole path for one chunk — pack, encode, wrap; and verify, decode, unpack.

This is the seam between the pure parts (layout, container) and the codec backends.
:func:`restore_chunk` is the one restore of a chunk into a KV :class:`Destination`: a whole
object in memory (:func:`restore_object`: :func:`decode_chunk`, and a serving engine decoding the
objects its sidecar verified, engine-decode mode), a decode worker's request and the fetch
executor's in-process path all go through it (the executor calls its two halves,
:func:`verify_and_decode` then :meth:`Decoded.write`, so that a fetch given up on between them
writes nothing; for parts it read and checked itself, :func:`decode_verified` then the write).
An entropy-coded chunk is unpacked into a GPU buffer on a stream of the writing thread's own, so
that threads restoring chunks side by side do not wait for each other's kernels.

Checks before a byte reaches a buffer: every part's CRC-32 and, with an
:class:`~format.mac.ObjectMAC` (``auth``), its tag; and no NaN or infinity where one can come
from the object — the side information's ranges and exact rows (quantised layouts compute every
value from them and from 8-bit samples) and the whole payload of the lossless layouts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvfetcher.codec import basis, graphs, layout, rope
from kvfetcher.codec.params import LayoutParams
from kvfetcher import codec
from kvfetcher.codec.entropy import host_bytes
from kvfetcher.format import container
from kvfetcher.format.mac import ObjectMAC
from kvfetcher.format.presets import Preset, get
from kvfetcher.kvbuffer import ChunkRef, Destination, bytes_per_value, dtype_name, to_device

Bytes = bytes | memoryview  # a part's stored bytes as read (a worker reads them in place from shared memory)
#: threads that compress chunks' side information while their encoders code the planes (zstd
#: releases the GIL; an 8B model's chunk has hundreds of KB of it, milliseconds of one core)
SIDE_THREADS = 4


def encode_chunk(
    kv: torch.Tensor,
    preset: Preset | str,
    fingerprint: str,
    meta: dict | None = None,
    start: int = 0,
    rope_theta: float | Sequence[float] | None = None,
    auth: ObjectMAC | None = None,
) -> bytes:
    """KV ``[layers, 2, kv_heads, tokens, head_dim]`` -> one self-describing stored object.

    ``kv`` may be on a GPU: the layout packs it there, and an entropy format codes it there too
    (only the coded bytes reach the host).
    ``start`` is the chunk's first token position; ``rope_theta`` the model's RoPE base (or one
    per layer), needed by presets that quantise keys before RoPE unless the model's calibration
    gives its bases (which then win); the header records them. A preset given by name is the one
    for this model (``presets.get(name, fingerprint)``, which refuses a preset the model may not
    use). With ``auth`` (the object key and the name the object will be stored at) the object
    carries its tags. A basis not made for this model and shape is refused (``ValueError``).
    """
    return encode_chunks([ToEncode(kv, start, meta, auth)], preset, fingerprint, rope_theta)[0]


@dataclass(frozen=True)
class ToEncode:
    """One chunk for :func:`encode_chunks`: its KV, first token's position, object metadata and tags' key."""

    kv: torch.Tensor
    start: int = 0
    meta: dict | None = None
    auth: ObjectMAC | None = None


def encode_chunks(chunks: Sequence[ToEncode], preset: Preset | str, fingerprint: str,
                  rope_theta: float | Sequence[float] | None = None) -> list[bytes]:
    """:func:`encode_chunk` of each chunk (all on one device), the same objects; where the format's
    encoder codes parts together (nvCOMP: one launch and one wait), every chunk's planes in one
    call, which spreads an encode's fixed host work (under the GIL) over the chunks."""
    if not chunks:
        return []
    device = chunks[0].kv.device
    if any(c.kv.device != device for c in chunks):
        raise ValueError(f"chunks coded together must be on one device, not {sorted({str(c.kv.device) for c in chunks})}")
    p = get(preset, fingerprint) if isinstance(preset, str) else preset
    if p.pre_rope and p.layout.rope_theta is None and rope_theta is None:
        raise ValueError(f"preset {p.name!r} quantises keys before RoPE: give the model's rope_theta")
    theta = rope_theta if rope_theta is None or isinstance(rope_theta, (int, float)) else tuple(rope_theta)
    layouts = [_chunk_layout(p, theta, c.start > 0, c.kv.shape[0]) for c in chunks]
    for c, lp in zip(chunks, layouts):
        if lp.basis is not None and not basis.fits(lp.basis, tuple(c.kv.shape), fingerprint):
            raise ValueError(f"basis {lp.basis!r} of preset {p.name!r} was not made for model {fingerprint!r} "
                             f"with KV of {tuple(c.kv.shape)}: calibrate this model")
    if device.type == "cuda":  # on this thread's stream: encode threads' kernels do not queue behind each other's
        thread_stream(device).wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(thread_stream(device)) if device.type == "cuda" else contextlib.nullcontext(), \
            contextlib.ExitStack() as lent:
        packs = _pack_all(chunks, layouts, lent)
        enc = codec.encoder(p.codec.format, packs[0][0].device)
        spans = [_segments(p, frames) for frames, _, _ in packs]
        coded = iter(codec.encode_parts(enc, [f[a:b] for (f, _, _), s in zip(packs, spans) for a, b in s], p.codec))
    objects = []
    for c, lp, (_, geometry, side), s in zip(chunks, layouts, packs, spans):
        fields = {
            "fingerprint": fingerprint,
            "dtype": dtype_name(c.kv.dtype),
            "shape": list(c.kv.shape),
            "preset": p.name,
            "layout": lp.to_dict(),
            "start": c.start,
            "codec": p.codec.to_dict(),
            "frame_shape": list(geometry.frame_shape),
            "meta": dict(c.meta or {}, encoder=enc.name),
        }
        segments = [(span, next(coded)) for span in s]
        objects.append(container.build(fields, side.result() if side is not None else None, segments, c.auth))
    return objects


def _pack_all(chunks: Sequence[ToEncode], layouts: list[LayoutParams], lent: contextlib.ExitStack) -> list[tuple]:
    """Each chunk packed (:func:`graphs.packed`): its frames, geometry and side information's future.
    One chunk's frames are its graph's own, lent until ``lent`` closes; of several, copies on the
    current stream (each graph given back at once, so that one serves them all in turn)."""
    out = []
    for c, lp in zip(chunks, layouts):
        with contextlib.ExitStack() as mine:
            packed = mine.enter_context(graphs.packed(c.kv, lp, c.start))
            side = _side_later(packed.side)
            if len(chunks) == 1:
                frames = packed.frames
                lent.enter_context(mine.pop_all())
            else:
                frames = packed.frames.clone()
        out.append((frames, packed.geometry, side))
    return out


def _segments(p: Preset, frames: torch.Tensor) -> list[tuple[int, int]]:
    """The frame ranges ``[a, b)`` of a chunk's independently decodable segments under ``p``."""
    n = frames.shape[0]
    step = max(1, p.segment_bytes // frames[0].numel() if p.segment_bytes else p.segment_frames)
    return [(a, min(a + step, n)) for a in range(0, n, step)]


@functools.lru_cache(maxsize=256)
def _chunk_layout(p: Preset, rope_theta: float | tuple[float, ...] | None, later: bool, layers: int) -> LayoutParams:
    """The layout a chunk of ``p`` with ``layers`` layers is packed with: the model's RoPE base(s)
    where the preset quantises keys before RoPE, no exact tokens past a prompt's first chunk where
    the preset keeps only the sink's (``later``). Made once per kind: a chunk's encode holds the GIL
    for every Python step."""
    lp = p.layout
    if p.pre_rope and lp.rope_theta is None:
        lp = dataclasses.replace(lp, rope_theta=rope.compact(rope.per_layer(rope_theta, layers)))
    if p.sink_exact_only and later:
        lp = dataclasses.replace(lp, exact_tokens=0)
    return lp


_side_pool: tuple[int, ThreadPoolExecutor] | None = None
_side_lock = threading.Lock()


def _side_later(side: torch.Tensor | None) -> Future | None:
    """A chunk's side information as stored (:func:`container.side_bytes`), compressed on a thread
    of a small shared pool while the calling thread codes the planes; a GPU tensor is copied out on
    the current stream first (into page-locked memory; the pool's thread waits for the copy)."""
    global _side_pool
    if side is None:
        return None
    if side.is_cuda:
        host = torch.empty(side.shape, dtype=side.dtype, pin_memory=True)
        host.copy_(side, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        job = lambda: (copied.synchronize(), container.side_bytes(host))[1]  # noqa: E731
    else:
        job = functools.partial(container.side_bytes, side.clone())
    with _side_lock:
        if _side_pool is None or _side_pool[0] != os.getpid():  # (a forked child has no threads of it)
            _side_pool = os.getpid(), ThreadPoolExecutor(SIDE_THREADS, thread_name_prefix="kvfetcher-side")
        return _side_pool[1].submit(job)


def decode_chunk(
    obj: bytes,
    expected_fingerprint: str | None = None,
    device: torch.device | str = "cpu",
    out: torch.Tensor | None = None,
    backend: str | None = None,
    auth: ObjectMAC | None = None,
) -> torch.Tensor:
    """A whole stored object -> KV on ``device`` (or written into ``out``, which it returns).

    A bad object raises a :class:`container.ContainerError` and leaves ``out`` unchanged
    (:func:`restore_chunk`); so does an ``out`` not of the chunk's shape and dtype. With ``auth``
    the object must be authenticated for the name it names.
    """
    if out is None:
        h = container.parse_header(obj, auth)
        out = torch.empty(h.shape, dtype=h.torch_dtype, device=device)
    restore_object(Destination(out, tokens=out.shape[3]), ChunkRef("", len(obj), 0, out.shape[3]), obj, expected_fingerprint,
                   device=device, backend=backend, auth=auth)
    return out


def restore_object(dest: Destination, ref: ChunkRef, obj: Bytes, fingerprint: str | None, *, device: torch.device | str | None = None,
                   backend: str | None = None, auth: ObjectMAC | None = None) -> tuple[container.Header, int]:
    """One whole stored object (bytes, or a view of shared memory) restored into ``ref``'s slots of
    ``dest``: its header parsed and checked (``fingerprint``, size), then :func:`restore_chunk`
    (every part verified before the first write). Its header and the KV bytes written."""
    h = container.parse_header(obj, auth)
    container.check_fingerprint(h, fingerprint)
    container.check_size(h, len(obj))
    mem = memoryview(obj)
    part = lambda s: mem[h.header_size + s.offset : h.header_size + s.offset + s.length]  # noqa: E731
    side = part(h.side) if h.side else None
    return h, restore_chunk(dest, ref, h, side, [part(s) for s in h.segments], device=device, backend=backend, auth=auth)


@dataclass(frozen=True)
class Decoded:
    """A chunk whose side information and segments all verified and decoded: nothing of it has
    reached a KV buffer yet."""

    header: container.Header
    frames: torch.Tensor  # uint8 frames of every segment, in order
    side: torch.Tensor | None
    values: torch.Tensor | None = None  # a lossless layout's KV, already checked finite
    ready: torch.cuda.Event | None = None  # GPU frames and side information: when their decode is done (not waited for)

    def write(self, dest: Destination, ref: ChunkRef) -> int:
        """Unpack into the chunk's slots of ``dest`` (its view in place, its paged blocks in place,
        or a scatter), then :meth:`Destination.finish`; returns the KV bytes written.
        ``dest.check`` must have passed."""
        h = self.header
        if self.values is not None:
            dest.write_kv(ref, self.values)
            return math.prod(h.shape) * bytes_per_value(h.torch_dtype)
        own = h.codec.format in codec.ENTROPY_FORMATS and dest.device.type == "cuda"
        if self.ready is not None:
            (thread_stream(dest.device) if own else torch.cuda.current_stream(self.frames.device)).wait_event(self.ready)
        with torch.cuda.stream(thread_stream(dest.device)) if own else contextlib.nullcontext():
            frames = self.frames.to(dest.device)
            unpack = functools.partial(layout.unpack, frames, self.side, h.shape, h.torch_dtype, h.layout, start=h.start)
            place = dest.view(ref)
            if place is None:
                place = dest.block_write(ref)
            if place is not None:
                unpack(out=place)
            else:
                dest.scatter(ref, unpack())
            dest.finish()  # (waits for this stream: the chunk is in the buffer)
        return math.prod(h.shape) * bytes_per_value(h.torch_dtype)


_local = threading.local()


def thread_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's own stream on ``device``: for its writes into KV buffers and its encodes."""
    streams = getattr(_local, "streams", None)
    if streams is None:
        streams = _local.streams = {}
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def verify_and_decode(h: container.Header, side: Bytes | None, segments: Sequence[Bytes | torch.Tensor],
                      device: torch.device | str = "cpu", backend: str | None = None,
                      auth: ObjectMAC | None = None, trusted: bool = True) -> Decoded:
    """Check the checksum (and with ``auth`` the tag) of the side information and of every segment,
    then :func:`decode_verified`. Raises a :class:`container.ContainerError` for a bad part; touches
    no buffer. ``h`` was parsed with the same ``auth``; ``side`` and ``segments`` are the parts'
    stored bytes, unverified, in header order; ``trusted`` as :func:`decode_verified` takes it."""
    if h.side is not None:
        container.check(h.side, side, auth)
    for seg, data in zip(h.segments, segments, strict=True):
        container.check(seg, host_bytes(data), auth)
    return decode_verified(h, side, segments, device, backend, trusted)


def decode_verified(h: container.Header, side: Bytes | None, segments: Sequence[Bytes | torch.Tensor],
                    device: torch.device | str = "cpu", backend: str | None = None, trusted: bool = True) -> Decoded:
    """Decode every segment of a chunk whose parts' checksums (and tags) have all been checked
    (frames on ``device``), and check that no value can come out NaN or infinite (module doc).
    Raises a :class:`container.ContainerError` for a bad part; touches no buffer. An entropy-coded
    segment may be a host uint8 tensor (a fetch's staging buffer: decoded on the GPU from it in place).
    Without ``trusted`` (a stored object read without an object key) only decoders that validate
    their input run (:func:`codec.decoder`: a :class:`codec.CodecError` where none can)."""
    side_t = container.side_tensor(h, side) if h.side else None
    if side_t is not None:  # (its sparse corrections are integers: any bits are valid)
        for part in layout.split_side(side_t, h.shape, h.layout):
            container.check_finite(part, h.torch_dtype)
    dec = codec.decoder(h.codec.format, device, backend, trusted)
    entropy = dec.format in codec.ENTROPY_FORMATS  # these read a host tensor in place too
    in_place = entropy or dec.name in ("nvdec", "raw")  # these read a buffer in place; libav wants bytes
    given = lambda d: d if entropy else host_bytes(d) if in_place else bytes(host_bytes(d))  # noqa: E731
    frames = [container.decode_segment(h, s, given(d), dec, device) for s, d in zip(h.segments, segments)]
    frames_t = frames[0] if len(frames) == 1 else torch.cat(frames)
    values = None
    if h.layout.mode in layout.LOSSLESS_MODES:  # the values are the payload's: check them all
        values = layout.unpack(frames_t, None, h.shape, h.torch_dtype, h.layout)
        container.check_finite(values, h.torch_dtype)
    ready = None
    if values is None and frames_t.is_cuda:  # the side information goes to the frames' GPU here, off the write's path
        if side_t is not None:
            side_t = to_device(side_t, frames_t.device)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(frames_t.device))
    return Decoded(h, frames_t, side_t, values, ready)


def restore_chunk(dest: Destination, ref: ChunkRef, h: container.Header, side: Bytes | None, segments: Sequence[Bytes | torch.Tensor],
                  *, device: torch.device | str | None = None, backend: str | None = None,
                  times: dict[str, float] | None = None, auth: ObjectMAC | None = None, trusted: bool = True) -> int:
    """The restore of one chunk: check that it fits ``dest``, verify every part, decode every
    segment, and only then write it into ``ref``'s slots; returns the KV bytes written. A segment
    may be a host uint8 tensor (best page-locked: an entropy decode copies from it in place).

    Nothing unverified or undecodable reaches the buffer: a bad part raises (a
    :class:`container.ContainerError`) before the first write. ``device`` is where frames are
    decoded (default: the buffer's device). ``times``, if given, receives the seconds spent
    verifying and decoding (``decode_s``) and writing (``write_s``). ``h`` was parsed with ``auth``,
    which every part's tag must then verify under; ``trusted`` as :func:`decode_verified` takes it.
    """
    dest.check(h, ref)
    t0 = time.perf_counter()
    decoded = verify_and_decode(h, side, segments, dest.device if device is None else device, backend, auth, trusted)
    t1 = time.perf_counter()
    n = decoded.write(dest, ref)
    if times is not None:
        times.update(decode_s=t1 - t0, write_s=time.perf_counter() - t1)
    return n
