"""tiling: tiles (one ``(layer, k|v)`` slice as ``[tokens, channels]``) <-> uint8 video frames.

Tiles are stacked vertically into planes and ``planes`` tiles side by side in the colour planes
of one frame; the geometry is derived from the chunk shape and the layout, never stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvfetcher.codec.params import LayoutParams
from kvfetcher.kvbuffer import bytes_per_value


@dataclass(frozen=True)
class Geometry:
    """Where tiles land: derived from the chunk shape and the layout, never stored separately."""

    n_tiles: int
    tile_rows: int  # tokens, padded to a multiple of 8
    tile_cols: int  # kv_heads * head_dim, padded to a multiple of 8
    tiles_per_plane: int
    planes: int

    @property
    def tiles_per_frame(self) -> int:
        return self.tiles_per_plane * self.planes

    @property
    def n_frames(self) -> int:
        return math.ceil(self.n_tiles / self.tiles_per_frame)

    @property
    def height(self) -> int:
        return self.tile_rows * self.tiles_per_plane

    @property
    def width(self) -> int:
        return self.tile_cols

    @property
    def frame_shape(self) -> tuple[int, int, int, int]:
        """``[frames, planes, height, width]`` of the uint8 planes."""
        return (self.n_frames, self.planes, self.height, self.width)


def _round8(n: int) -> int:
    return max(8, (n + 7) // 8 * 8)


def geometry(shape: tuple[int, ...], dtype: torch.dtype, params: LayoutParams) -> Geometry:
    layers, two, heads, tokens, head_dim = shape
    if two != 2:
        raise ValueError(f"KV chunk must be [layers, 2, kv_heads, tokens, head_dim], got {tuple(shape)}")
    if params.mode == "native":  # one frame per layer: a single row of that layer's bytes
        return Geometry(layers, 1, 2 * heads * tokens * head_dim * bytes_per_value(dtype), 1, 1)
    per_value = bytes_per_value(dtype) if params.mode == "exact" else 1
    rows, cols = _round8(tokens), _round8(heads * head_dim)
    # NVDEC needs planes of at least 144 x 144 (HEVC); stacking tiles grows the height.
    n_tiles = layers * 2 * per_value
    per_plane = min(max(1, params.max_rows // rows), math.ceil(n_tiles / params.planes))
    per_plane = max(per_plane, math.ceil(144 / rows))
    return Geometry(n_tiles, rows, max(cols, 144), per_plane, params.planes)


def tiles_to_frames(tiles: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """``[n_tiles, rows, cols]`` -> ``[frames, planes, height, width]`` (zero padded)."""
    n, rows, cols = tiles.shape
    total = geo.n_frames * geo.tiles_per_frame
    out = torch.zeros((total, geo.tile_rows, geo.tile_cols), dtype=torch.uint8, device=tiles.device)
    out[:n, :rows, :cols] = tiles
    if rows < geo.tile_rows:  # repeat the last token row: cheaper to code than a step to zero
        out[:n, rows:, :cols] = tiles[:, rows - 1 : rows, :]
    out = out.view(geo.n_frames, geo.planes, geo.tiles_per_plane, geo.tile_rows, geo.tile_cols)
    return out.reshape(geo.n_frames, geo.planes, geo.height, geo.width)


def frames_to_tiles(frames: torch.Tensor, geo: Geometry, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`tiles_to_frames`; a view where possible."""
    t = frames.reshape(geo.n_frames, geo.planes, geo.tiles_per_plane, geo.tile_rows, geo.tile_cols)
    t = t.reshape(geo.n_frames * geo.tiles_per_frame, geo.tile_rows, geo.tile_cols)
    return t[: geo.n_tiles, :rows, :cols]
