"""Probes behind the basis layout (layout v4), on real KV without running the model.

* ``coders``: symbols of the sigma-step layout with and without the basis (balanced's old
  steps x0.7): their entropy, x265 lossless (ultrafast) with components head-major (the layout)
  or component-major (same component of every head side by side), zstd -19; and how many
  components had their step widened to fit 8-bit samples.
* ``side``: side information per value, raw vs zstd -19 vs byte-shuffled zstd, with and without
  the basis, with and without the exact first token (a chunk at position 256).
* ``range`` (runs the model): layout v5 ``balanced``'s quantisation simulated in float (grid centred on
  each component's mean, no side-information rounding), with and without the 8-bit range limit
  that widens some steps: KL and greedy agreement over the 8 prompts.
* ``overhead``: x265 lossless on synthetic i.i.d. Gaussian symbols of growing spread against
  their plug-in entropy: where the coder's overhead over the entropy comes from.

    python -m research.basis_probes [coders side range overhead] [--kv-cache /tmp/kv.pt]

Prints its findings (research/results/basis_probes.txt holds a run).
"""

from __future__ import annotations

import argparse
import sys

import torch
import zstandard

from benchmarks.compression import compression_bench as cb
from research import compression_probes as cp
from kvfetcher.codec import basis, layout, rope
from kvfetcher.eval import model
from kvfetcher.format import presets
from kvfetcher.codec import tiling
from kvfetcher.format import calibration

STEPS = presets.scaled(presets.sigma_steps(0.003, table=calibration.default().table("channel")), 0.7)


def probe_coders(kvs: list[torch.Tensor], theta: float, name: str) -> None:
    print("coding the symbols (first 256-token chunk of prompts 0, 2, 4, 6), bits per value")
    for bas in (None, name):
        lp = layout.LayoutParams(mode="quant", sigma_steps=STEPS, basis=bas, rope_theta=theta)
        syms, comp_major, widened, total = [], [], 0, 0
        for kv in kvs:
            L, _, H, T, D = kv.shape
            pk = layout.pack(kv, lp, 0)
            q = tiling.frames_to_tiles(pk.frames, pk.geometry, T, H * D)[:, 1:].contiguous()
            syms.append(q)
            comp_major.append(q.reshape(2 * L, T - 1, H, D).transpose(2, 3).reshape(2 * L, T - 1, H * D).contiguous())
            steps = layout.split_side(pk.side, tuple(kv.shape), lp)[0][..., 1].float().flatten(2)
            widened += int((steps > steps.median(-1, keepdim=True).values * 1.01).sum()) if bas else 0
            total += steps.numel()
        n = sum(s.numel() for s in syms)
        ent = sum(cp.entropy(s) * s.numel() for s in syms) / n
        x265 = sum(cp.hevc(s, speed="ultrafast")[0] for s in syms) * 8 / n
        x265c = sum(cp.hevc(s, speed="ultrafast")[0] for s in comp_major) * 8 / n
        zs = sum(len(zstandard.ZstdCompressor(level=19).compress(s.numpy().tobytes())) for s in syms) * 8 / n
        print(f"  {'basis ' + bas if bas else 'per-channel sigma steps'}: entropy {ent:.3f}, x265 head-major {x265:.3f}, "
              f"component-major {x265c:.3f}, zstd {zs:.3f}" + (f"; widened steps {widened}/{total}" if bas else ""))


def probe_side(kvs: list[torch.Tensor], theta: float, name: str) -> None:
    print("side information, bits per value (second chunk of each prompt, start 256)")
    zc = zstandard.ZstdCompressor(level=19)
    for bas in (None, name):
        for exact in (1, 0):
            lp = layout.LayoutParams(mode="quant", sigma_steps=STEPS, basis=bas, rope_theta=theta, exact_tokens=exact)
            raw = z = zs = n = 0
            for kv in kvs:
                side = layout.pack(kv, lp, 256).side
                b = side.numpy().tobytes()
                shuffled = side.view(torch.uint8).view(-1, 2).t().contiguous().numpy().tobytes()
                raw, z, zs, n = raw + len(b), z + len(zc.compress(b)), zs + len(zc.compress(shuffled)), n + kv.numel()
            print(f"  basis {bas is not None}, exact first token {bool(exact)}: raw {raw * 8 / n:.4f}, zstd {z * 8 / n:.4f}, "
                  f"byte-shuffled zstd {zs * 8 / n:.4f}")


