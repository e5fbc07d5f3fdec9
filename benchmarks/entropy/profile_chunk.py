"""Where one entropy-coded chunk's time goes, on a GPU: encode (pack, nvCOMP, container) and restore
(checksums, nvCOMP decode, unpack), single-threaded step by step, the same restore in N threads
without the fetch's event loop, and how long each nvCOMP call holds the GIL.

Works against this tree and against an older one (run it with the other tree first on PYTHONPATH):
steps the older tree lacks (decode from a pinned staging tensor) are skipped. Llama-3-8B-shaped
chunks tiled from real KV (``--kvsrc``, else synthetic). Prints one JSON object per preset and one
in all (``--out`` too).

    python -m benchmarks.entropy.profile_chunk --kvsrc .bench/kvsrc.pt --out profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import threading
import time

import torch

from benchmarks.lib import kvsource, timing
from kvfetcher import chunk, codec
from kvfetcher.codec import layout
from kvfetcher.format import container, presets
from kvfetcher.kvbuffer import ChunkRef, Destination

FP = "profile-chunk"
THETA = kvsource.LLAMA3_THETA


def ms(fn, repeats: int = 20) -> float:
    """Median milliseconds of ``fn`` (GPU work included), after two warm-ups."""
    return round(timing.median_s(fn, repeats, warmup=2)[0] * 1e3, 3)


def gil_hold(fn, seconds: float = 0.3) -> dict:
    """``fn`` looped in a thread while this one sleeps 0.2 ms at a time: the longest and the mean
    wake-up lateness say how long ``fn`` keeps the GIL (threads sharing it cannot overlap that)."""
    stop, late = threading.Event(), []

    def loop():
        while not stop.is_set():
            fn()
        torch.cuda.synchronize()

    th = threading.Thread(target=loop)
    th.start()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        time.sleep(0.0002)
        late.append(time.perf_counter() - t - 0.0002)
    stop.set()
    th.join()
    return {"max_ms": round(max(late) * 1e3, 3), "mean_ms": round(statistics.mean(late) * 1e3, 3)}


def top(fn, n: int = 10, lines: int = 14) -> list[str]:
    """cProfile of ``n`` calls of ``fn``: the heaviest functions by own time."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(lines)
    return [ln for ln in s.getvalue().splitlines() if ln.strip()][-lines - 1 :]


class Parts:
    """One stored object's parts: as memoryviews of the bytes, and (newer trees) as slices of a
    pinned staging tensor, which is what the fetch hands the decoder."""

    def __init__(self, obj: bytes):
        self.h = h = container.parse_header(obj)
        mem = memoryview(obj)
        self.side = mem[h.header_size + h.side.offset : h.header_size + h.side.offset + h.side.length] if h.side else None
        self.segs = [mem[h.header_size + s.offset : h.header_size + s.offset + s.length] for s in h.segments]
        self.host = torch.empty(len(obj) - h.header_size, dtype=torch.uint8, pin_memory=True)
        self.host.numpy()[:] = memoryview(obj)[h.header_size :]
        self.pinned_segs = [self.host[s.offset : s.offset + s.length] for s in h.segments]

    def restore(self, dest: Destination, ref: ChunkRef, staged: bool) -> None:
        h = self.h
        if staged:  # what the fetch does now: checksums already checked by the reading threads
            d = chunk.decode_verified(h, self.side, self.pinned_segs, "cuda")
        else:
            d = chunk.verify_and_decode(h, self.side, self.segs, "cuda")
        d.write(dest, ref)


def threads_rate(parts: list[Parts], buf: torch.Tensor, threads: int, staged: bool, rounds: int = 8) -> float:
    """GB/s of fp16 KV restored by ``threads`` threads, each restoring chunks into its own slots."""
    T = parts[0].h.tokens
    n = buf.shape[3] // T

    def work(k: int) -> None:
        for r in range(rounds):
            i = (k + r * threads) % n
            parts[i % len(parts)].restore(Destination(buf, tokens=n * T), ChunkRef("", 0, i * T, T), staged)

    timing.threads_s(threads, work)
    s = statistics.median(timing.threads_s(threads, work) for _ in range(3))
    return round(threads * rounds * parts[0].h.shape[0] * 2 * parts[0].h.shape[2] * T * parts[0].h.shape[4] * 2 / s / 1e9, 2)


