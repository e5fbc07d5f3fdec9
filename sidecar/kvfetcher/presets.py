"""presets: named fidelity/size trade-offs. Each is a layout plus codec settings.

The numbers behind each choice are in docs/benchmarks/codec.md (measured on real KV of the
shipped model); ``kvfetcher presets --json`` prints them next to the parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .codecs.base import CodecParams
from .layout import LayoutParams


@dataclass(frozen=True)
class Preset:
    name: str
    layout: LayoutParams
    codec: CodecParams
    lossless: bool  # True: the restored KV is bit-identical to what was stored
    summary: str
    segment_frames: int = 4  # frames per independently decodable segment
    pre_rope: bool = False  # keys quantised before RoPE: the encoder must know the model's theta

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "summary": self.summary,
            "lossless": self.lossless,
            "layout": self.layout.to_dict(),
            "codec": self.codec.to_dict(),
            "segment_frames": self.segment_frames,
            "pre_rope": self.pre_rope,
        }


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "raw",
            LayoutParams(mode="exact", planes=3),
            CodecParams(format="raw"),
            True,
            "original bytes, no video: for links faster than any decoder",
        ),
        Preset(
            "exact",
            LayoutParams(mode="exact", planes=3),
            CodecParams(format="hevc", lossless=True),
            True,
            "bit-exact: each value's bytes as separate planes, lossless HEVC 4:4:4",
        ),
        Preset(
            "q8",
            LayoutParams(mode="quant", bits=8, planes=3),
            CodecParams(format="hevc", lossless=True),
            False,
            "8-bit per-channel quantisation (first token exact), lossless HEVC 4:4:4 over token-major tiles",
        ),
        Preset(
            "lean",
            LayoutParams(mode="quant", kv_bits=(5, 6), planes=3),
            CodecParams(format="hevc", lossless=True),
            False,
            "keys 5-bit quantised before RoPE, values 6-bit (first token exact), lossless HEVC 4:4:4",
            pre_rope=True,
        ),
    ]
}


def get(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


#: Figures written by bench/codec_bench.py, shipped so ``kvfetcher presets`` can show them.
MEASURED_FILE = Path(__file__).parent / "data" / "presets_measured.json"


def measured(name: str) -> dict | None:
    """The last benchmarked ratio/accuracy/throughput of a preset, or None if never measured."""
    try:
        return json.loads(MEASURED_FILE.read_text()).get(name)
    except FileNotFoundError:
        return None