def probe_overhead() -> None:
    print("x265 lossless (ultrafast) on i.i.d. Gaussian symbols, bits per value (plug-in entropy is low for wide ones)")
    g = torch.Generator().manual_seed(0)
    for sd in (0.5, 1, 2, 4, 8, 16, 32):
        s = ((torch.randn(12, 255, 192, generator=g) * sd).round().clamp(-128, 127) + 128).to(torch.uint8)
        print(f"  sd {sd} levels: entropy {cp.entropy(s):.3f}, x265 {cp.hevc(s, speed='ultrafast')[0] * 8 / s.numel():.3f}")


def probe_range(lm, cases, theta: float) -> None:
    b = cb.basis_point("v5 balanced", 1.0)  # layout v5's balanced (uniform rounding), as measured
    enc, dec, _ = basis.on_device(b.layout.basis, "cpu")  # a float simulation: the mean cancels

    def restore(kv: torch.Tensor, widen: bool) -> torch.Tensor:
        parts = []
        for s in range(0, kv.shape[3], 256):
            piece = kv[:, :, :, s : s + 256]
            L, _, H, T, D = piece.shape
            x = piece.float().clone()
            cos, sin = rope.rotation(s, T, D, theta)
            x[:, 0] = rope.apply(x[:, 0], cos, sin, inverse=True)
            y = torch.einsum("lkhde,lkhte->lkhtd", enc, x)
            e = 1 if s == 0 else 0
            body = y[:, :, :, e:]
            mu = body.mean(3, keepdim=True)
            sd = body.std(3, correction=0, keepdim=True).square().mean(dim=(2, 4), keepdim=True).sqrt()
            st = layout.sigma_profile(b.layout, L).view(L, 2, 1, 1, 1) * sd
            if widen:
                reach = torch.maximum(body.amax(3, keepdim=True) - mu, mu - body.amin(3, keepdim=True))
                st = torch.maximum(st, reach / 126)
            xr = torch.einsum("lkhde,lkhte->lkhtd", dec, torch.round((y - mu) / st) * st + mu)
            xr[:, 0] = rope.apply(xr[:, 0], cos, sin)
            xr = xr.to(kv.dtype)
            if e:
                xr[:, :, :, :1] = piece[:, :, :, :1]
            parts.append(xr)
        return torch.cat(parts, 3)

    print("balanced's quantisation in float (no side-information rounding), 8 prompts")
    for widen in (True, False):
        r = cb.judge(lm, cases, [restore(c.kv, widen) for c in cases], [1] * len(cases))
        print(f"  8-bit range limit {'on ' if widen else 'off'}: agreement {r['greedy_agreement']:.3f}, "
              f"NLL {100 * r['nll_increase']:+.3f}%, KL {r['kl']:.5f}, per prompt {['%.2g' % p['kl'] for p in r['per_prompt']]}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("probes", nargs="*", default=["coders", "side", "range", "overhead"])
    ap.add_argument("--kv-cache", help="compression_bench's cache of the prefilled prompts")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = model.load()
    theta = model.rope_theta(lm)
    cases = cb.load_cases(lm, args.kv_cache)
    name = presets.get("balanced").layout.basis
    for p in args.probes:
        if p == "coders":
            probe_coders([c.kv[:, :, :, :256].contiguous() for c in cases[::2]], theta, name)
        elif p == "side":
            probe_side([c.kv[:, :, :, 256:].contiguous() for c in cases], theta, name)
        elif p == "range":
            probe_range(lm, cases, theta)
        elif p == "overhead":
            probe_overhead()
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
