"""Ways a queued chunk can reach the GPU for its encode, each in 1-8 threads at once, GB/s of KV.

The writer's queue holds a job's KV in host memory ``[layers, 2, heads, tokens, head_dim]``, and each
chunk is a strided slice of it. Per chunk an encode thread today copies the slice into page-locked
staging, then uploads it, blocking (``save.writer._to_device``). Timed here, one 8B chunk (33.5 MB
bf16) per call, threads looping for ``--seconds``:

* ``writer``: that path, as the writer runs it;
* ``host_copy``: its host copy alone (slice into page-locked staging);
* ``pinned_upload``: its upload alone (contiguous page-locked memory to the GPU);
* ``pageable_upload``: a contiguous pageable chunk uploaded directly (the driver stages it);
* ``register``: ms to page-lock (``cudaHostRegister``) and release a pageable chunk, and a job of 32 chunks.

    python -m benchmarks.store_rate.host_paths --out $OUT/host_paths.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.lib import timing
from kvfetcher.save.writer import _to_device

SHAPE = (32, 2, 8, 256, 128)  # one Llama-3-8B chunk: 33.5 MB of bf16


def register_ms(t: torch.Tensor, repeats: int = 5) -> float:
    """Median ms to page-lock ``t``'s memory and release it again."""
    rt = torch.cuda.cudart()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        assert rt.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0) == 0
        rt.cudaHostUnregister(t.data_ptr())
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[len(times) // 2] * 1e3, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--out")
    args = ap.parse_args()
    L, two, H, N, D = SHAPE
    chunks = 8
    job = torch.randn(L, two, H, N * chunks, D).to(torch.bfloat16)  # a job's queued KV (pageable)
    flat = [job[:, :, :, i * N : (i + 1) * N].contiguous() for i in range(chunks)]  # chunk-major, pageable
    pinned = [f.pin_memory() for f in flat]
    gb = flat[0].numel() * 2 / 1e9
    slice_of = lambda i: job[:, :, :, (i % chunks) * N : (i % chunks + 1) * N]  # noqa: E731

    def host_copy(i: int) -> None:
        torch.empty(SHAPE, dtype=torch.bfloat16, pin_memory=True).copy_(slice_of(i))

    ways = {
        "writer": lambda i: _to_device(slice_of(i), "cuda"),
        "host_copy": host_copy,
        "pinned_upload": lambda i: pinned[i % chunks].to("cuda"),
        "pageable_upload": lambda i: flat[i % chunks].to("cuda"),
    }
    rows = []
    for n in [int(x) for x in args.threads.split(",") if x]:
        row = {"threads": n, **{f"{w}_GB_s": round(timing.calls_per_s(n, f, args.seconds) * gb, 2) for w, f in ways.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    big = torch.empty(L, two, H, N * 32, D, dtype=torch.bfloat16)
    reg = {"chunk_ms": register_ms(flat[0]), "job_32_chunks_ms": register_ms(big)}
    print(json.dumps({"register": reg}), flush=True)
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "chunk_MB": round(gb * 1e3, 1),
              "torch_threads": torch.get_num_threads(), "rows": rows, "register": reg}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
