"""Probes of nvCOMP's Python API on one chunk's ANS planes, for choosing how codec/nvcomp.py calls it:
decode with and without a preconfigured DecompressConfig (sync-free), what each reports for a
block that is damaged but sits in a well-formed bitstream, the LATENCY execution policy, several
chunks in one batch against one call each, and nvCOMP's scratch memory from torch's allocator.

    python -m benchmarks.entropy.nvcomp_probe --kvsrc .bench/kvsrc.pt --out probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.lib import kvsource, timing
from kvfetcher.codec import entropy, layout, nvcomp
from kvfetcher.codec.base import CodecParams
from kvfetcher.format import presets


def ms(fn, repeats: int = 30) -> float:
    """Median milliseconds of ``fn`` (GPU work included), after three warm-ups."""
    return round(timing.median_s(fn, repeats, warmup=3)[0] * 1e3, 3)


def attempt(fn):
    try:
        return fn()
    except Exception as e:  # a probe: report what the API does
        return f"{type(e).__name__}: {e}"[:300]


class Case:
    """One chunk's planes, their ANS bitstream on the GPU, and nvCOMP batches over them."""

    def __init__(self, frames: torch.Tensor, block: int, codec):
        nv = nvcomp._nvcomp()
        self.nv, self.codec, self.block = nv, codec, block
        self.frames = frames.contiguous().view(-1)
        self.total = self.frames.numel()
        data = nvcomp.NvcompCodec("ans").encode(frames, CodecParams(format="ans", block_bytes=block))
        _, self.sizes, self.offsets, payload = entropy.split(data, self.total)
        self.staged = torch.frombuffer(bytearray(payload), dtype=torch.uint8).cuda()
        self.out = torch.empty(self.total, dtype=torch.uint8, device="cuda")
        self.usizes = entropy.block_sizes(self.total, block)
        self.uoffs = [i * block for i in range(len(self.usizes))]

    def arrays(self, staged=None, out=None):
        nv = self.nv
        return (nv.as_arrays(self.staged if staged is None else staged, self.offsets, self.sizes),
                nv.as_arrays(self.out if out is None else out, self.uoffs, self.usizes))

    def decode(self, codec, cfg=None, staged=None, out=None, sync=True):
        src, dst = self.arrays(staged, out)
        if cfg is None:
            codec.decode(src, out=dst)
        else:
            codec.decode(src, out=dst, decompression_config=cfg)
        if sync:
            torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvsrc", default=".bench/kvsrc.pt")
    ap.add_argument("--preset", default="q8")
    ap.add_argument("--block", type=int, default=1 << 16)
    ap.add_argument("--out")
    args = ap.parse_args()
    try:
        kvs = [c.to(torch.float16).cuda() for c in kvsource.chunks(torch.load(args.kvsrc), 4, torch.float16)]
    except FileNotFoundError:
        L, _, H, T, D = kvsource.SHAPE
        kvs = [kvsource.synthetic_kv(L, H, T, D, torch.float16, seed=i).cuda() for i in range(4)]
    p = presets.get(args.preset)
    frames = [layout.pack(kv, p.layout, 256).frames for kv in kvs]
    nv = nvcomp._nvcomp()
    dev = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(dev)
    mk = lambda **kw: nv.Codec(algorithm="ANS", device_id=dev.index, cuda_stream=stream.cuda_stream,  # noqa: E731
                               bitstream_kind=nv.BitstreamKind.RAW, **kw)
    codec = mk()
    case = Case(frames[0], args.block, codec)
    r: dict = {"device": torch.cuda.get_device_name(), "nvcomp": nv.__version__, "planes_MB": round(case.total / 1e6, 3),
               "blocks": len(case.sizes), "coded_MB": round(case.staged.numel() / 1e6, 3),
               "cudastream_attrs": [a for a in dir(nv.CudaStream) if not a.startswith("__")]}
    r["decode_plain_ms"] = ms(lambda: case.decode(codec))
    case.decode(codec)
    r["decode_plain_exact"] = bool(torch.equal(case.out, case.frames))
    cfg = attempt(lambda: codec.decompression_config(codec.compression_config(case.usizes)))
    r["preconfig"] = cfg if isinstance(cfg, str) else "built"
    if not isinstance(cfg, str):
        r["decode_preconfig_ms"] = ms(lambda: case.decode(codec, cfg))
        case.out.zero_()
        case.decode(codec, cfg)
        r["decode_preconfig_exact"] = bool(torch.equal(case.out, case.frames))
        t = time.perf_counter()
        case.decode(codec, cfg, sync=False)
        r["decode_preconfig_return_ms"] = round((time.perf_counter() - t) * 1e3, 3)
        torch.cuda.synchronize()
    # wrapping a buffer in a batch while GPU work is queued: here, on another stream, on the buffer's
    def wrap_ms(busy) -> float:
        out = []
        for _ in range(5):
            torch.cuda.synchronize()
            if busy is not None:
                with torch.cuda.stream(busy):
                    torch.cuda._sleep(20_000_000)  # ~10 ms of a busy SM
            t = time.perf_counter()
            nv.as_arrays(case.staged, case.offsets, case.sizes)
            out.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        return round(statistics.median(out) * 1e3, 3)

    r["as_arrays_idle_ms"] = wrap_ms(None)
    r["as_arrays_other_stream_busy_ms"] = wrap_ms(torch.cuda.Stream())
    r["as_arrays_current_stream_busy_ms"] = wrap_ms(torch.cuda.current_stream())
    # a damaged block inside a well-formed bitstream (what a CRC of the whole part cannot see if it was made after)
    for k in (3, len(case.sizes) // 2):
        bad = case.staged.clone()
        a = case.offsets[k] + case.sizes[k] // 2
        bad[a : a + 64] ^= 0x5A
        for mode, c in (("plain", None), ("preconfig", None if isinstance(cfg, str) else cfg)):
            if mode == "preconfig" and c is None:
                continue
            case.out.fill_(7)
            res = attempt(lambda: case.decode(codec, c, staged=bad) or "no error")
            blk = case.out[case.uoffs[k] : case.uoffs[k] + case.usizes[k]]
            r[f"damaged_block{k}_{mode}"] = {"raised": res, "block_exact": bool(torch.equal(blk, case.frames[case.uoffs[k] : case.uoffs[k] + case.usizes[k]])),
                                              "others_exact": bool(torch.equal(case.out[: case.uoffs[k]], case.frames[: case.uoffs[k]]))}
            # does the codec still decode a good stream after that?
            r[f"after_damage_{k}_{mode}_ok"] = attempt(lambda: case.decode(codec, c) or bool(torch.equal(case.out, case.frames)))
    # the LATENCY policy
    lat = attempt(lambda: mk(execution_policy=nv.ExecutionPolicy.LATENCY))
    if not isinstance(lat, str):
        r["decode_latency_policy_ms"] = ms(lambda: case.decode(lat))
    # four chunks in one batch against one call each
    cases = [case] + [Case(f, args.block, codec) for f in frames[1:]]
    r["decode_4_calls_ms"] = ms(lambda: [c.decode(codec, sync=False) for c in cases] and torch.cuda.synchronize())
    staged = torch.cat([c.staged for c in cases])
    outs = torch.empty(4 * case.total, dtype=torch.uint8, device="cuda")
    offs, sizes, uoffs, usizes, at = [], [], [], [], 0
    for j, c in enumerate(cases):
        offs += [at + o for o in c.offsets]
        sizes += c.sizes
        uoffs += [j * case.total + o for o in c.uoffs]
        usizes += c.usizes
        at += c.staged.numel()

    def batch():
        codec.decode(nv.as_arrays(staged, offs, sizes), out=nv.as_arrays(outs, uoffs, usizes))
        torch.cuda.synchronize()

    r["decode_4_in_one_batch_ms"] = ms(batch)
    # encode: the call, then the coded sizes
    cap = entropy.padded(codec.get_max_comp_buffer_size(nv.as_array(torch.zeros(args.block, dtype=torch.uint8, device="cuda"))))
    enc_out = torch.zeros(len(case.usizes) * cap, dtype=torch.uint8, device="cuda")
    src = nv.as_arrays(case.frames, case.uoffs, case.usizes)
    dst = nv.as_arrays(enc_out, [i * cap for i in range(len(case.usizes))], [cap] * len(case.usizes))

    def encode_split():
        t0 = time.perf_counter()
        res = codec.encode(src, out=dst)
        t1 = time.perf_counter()
        res.buffer_sizes
        return t1 - t0, time.perf_counter() - t1

    encode_split()
    splits = [encode_split() for _ in range(20)]
    r["encode_call_ms"] = round(statistics.median(s[0] for s in splits) * 1e3, 3)
    r["encode_sizes_wait_ms"] = round(statistics.median(s[1] for s in splits) * 1e3, 3)
    ccfg = attempt(lambda: codec.compression_config(case.usizes))
    if not isinstance(ccfg, str):
        r["encode_preconfig_ms"] = ms(lambda: codec.encode(src, out=dst, compression_config=ccfg).buffer_sizes)
    if not isinstance(lat, str):
        r["encode_latency_policy_ms"] = ms(lambda: lat.encode(src, out=dst).buffer_sizes)
    # nvCOMP's scratch from torch's caching allocator
    class Block:
        def __init__(self, n, s):
            self.ptr = torch.cuda.caching_allocator_alloc(max(n, 1), dev.index, stream.cuda_stream)

        def __del__(self):
            torch.cuda.caching_allocator_delete(self.ptr)

    done = attempt(lambda: nv.set_device_allocator(Block) or "set")
    r["torch_allocator"] = done
    if done == "set":
        codec2 = mk()
        r["decode_torch_alloc_ms"] = attempt(lambda: ms(lambda: case.decode(codec2)))
        r["encode_torch_alloc_ms"] = attempt(lambda: ms(lambda: codec2.encode(src, out=dst).buffer_sizes))
    print(json.dumps(r, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
