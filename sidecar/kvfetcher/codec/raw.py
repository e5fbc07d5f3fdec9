"""The ``raw`` format: planes stored as they are. For fast links, tests, and as a baseline."""

from __future__ import annotations

import torch

from kvfetcher.codec.base import CodecError, CodecParams


class RawCodec:
    name = "raw"
    format = "raw"
    validates_input = True

    def encode(self, frames: torch.Tensor, params: CodecParams) -> memoryview:
        """The frames' own bytes, a view (host frames: no copy; the container's join is the one copy)."""
        return memoryview(frames.to("cpu", torch.uint8).contiguous().numpy().reshape(-1))

    def decode(self, data: bytes, frame_shape: tuple[int, int, int, int], device: torch.device | str = "cpu") -> torch.Tensor:
        n = 1
        for s in frame_shape:
            n *= s
        if len(data) != n:
            raise CodecError(f"raw segment has {len(data)} bytes, expected {n}")
        writable = isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)
        t = torch.frombuffer(data if writable else bytearray(data), dtype=torch.uint8).view(frame_shape)  # no copy if we may
        out = t.to(device)
        return out.clone() if writable and out.data_ptr() == t.data_ptr() else out  # never alias the caller's buffer
