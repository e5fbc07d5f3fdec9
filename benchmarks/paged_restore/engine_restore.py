"""The engine-decode restore as a vLLM engine process runs it, alone and beside the engine's own loop.

In engine-decode mode the sidecar fetches and verifies the stored objects into a page-locked host
arena and the engine process restores them into its paged blocks (``chunk.restore_object``, in a
thread of its own). This times that restore without vLLM: objects of an 8B-shaped model in a
page-locked arena, restored one after another into a cross-layer paged tensor on the GPU by a
thread, as ``Staging._restore`` does, while the main thread is

* ``alone``: idle (waiting for the restore);
* ``engine``: an idle vLLM engine's loop while a request waits for its KV: ``--step-ms`` of Python
  per step, then the connector's idle wait (``idle_step_wait_s``, the GIL released);
* ``spin``: Python without a pause (the GIL handed over only when the interpreter forces it).

Each mode times the engine's thread restoring (``thread``) and, with ``--procs``, the engine's restore
processes (``procs``: ``integrations.restore_procs``, what the connector now uses). Per mode and way:
the restore's seconds and GB/s of KV (median of ``--repeats``) and, for the thread, the median
object's seconds in its steps (header and CRC check, decode, write). Prints and writes one JSON object.

    python -m benchmarks.paged_restore.engine_restore --chunks 128 --presets raw,compact-ans --modes alone,engine,spin --out x.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from benchmarks.lib.fetchkit import FINGERPRINT, encode_objects
from kvfetcher import chunk, ipc, kvbuffer
from kvfetcher.eval.costmodel import SHAPES
from kvfetcher.format import container
from kvfetcher.integrations.restore_procs import RestoreProcs, cuda_paged_handle

MODES = ("alone", "engine", "spin")


class Loop:
    """The main thread's work in a mode, until :meth:`stop`."""

    def __init__(self, mode: str, step_s: float, wait_s: float):
        self.mode, self.step_s, self.wait_s = mode, step_s, wait_s
        self.done, self.woken = threading.Event(), threading.Condition()
        self.steps = 0

    def run(self) -> None:
        while self.mode != "alone" and not self.done.is_set():
            t = time.perf_counter()
            while time.perf_counter() - t < self.step_s or self.mode == "spin" and not self.done.is_set():
                sum(range(64))  # Python bytecode, holding the GIL as a scheduler's step does
                if self.mode == "spin" and time.perf_counter() - t > 0.05:
                    break
            self.steps += 1
            if self.mode == "engine":
                with self.woken:
                    self.woken.wait(self.wait_s)

    def stop(self) -> None:
        self.done.set()


def restore_all(dest, arena: memoryview, placed: list[tuple[int, int, int]], n: int, device, times: list) -> None:
    """``Staging._restore``'s loop: each object parsed, checked and restored in turn on this thread's stream."""
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for start, offset, size in placed:
            t0 = time.perf_counter()
            obj = arena[offset : offset + size]
            h = container.parse_header(obj, None)
            container.check_fingerprint(h, FINGERPRINT)
            mem = memoryview(obj)
            part = lambda s: mem[h.header_size + s.offset : h.header_size + s.offset + s.length]  # noqa: E731
            side = part(h.side) if h.side else None
            step: dict[str, float] = {}
            chunk.restore_chunk(dest, kvbuffer.ChunkRef("", size, start, n), h, side, [part(s) for s in h.segments], device=device, times=step)
            times.append((step["decode_s"], step["write_s"], time.perf_counter() - t0))
        if stream is not None:
            stream.synchronize()


def restore_in(procs: RestoreProcs, dest, arena: memoryview, shared, placed: list[tuple[int, int, int]], n: int, times: list) -> None:
    """The same objects restored by the engine's restore processes, as ``Staging._restore`` hands them over."""
    done, _ = procs.restore(dest, placed, 0, n, arena, shared, FINGERPRINT)
    if done != placed[-1][0] + n:
        raise RuntimeError(f"the restore processes restored up to token {done} only")