def profile(name: str, kvs: list[torch.Tensor], args) -> dict:
    p = presets.get(name)
    T = kvs[0].shape[3]
    objs = [chunk.encode_chunk(kv, p, FP, start=(i + 1) * T, rope_theta=THETA) for i, kv in enumerate(kvs)]
    parts = [Parts(o) for o in objs]
    one, h = parts[0], parts[0].h
    staged = hasattr(chunk, "decode_verified")
    r = {"preset": name, "block_bytes": h.codec.block_bytes, "object_MB": round(len(objs[0]) / 1e6, 3),
         "kv_MB": round(kvs[0].numel() * 2 / 1e6, 3), "staged_tree": staged}
    # encode
    r["encode_chunk_ms"] = ms(lambda: chunk.encode_chunk(kvs[0], p, FP, start=T, rope_theta=THETA), args.repeats)
    r["pack_ms"] = ms(lambda: layout.pack(kvs[0], h.layout, T), args.repeats)
    packed = layout.pack(kvs[0], h.layout, T)
    enc = codec.encoder(h.codec.format, "cuda")
    r["nvcomp_encode_ms"] = ms(lambda: enc.encode(packed.frames, h.codec), args.repeats)
    segs = [((0, packed.frames.shape[0]), enc.encode(packed.frames, h.codec))]
    fields = {"fingerprint": FP, "dtype": "float16", "shape": list(kvs[0].shape), "preset": name, "layout": h.layout.to_dict(),
              "start": T, "codec": h.codec.to_dict(), "frame_shape": list(h.frame_shape), "meta": {}}
    r["container_build_ms"] = ms(lambda: container.build(fields, container.side_bytes(packed.side), segs), args.repeats)
    # restore, one step at a time
    r["crc_ms"] = ms(lambda: [container.check(s, d) for s, d in zip(([h.side] if h.side else []) + list(h.segments),
                                                                 ([one.side] if h.side else []) + one.segs)], args.repeats)
    r["side_ms"] = ms(lambda: container.side_tensor(h, bytes(one.side)), args.repeats) if h.side else 0.0
    dec = codec.decoder(h.codec.format, "cuda")
    shape = tuple(h.frame_shape)
    r["nvcomp_decode_from_bytes_ms"] = ms(lambda: dec.decode(one.segs[0], shape, "cuda"), args.repeats)
    if staged:
        r["nvcomp_decode_from_pinned_ms"] = ms(lambda: dec.decode(one.pinned_segs[0], shape, "cuda"), args.repeats)
        r["decode_verified_pinned_ms"] = ms(lambda: chunk.decode_verified(h, one.side, one.pinned_segs, "cuda"), args.repeats)
    r["verify_and_decode_ms"] = ms(lambda: chunk.verify_and_decode(h, one.side, one.segs, "cuda"), args.repeats)
    d = chunk.verify_and_decode(h, one.side, one.segs, "cuda")
    buf = torch.zeros(kvs[0].shape, dtype=torch.float16, device="cuda")
    dest, ref = Destination(buf, tokens=T), ChunkRef("", 0, 0, T)
    r["write_ms"] = ms(lambda: d.write(dest, ref), args.repeats)
    side_gpu = d.side.cuda() if d.side is not None else None
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        layout.unpack(d.frames, side_gpu, h.shape, h.torch_dtype, h.layout, out=buf, start=h.start)
    stop.record()
    torch.cuda.synchronize()
    r["unpack_gpu_ms"] = round(start.elapsed_time(stop) / 10, 3)
    r["gil_nvcomp_decode"] = gil_hold(lambda: dec.decode(one.pinned_segs[0] if staged else one.segs[0], shape, "cuda"))
    r["gil_nvcomp_encode"] = gil_hold(lambda: enc.encode(packed.frames, h.codec))
    r["gil_restore"] = gil_hold(lambda: one.restore(dest, ref, staged))
    r["profile_restore"] = top(lambda: one.restore(dest, ref, staged))
    r["profile_encode"] = top(lambda: chunk.encode_chunk(kvs[0], p, FP, start=T, rope_theta=THETA))
    # the restore in threads, without the fetch's event loop
    L, _, H, _, D = kvs[0].shape
    big = torch.zeros(L, 2, H, 32 * T, D, dtype=torch.float16, device="cuda")
    r["threads_GB_s"] = {k: threads_rate(parts, big, k, staged) for k in args.threads}
    print(json.dumps(r), flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvsrc", default=".bench/kvsrc.pt")
    ap.add_argument("--presets", default="q8-ans,balanced-ans")
    ap.add_argument("--distinct", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--out")
    args = ap.parse_args()
    args.threads = [int(t) for t in args.threads.split(",")]
    try:
        kvs = [c.to(torch.float16).cuda() for c in kvsource.chunks(torch.load(args.kvsrc), args.distinct, torch.float16)]
    except FileNotFoundError:
        L, _, H, T, D = kvsource.SHAPE
        kvs = [kvsource.synthetic_kv(L, H, T, D, torch.float16, seed=i).cuda() for i in range(args.distinct)]
    rows = [profile(n, kvs, args) for n in args.presets.split(",")]
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
