"""params: the layout's record of how a chunk became planes, stored verbatim in container headers."""

from __future__ import annotations

from dataclasses import dataclass, fields

LAYOUT_VERSION = 7  # 2: exact leading tokens in the side information; 3: sigma_steps in the header;
#                    4: native mode (raw); 5: per-model basis, zstd-compressed side information;
#                    6: trellis-coded quantisation; 7: sparse corrections of outlier-key tokens
#: oldest layout whose objects this code still decodes (side information is compressed since v5;
#: a v5 header has no ``trellis`` field, a v5/v6 header no ``sparse_tokens``, and means what it meant)
MIN_READABLE_LAYOUT = 5
#: modes that restore the stored values bit for bit and carry no side information
LOSSLESS_MODES = ("exact", "native")


@dataclass(frozen=True)
class LayoutParams:
    """How a chunk becomes planes. Stored verbatim in the container header."""

    mode: str = "quant"  # "native" (the buffer's bytes), "exact" (bytes of the original dtype as planes) or "quant"
    bits: int = 8  # quantisation levels = 2**bits (quant mode); samples stay 8-bit
    planes: int = 3  # colour planes per frame: 3 (4:4:4) or 1 (luma only)
    max_rows: int = 1024  # tiles are stacked until a plane is this tall
    kv_bits: tuple[int, int] | None = None  # (key_bits, value_bits) for every layer, overriding ``bits``
    # optional per-layer (key_bits, value_bits), overriding both: rate control by sensitivity
    bits_map: tuple[tuple[int, int], ...] | None = None
    exact_tokens: int = 1  # leading tokens of each chunk kept exact (quant mode)
    # quantise keys before RoPE: the model's base, or one base per layer where layers differ (rope.py);
    # a single base is written as one number, so objects of single-base models read as before
    rope_theta: float | tuple[float, ...] | None = None
    # per-layer (key_step, value_step) in standard deviations of each channel, replacing the
    # range-based levels; a profile of N entries is stretched over the chunk's layers by depth
    sigma_steps: tuple[tuple[float, float], ...] | None = None
    # name of a shipped per-model channel transform (basis.py), applied before quantisation
    basis: str | None = None
    # dependent (trellis-coded) quantisation along tokens (trellis.py); sigma_steps then set its grid
    trellis: bool = False
    # per (layer, KV head) of a chunk, this many tokens with the largest keys in the basis get their
    # key and value rows' error corrected in side information (int8 in units of sparse_step x step)
    sparse_tokens: int = 0
    sparse_step: float = 0.25
    # planes hold each component's tokens as one row, rows sorted by the spread of their samples (a
    # class byte per component in side information): blocks an entropy coder codes alone then hold
    # samples of one distribution. For the entropy formats only (video codecs want the tiles)
    sort_components: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("native", "exact", "quant"):
            raise ValueError(f"layout mode must be 'native', 'exact' or 'quant', not {self.mode!r}")
        if self.mode == "native" and self.planes != 1:
            raise ValueError("native layout has no colour planes: planes must be 1")
        for b in (self.bits, *(self.kv_bits or ()), *(b for kv in self.bits_map or () for b in kv)):
            if not 1 <= b <= 8:
                raise ValueError(f"bits must be in 1..8, not {b}")
        if self.rope_theta is not None:
            thetas = self.rope_theta if isinstance(self.rope_theta, tuple) else (self.rope_theta,)
            if self.mode != "quant" or not thetas or not all(isinstance(t, (int, float)) and t > 1 for t in thetas):
                raise ValueError("rope_theta (pre-RoPE keys) needs quant mode and every theta > 1")
        if self.exact_tokens < 0:
            raise ValueError("exact_tokens must be >= 0")
        if self.planes not in (1, 3):
            raise ValueError(f"planes must be 1 or 3, not {self.planes}")
        if self.sigma_steps is not None:
            if self.mode != "quant" or self.kv_bits is not None or self.bits_map is not None:
                raise ValueError("sigma_steps needs quant mode and excludes kv_bits and bits_map")
            if not self.sigma_steps or any(len(kv) != 2 for kv in self.sigma_steps):
                raise ValueError("sigma_steps must be a non-empty sequence of (key_step, value_step)")
            if not all(0.01 <= st <= 16 for kv in self.sigma_steps for st in kv):
                raise ValueError("sigma steps must be in [0.01, 16] standard deviations")
        if self.basis is not None and self.sigma_steps is None:
            raise ValueError("basis needs sigma_steps (one step per component)")
        if self.trellis and self.sigma_steps is None:
            raise ValueError("trellis needs sigma_steps (its grid step per component)")
        if self.sparse_tokens < 0 or (self.sparse_tokens and self.basis is None):
            raise ValueError("sparse_tokens must be >= 0 and needs a basis (keys are ranked by their norm in it)")
        if self.sort_components and self.sigma_steps is None:
            raise ValueError("sort_components needs sigma_steps (components ranked by their samples' spread)")
        if not 0.01 <= self.sparse_step <= 1:
            raise ValueError("sparse_step must be in [0.01, 1] steps")

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # fields are immutable: no deep copy (asdict's)
        if not self.sort_components:  # headers of the layouts before it stay byte for byte the same
            del d["sort_components"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LayoutParams":
        d = dict(d)
        if isinstance(d.get("rope_theta"), list):
            d["rope_theta"] = tuple(d["rope_theta"])
        if d.get("kv_bits") is not None:
            d["kv_bits"] = tuple(d["kv_bits"])
        for f in ("bits_map", "sigma_steps"):
            if d.get(f) is not None:
                d[f] = tuple(tuple(kv) for kv in d[f])
        return cls(**d)