def run_mode(mode: str, restore, repeats: int, step_s: float, wait_s: float) -> dict:
    """``restore(times)`` in a thread while the main thread works as ``mode`` says: seconds (median of
    ``repeats`` after a warm-up) and, where ``restore`` timed its objects, the median object's steps."""
    seconds, per_object, steps = [], [], []
    for _ in range(repeats + 1):  # the first: warm-up (decoder set-up)
        loop = Loop(mode, step_s, wait_s)
        times: list = []
        worker = threading.Thread(target=restore, args=(times,))
        t = time.perf_counter()
        worker.start()
        if mode == "alone":
            worker.join()
        else:
            threading.Thread(target=lambda: (worker.join(), loop.stop()), daemon=True).start()
            loop.run()
            worker.join()
        seconds.append(time.perf_counter() - t)
        per_object.append(times)
        steps.append(loop.steps)
    seconds, per_object, steps = seconds[1:], per_object[1:], steps[1:]
    flat = [t for run in per_object for t in run]
    med = lambda i: round(1e3 * statistics.median(t[i] for t in flat), 3)  # noqa: E731
    out = {"restore_s": round(statistics.median(seconds), 4), "main_thread_steps": statistics.median(steps)}
    if flat:
        out["object_ms"] = {"verify_and_decode": med(0), "write": med(1), "whole": med(2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu: a smoke run (raw)")
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--chunks", type=int, default=128)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--presets", default="raw,compact-ans")
    ap.add_argument("--modes", default="alone,engine", help=f"of {', '.join(MODES)} (spin: minutes for the thread at 128 chunks)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=0.5, help="engine mode: Python per idle engine step")
    ap.add_argument("--wait-ms", type=float, default=2.0, help="engine mode: the connector's idle wait per step (idle_step_wait_s)")
    ap.add_argument("--procs", type=int, default=2, help="restore processes timed beside the engine's thread (0: the thread only)")
    ap.add_argument("--switch-ms", type=float, help="sys.setswitchinterval for the run (default: Python's, 5 ms)")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.switch_ms:
        sys.setswitchinterval(a.switch_ms / 1e3)
    device = torch.device(a.device)
    shape, n = SHAPES[a.shape], a.chunk_tokens
    tokens = a.chunks * n
    L, H, D, bs = shape.layers, shape.kv_heads, shape.head_dim, 16
    blocks = tokens // bs + 64
    block_ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(0))[: tokens // bs].tolist()
    layout = kvbuffer.PagedLayout("BLTH(KD)", bs)
    if device.type == "cuda":
        cross = torch.zeros(blocks, L, bs, H, 2 * D, dtype=torch.bfloat16, device=device)
        handle = cuda_paged_handle(cross, layout)
    else:  # a smoke run: blocks in a memfd, which the processes map as they map a GPU's by CUDA IPC
        shared_blocks = ipc.allocate((blocks, L, bs, H, 2 * D), torch.bfloat16)
        cross, handle = shared_blocks.tensor, ipc.paged_handle([shared_blocks.handle], layout)
    dest = kvbuffer.PagedDestination(kvbuffer.PagedKV(cross, layout), block_ids, tokens)
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "shape": a.shape,
           "tokens": tokens, "kv_bytes": shape.kv_bytes_per_token() * tokens, "switch_interval_ms": sys.getswitchinterval() * 1e3,
           "step_ms": a.step_ms, "wait_ms": a.wait_ms, "torch_threads": torch.get_num_threads(), "restore": {}}
    procs = None
    if a.procs:
        procs = RestoreProcs(handle, a.procs, ("raw", "ans") if device.type == "cuda" else ("raw",))
        while not procs.ready():
            time.sleep(0.1)
    for preset in a.presets.split(","):
        objects = encode_objects(shape, preset, n, distinct=4, gpu=device.type == "cuda")
        sizes = [len(objects[i % len(objects)]) for i in range(a.chunks)]
        arena = ipc.allocate(((sum(sizes) + 1) // 2,), torch.bfloat16)  # (as Staging's: KV-typed host memory)
        pinned = ipc.pin(arena.tensor)
        mem = memoryview(arena.tensor.view(torch.uint8).numpy())
        placed, at = [], 0
        for i, size in enumerate(sizes):
            mem[at : at + size] = objects[i % len(objects)]
            placed.append((i * n, at, size))
            at += size
        ways = {"thread": functools.partial(restore_all, dest, mem, placed, n, device)}
        if procs is not None:
            ways["procs"] = functools.partial(restore_in, procs, dest, mem, arena, placed, n)
        for mode in a.modes.split(","):
            for way, restore in ways.items():
                r = run_mode(mode, restore, a.repeats, a.step_ms / 1e3, a.wait_ms / 1e3)
                r.update(objects=len(placed), kv_GB_s=round(out["kv_bytes"] / r["restore_s"] / 1e9, 2), arena_pinned=pinned)
                out["restore"][f"{preset} {mode} {way}"] = r
                print(preset, mode, way, json.dumps(r), flush=True)
        if pinned:
            ipc.unpin(arena.tensor)
        del mem
        arena.close()
    if procs is not None:
        procs.close()
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
