"""presets: named fidelity/size trade-offs. Each is a layout plus codec settings.

The numbers behind each choice are in docs/benchmarks/codec.md (measured on real KV of the
shipped model); ``kvfetcher presets --json`` prints them next to the parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvfetcher.codec.base import CodecParams
from kvfetcher.codec.layout import LayoutParams

#: KL divergence of next-token distributions (nats) when one layer's keys or values alone are
#: quantised at 0.7 channel standard deviations, SmolLM2-135M, 4 prompts x 512 tokens
#: (docs/benchmarks/layer_sensitivity.json, bench/layer_sensitivity.py). Layers differ by 300x.
SENSITIVITY: tuple[tuple[float, float], ...] = (
    (1.5e-05, 4.8e-05), (4.7e-05, 0.00019), (0.00012, 9e-05), (0.00017, 0.0019), (0.00011, 0.0026),
    (0.00016, 0.00094), (0.00015, 0.0012), (0.0018, 0.0015), (0.00078, 0.0011), (0.00018, 0.0006),
    (0.0026, 0.0003), (3.6e-05, 2.4e-05), (6.3e-05, 4.1e-05), (6.5e-05, 1.6e-05), (0.00072, 0.00011),
    (0.00026, 4.7e-05), (4.4e-05, 3.3e-05), (0.0021, 0.00015), (0.0024, 0.00013), (0.00011, 6.9e-05),
    (0.0054, 0.00026), (0.00049, 8.1e-05), (0.00036, 5.5e-05), (0.0024, 0.00032), (0.0015, 0.00015),
    (3.1e-05, 9.1e-06), (0.00053, 4.5e-05), (1.9e-05, 7.1e-06), (0.00031, 3.8e-05), (7.2e-05, 7.5e-06),
)

#: The same measurement with the layer quantised in the shipped basis (one pooled step of 0.7
#: standard deviations of the components; bench/layer_sensitivity.py --basis,
#: docs/benchmarks/layer_sensitivity_basis.json): keys' total halves, values' stays.
SENSITIVITY_BASIS: tuple[tuple[float, float], ...] = (
    (3.4e-05, 7.9e-05), (0.00027, 0.00014), (0.00025, 0.0001), (0.0003, 0.0017), (8.4e-05, 0.0016),
    (0.00027, 0.0012), (0.00015, 0.0012), (0.00033, 0.0025), (0.00095, 0.001), (0.00024, 0.00079),
    (0.0002, 0.0003), (7.2e-05, 2.7e-05), (6.5e-05, 4.9e-05), (3.1e-05, 1.9e-05), (0.00041, 9.9e-05),
    (0.00013, 4.3e-05), (7.1e-05, 3.1e-05), (0.00049, 0.00022), (0.00068, 9.8e-05), (0.00013, 5.2e-05),
    (0.0023, 0.00027), (0.00025, 7.2e-05), (0.00032, 6.9e-05), (0.0015, 0.00036), (0.0011, 0.00013),
    (3.7e-05, 1.1e-05), (0.00025, 5.5e-05), (2.7e-05, 7.5e-06), (0.00018, 3.9e-05), (0.0001, 9.8e-06),
)

#: ``balanced``'s table since layout v7, measured at its own operating point rather than at 0.7
#: standard deviations: each (layer, k|v)'s KL with that group alone restored from ``balanced``
#: (trellis, 4 sparse tokens, layout v6's steps x1.04; everything else exact) on the 16 kl24
#: windows beyond the harness (bench/outlier_probes.py ``alone``), per unit step squared, divided
#: by the group's rate slope (plug-in entropy of its symbols per unit of ln step) and scaled so that
#: ``sigma_steps(0.001, table=...)`` gives the resulting steps. At that point the shares differed by
#: 70x (the values of layers 3-10 were far finer than the model needs: their KL alone 4e-7 to 2e-6,
#: their symbols 5.4 bits); with these steps they are within 4x (docs/benchmarks/compression.md).
SENSITIVITY_TRELLIS: tuple[tuple[float, float], ...] = (
    (2.1e-05, 4.9e-05), (0.00022, 7.4e-05), (0.00016, 5.5e-05), (0.00013, 0.00016), (0.00012, 8.4e-05),
    (0.00015, 5.9e-05), (8e-05, 4.2e-05), (0.00021, 0.00021), (0.00037, 0.00014), (8.5e-05, 4.4e-05),
    (0.00044, 4.8e-05), (6.2e-05, 2.3e-05), (0.00011, 3.6e-05), (4.8e-05, 1.8e-05), (0.00026, 7.7e-05),
    (0.00032, 5.9e-05), (6.9e-05, 3.6e-05), (0.00076, 0.00018), (0.0019, 0.00012), (9.6e-05, 4.2e-05),
    (0.0022, 0.00022), (0.00034, 8.2e-05), (0.00024, 4.4e-05), (0.0013, 0.00026), (0.00099, 9.8e-05),
    (5.5e-05, 1.7e-05), (0.0002, 3.3e-05), (2.1e-05, 1.6e-05), (0.00021, 2.5e-05), (2.5e-05, 8.5e-06),
)

#: The shipped model's KV basis (basis.py; calibrated by bench/kv_basis.py on text windows the
#: accuracy harness does not use). Chunks of any other model drop it (chunk.encode_chunk) and
#: are coded with plain per-channel sigma steps.
SMOLLM2_BASIS = "smollm2-135m-4c54e39f9986"


def sigma_steps(scale: float, lo: float = 0.08, hi: float = 0.7,
                table: tuple[tuple[float, float], ...] = SENSITIVITY) -> tuple[tuple[float, float], ...]:
    """Per-layer (key, value) steps that minimise the summed KL at a given rate.

    KL grows with the square of the step and adds up over layers (checked: predicted and
    measured KL agree within 15%), so at a fixed total of log2(step) the best steps are
    ``scale / sqrt(sensitivity)``. ``lo``/``hi`` keep steps near the measured regime.
    """
    return tuple(tuple(round(min(hi, max(lo, scale * w**-0.5)), 3) for w in kv) for kv in table)


def scaled(profile: tuple[tuple[float, float], ...], factor: float) -> tuple[tuple[float, float], ...]:
    """A profile with every step times ``factor`` (the size-accuracy curve moves along this)."""
    return tuple((round(k * factor, 4), round(v * factor, 4)) for k, v in profile)


#: The per-channel (v3) curve's base profile (docs/benchmarks/compression.md): steps 0.08-0.7
#: sigma; the ``balanced`` of layout v3 was this x0.7.
BASE_PROFILE = sigma_steps(0.003)
#: ``balanced`` / ``compact``: scale of sigma_steps over SENSITIVITY_BASIS (the measured curve).
#: With trellis-coded quantisation the steps are the grid of its two quantisers, about half a
#: uniform quantiser's step at the same error: 0.51 / 0.64 of layout v5's 0.0024 / 0.0065
#: (uniform rounding), chosen to land just above 4x and at v5 compact's 6.5x.
#: Since layout v7 ``balanced`` uses SENSITIVITY_TRELLIS (scale 0.001) and 4 sparse tokens;
#: ``compact`` keeps SENSITIVITY_BASIS (not re-measured at its own point).
BALANCED_SCALE = 0.001
BALANCED_SPARSE_TOKENS = 4
COMPACT_SCALE = 0.00416


@dataclass(frozen=True)
class Preset:
    name: str
    layout: LayoutParams
    codec: CodecParams
    lossless: bool  # True: the restored KV is bit-identical to what was stored
    summary: str
    segment_frames: int = 4  # frames per independently decodable segment
    # if set, frames per segment come from a byte target instead: each segment is a ranged GET and
    # a CRC, so raw (a frame is a layer of a few hundred KB to a few MB) uses a few large ones
    segment_bytes: int = 0
    pre_rope: bool = False  # keys quantised before RoPE: the encoder must know the model's theta
    # exact leading tokens only in the chunk at position 0 (the attention sink); later chunks
    # spend no side information on them
    sink_exact_only: bool = False

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "summary": self.summary,
            "lossless": self.lossless,
            "layout": self.layout.to_dict(),
            "codec": self.codec.to_dict(),
            "segment_frames": self.segment_frames,
            "segment_bytes": self.segment_bytes,
            "pre_rope": self.pre_rope,
            "sink_exact_only": self.sink_exact_only,
        }


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "raw",
            LayoutParams(mode="native", planes=1),
            CodecParams(format="raw"),
            True,
            "the KV buffer's own bytes, no video: restored by one copy, for links faster than any decoder",
            segment_bytes=8 << 20,  # 8B shape: 4 segments per 256-token chunk (fewer thread hops measured faster)
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
        Preset(
            "balanced",
            LayoutParams(mode="quant", sigma_steps=sigma_steps(BALANCED_SCALE, lo=0.01, hi=2.0, table=SENSITIVITY_TRELLIS),
                         basis=SMOLLM2_BASIS, planes=3, trellis=True, sparse_tokens=BALANCED_SPARSE_TOKENS, sparse_step=0.25),
            CodecParams(format="hevc", lossless=True, speed="ultrafast", rd=3),
            False,
            "each head's channels in the model's KV basis, one step per layer and k|v set by sensitivity measured at "
            "this point (keys pre-RoPE), trellis-coded quantisation along tokens, the 4 tokens of largest key per head "
            "corrected in side information, lossless HEVC 4:4:4",
            pre_rope=True,
            sink_exact_only=True,
        ),
        Preset(
            "compact",
            LayoutParams(mode="quant", sigma_steps=sigma_steps(COMPACT_SCALE, lo=0.015, hi=1.6, table=SENSITIVITY_BASIS),
                         basis=SMOLLM2_BASIS, planes=3, trellis=True),
            CodecParams(format="hevc", lossless=True, speed="ultrafast", rd=3),
            False,
            "balanced's scheme at ~3x coarser steps: smaller, with a measured accuracy loss",
            pre_rope=True,
            sink_exact_only=True,
        ),
    ]
}


def get(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


#: Figures written by bench/codec_bench.py, shipped so ``kvfetcher presets`` can show them.
MEASURED_FILE = Path(__file__).parent.parent / "data" / "presets_measured.json"


def measured(name: str) -> dict | None:
    """The last benchmarked ratio/accuracy/throughput of a preset, or None if never measured."""
    try:
        return json.loads(MEASURED_FILE.read_text()).get(name)
    except FileNotFoundError:
        return None
