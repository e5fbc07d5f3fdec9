"""chunk: the whole path for one chunk — pack, encode, wrap; and unwrap, decode, unpack.

This is the seam between the pure parts (layout, container) and the codec backends; the
fetch pipeline uses the same per-segment steps to overlap downloads with decoding.
"""

from __future__ import annotations

import dataclasses

import torch

from kvfetcher.codec import basis, layout
from kvfetcher import codec
from kvfetcher.format import container
from kvfetcher.format.presets import Preset, get
from kvfetcher.kvbuffer import dtype_name


def encode_chunk(
    kv: torch.Tensor,
    preset: Preset | str,
    fingerprint: str,
    meta: dict | None = None,
    start: int = 0,
    rope_theta: float | None = None,
) -> bytes:
    """KV ``[layers, 2, kv_heads, tokens, head_dim]`` -> one self-describing stored object.

    ``start`` is the chunk's first token position; ``rope_theta`` the model's RoPE base,
    needed by presets that quantise keys before RoPE (and written into the header). A preset
    given by name is the one for this model (``presets.get(name, fingerprint)``).
    """
    p = get(preset, fingerprint) if isinstance(preset, str) else preset
    lp = p.layout
    if p.pre_rope:
        if rope_theta is None:
            raise ValueError(f"preset {p.name!r} quantises keys before RoPE: give the model's rope_theta")
        lp = dataclasses.replace(lp, rope_theta=float(rope_theta))
    if p.sink_exact_only and start > 0:
        lp = dataclasses.replace(lp, exact_tokens=0)
    if lp.basis is not None and not basis.fits(lp.basis, tuple(kv.shape), fingerprint):
        lp = dataclasses.replace(lp, basis=None, sparse_tokens=0)  # another model: plain per-channel sigma steps (the sparse corrections rank keys in the basis)
    packed = layout.pack(kv, lp, start)
    enc = codec.encoder(p.codec.format)
    n = packed.frames.shape[0]
    frame_bytes = packed.frames[0].numel()
    step = max(1, p.segment_bytes // frame_bytes if p.segment_bytes else p.segment_frames)
    segments = [((a, min(a + step, n)), enc.encode(packed.frames[a : a + step], p.codec)) for a in range(0, n, step)]
    fields = {
        "fingerprint": fingerprint,
        "dtype": dtype_name(kv.dtype),
        "shape": list(kv.shape),
        "preset": p.name,
        "layout": lp.to_dict(),
        "start": start,
        "codec": p.codec.to_dict(),
        "frame_shape": list(packed.geometry.frame_shape),
        "meta": dict(meta or {}, encoder=enc.name),
    }
    return container.build(fields, packed.side, segments)


def decode_chunk(
    obj: bytes,
    expected_fingerprint: str | None = None,
    device: torch.device | str = "cpu",
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """A stored object -> KV on ``device`` (or written into ``out``).

    Every checksum is verified and every segment decoded before ``out`` is touched, so a bad
    object raises a :class:`container.ContainerError` and leaves the destination unchanged.
    """
    h = container.parse_header(obj)
    container.check_fingerprint(h, expected_fingerprint)
    container.check_size(h, len(obj))
    side = container.side_tensor(h, container.slice_segment(obj, h, h.side)) if h.side else None
    dec = codec.decoder(h.codec.format, device, backend)
    frames = [container.decode_segment(h, s, container.slice_segment(obj, h, s), dec, device) for s in h.segments]
    allframes = frames[0] if len(frames) == 1 else torch.cat(frames)
    return layout.unpack(allframes, side, h.shape, h.torch_dtype, h.layout, out=out, start=h.start)
