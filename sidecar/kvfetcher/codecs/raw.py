"""The ``raw`` format: planes stored as they are. For fast links, tests, and as a baseline."""

from __future__ import annotations

import torch

from .base import CodecError, CodecParams


class RawCodec:
    name = "raw"
    format = "raw"

    def encode(self, frames: torch.Tensor, params: CodecParams) -> bytes:
        return frames.to("cpu", torch.uint8).contiguous().numpy().tobytes()

    def decode(self, data: bytes, frame_shape: tuple[int, int, int, int], device: torch.device | str = "cpu") -> torch.Tensor:
        n = 1
        for s in frame_shape:
            n *= s
        if len(data) != n:
            raise CodecError(f"raw segment has {len(data)} bytes, expected {n}")
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(frame_shape)
        return t.to(device)
