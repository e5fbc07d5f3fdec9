"""NVDEC feeding strategies, one process: FFmpeg demuxer vs whole stream as one packet,
new decoder per stream vs reused (run on the GPU machine; a Llama-3-8B-shaped q8 chunk).

Run on an H200 on 2026-11-22; its printed output is recorded in research/results/nvdec_feed_h200.md.
"""
import time

import torch

from kvfetcher.codec import layout
from kvfetcher.codec.nvidia import NvdecDecoder
from kvfetcher.codec.pyav import X265Encoder, LibavDecoder
from kvfetcher.codec.base import CodecParams
g = torch.Generator().manual_seed(0)
kv = (torch.randn(32, 2, 8, 256, 128, generator=g) * 2).half()
frames = layout.pack(kv, layout.LayoutParams(mode="quant")).frames
print("frames", tuple(frames.shape))
segs = [X265Encoder().encode(frames[i:i+4], CodecParams()) for i in range(0, frames.shape[0], 4)]
ref = [LibavDecoder().decode(s, (min(4, frames.shape[0]-i*4), *frames.shape[1:])) for i, s in enumerate(segs)]
for feed in ("demuxer", "packets"):
    for reuse in (False, True):
        d = NvdecDecoder(0, feed=feed, reuse=reuse)
        try:
            ok = True
            for r in range(3):
                torch.cuda.synchronize(); t = time.perf_counter()
                outs = [d.decode(s, tuple(rf.shape), "cuda") for s, rf in zip(segs, ref)]
                torch.cuda.synchronize(); dt = time.perf_counter() - t
            ok = all(torch.equal(o.cpu(), rf) for o, rf in zip(outs, ref))
            print(f"feed={feed} reuse={reuse}: {dt*1000:.1f} ms for {frames.shape[0]} frames = {kv.numel()*2/dt/1e9:.3f} GB/s fp16-eq, identical={ok}", flush=True)
        except Exception as e:
            print(f"feed={feed} reuse={reuse}: FAILED {type(e).__name__}: {e}", flush=True)
