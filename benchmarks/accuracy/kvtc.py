"""A KVTC-style peer: KV Cache Transform Coding (Staniszewski et al., ICLR 2026) as its paper
describes it, for the accuracy suite; a benchmark peer, not part of the library.

* **Decorrelation**: per layer and K|V, one PCA over the concatenation of every KV head's
  channels (keys before RoPE), mean and eigenvectors from calibration KV (the model's calibration
  texts, never the suite's).
* **Bit allocation**: each principal component gets ``b`` in 0..8 bits minimising the summed
  squared error ``sum_i D_i(b_i)`` under a total budget of ``bits`` per value, with
  ``D_i(0) = lambda_i`` (the component dropped) and ``D_i(b) = lambda_i * 3 * 4**-b`` (a uniform
  quantiser over ``+-3`` standard deviations). The paper solves it by dynamic programming; here the
  same problem is solved by its Lagrangian (each component takes the ``b`` minimising
  ``D_i(b) + mu * b``, ``mu`` bisected to the budget), which returns the DP's optimum at every
  budget on the lower convex hull of the rate-distortion curve.
* **Quantisation**: per chunk and component, uniform over the component's range with ``2**b``
  levels (min and step in fp16 as side information).
* **Entropy coding**: DEFLATE (the paper's nvCOMP coder) over the chunk's symbols, component-major;
  here zlib level 6 on the CPU, the same format.
* The first ``SINK`` tokens of a prefix (attention sinks) stay in fp16, as the paper keeps them;
  the paper's uncompressed window of the 128 most recent tokens is not kept: every stored token
  is coded, as the library's presets code them (so the ratio counts all of the prefix).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from kvfetcher.codec import rope
from kvfetcher.eval import calibrate, model

SINK = 4
MAX_BITS = 8
CAL_WINDOW = 512


def calibration_kv(lm: model.LoadedModel, per_text: int = 2) -> list[torch.Tensor]:
    """Pre-RoPE fp16 KV ``[L, 2, H, T, D]`` (float32) of windows of the model's calibration texts."""
    texts = sorted((model.DATA_DIR / "calibration").glob("*.txt"))
    thetas = rope.per_layer(model.rope_theta(lm), lm.config.num_hidden_layers)
    out = []
    for path in texts:
        ids = model.tokenize(lm, Path(path).read_text())
        for s in list(range(0, len(ids) - CAL_WINDOW + 1, CAL_WINDOW))[:per_text]:
            out.append(calibrate.pre_rope(model.prefill(lm, ids[s : s + CAL_WINDOW])[0].half(), thetas))
    return out


class KVTC:
    """PCA per (layer, K|V) across heads and channels, from calibration KV."""

    def __init__(self, lm: model.LoadedModel):
        kvs = calibration_kv(lm)
        L, _, H, _, D = kvs[0].shape
        self.thetas = rope.per_layer(model.rope_theta(lm), L)
        x = torch.cat([k[:, :, :, SINK:].permute(0, 1, 3, 2, 4).reshape(L, 2, -1, H * D) for k in kvs], 2).double()
        self.mean = x.mean(2)  # [L, 2, HD]
        xc = x - self.mean.unsqueeze(2)
        cov = xc.transpose(-1, -2) @ xc / x.shape[2]
        lam, vec = torch.linalg.eigh(cov)
        self.lam, self.vec = lam.flip(-1).clamp_min(0), vec.flip(-1)  # [L, 2, HD], [L, 2, HD, HD] descending

    def allocation(self, bits: float) -> torch.Tensor:
        """Bits per component ``[L, 2, HD]`` (int) at an average of ``bits`` per value."""
        b = torch.arange(MAX_BITS + 1, dtype=torch.float64)
        dist = self.lam.unsqueeze(-1) * torch.where(b == 0, torch.ones_like(b), 3 * 4.0 ** -b)  # [L, 2, HD, 9]
        budget = bits * self.lam.numel()

        def pick(mu: float) -> torch.Tensor:
            return (dist + mu * b).argmin(-1)

        lo, hi = 0.0, float(self.lam.max()) * 4
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if pick(mid).sum() <= budget else (mid, hi)
        return pick(hi)

    def codec(self, bits: float, chunk_tokens: int = 256):
        """The suite's codec ``kv -> RoundTrip`` at ``bits`` per value before entropy coding."""
        from kvfetcher.eval import accuracy

        alloc = self.allocation(bits)

        def run(kv: torch.Tensor) -> accuracy.RoundTrip:
            import time

            t = time.perf_counter()
            parts, size = [], 0
            for s in range(0, kv.shape[3], chunk_tokens):
                back, n = self.chunk(kv[:, :, :, s : s + chunk_tokens].cpu(), s, alloc)
                parts.append(back)
                size += n
            return accuracy.RoundTrip(torch.cat(parts, 3).to(kv.device), size, time.perf_counter() - t, 0.0)

        return run

    def chunk(self, kv: torch.Tensor, start: int, alloc: torch.Tensor) -> tuple[torch.Tensor, int]:
        """One chunk (starting at position ``start``) coded and restored: (fp16 KV, stored bytes)."""
        L, _, H, T, D = kv.shape
        x = kv.float()
        x[:, 0] = rope.apply_layers(x[:, 0], start, self.thetas, inverse=True)
        x = x.permute(0, 1, 3, 2, 4).reshape(L, 2, T, H * D).double()
        y = torch.einsum("lktc,lkcj->lkjt", x - self.mean.unsqueeze(2), self.vec)  # [L, 2, HD, T]
        lo, hi = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
        levels = (2.0 ** alloc - 1).unsqueeze(-1)
        step = torch.where(levels > 0, (hi - lo) / levels.clamp_min(1), torch.zeros_like(hi))
        lo, step = lo.half().double(), step.half().double()  # as stored
        q = torch.where(levels > 0, torch.round((y - lo) / torch.where(step > 0, step, 1)).clamp(min=0), torch.zeros_like(y))
        q = torch.minimum(q, levels)
        coded = alloc > 0
        symbols = q[coded].to(torch.uint8).numpy().tobytes()
        size = len(zlib.compress(symbols, 6)) + int(coded.sum()) * 4  # + fp16 min and step per coded component
        y_hat = torch.where(coded.unsqueeze(-1), q * step + lo, torch.zeros_like(y))
        x_hat = torch.einsum("lkjt,lkcj->lktc", y_hat, self.vec) + self.mean.unsqueeze(2)
        out = x_hat.float().reshape(L, 2, T, H, D).permute(0, 1, 3, 2, 4).contiguous()
        out[:, 0] = rope.apply_layers(out[:, 0], start, self.thetas)
        out = out.half()
        if start < SINK:  # the attention sinks stay exact
            e = SINK - start
            out[:, :, :, :e] = kv[:, :, :, :e]
            size += kv[:, :, :, :e].numel() * 2
        return out, size
