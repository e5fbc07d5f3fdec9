"""block_sweep: the trellis kernel alone on one 8B-shaped chunk per (components a program, warps): tuning.

    python -m benchmarks.pack.block_sweep
"""
import statistics

import torch

from kvfetcher.codec import trellis, trellis_kernel

x = torch.randn(64, 256, 8, 128, device="cuda") * 3
lo, step = torch.zeros(64, 1, 8, 128, device="cuda"), torch.full((64, 1, 8, 128), 0.05, device="cuda")
out = torch.empty(x.shape, dtype=torch.uint8, device="cuda")
ref = None
for block, warps in ((32, 1), (64, 1), (64, 2), (128, 1), (128, 2), (128, 4), (256, 2), (256, 4), (256, 8)):
    trellis_kernel.BLOCK, trellis_kernel.WARPS = block, warps
    trellis.samples(x, lo, step, out)
    ms = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        trellis.samples(x, lo, step, out)
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    ref = out.clone() if ref is None else ref
    m = statistics.median(ms)
    print(f"BLOCK {block} WARPS {warps}: {m:.4f} ms, {x.numel() * 2 / m / 1e6:.1f} GB/s of bf16 KV, same {torch.equal(out, ref)}")
