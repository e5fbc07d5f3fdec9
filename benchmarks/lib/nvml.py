"""nvml: NVDEC utilisation sampled through NVML, and spawned GPU workers released together."""

from __future__ import annotations

import multiprocessing as mp
import statistics
import threading
import time


class NvmlSampler:
    """Mean and peak NVDEC utilisation (%) while the block runs."""

    def __init__(self, period: float = 0.05):
        self.period, self.samples, self._stop = period, [], threading.Event()

    def __enter__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            self._h = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._get = lambda: pynvml.nvmlDeviceGetDecoderUtilization(self._h)[0]
            self._t = threading.Thread(target=self._run, daemon=True)
            self._t.start()
        except Exception as e:  # no NVML: report that instead of a number
            self.error = str(e)
        return self

    def _run(self):
        while not self._stop.is_set():
            self.samples.append(self._get())
            time.sleep(self.period)

    def __exit__(self, *exc):
        self._stop.set()

    def result(self) -> dict:
        if not self.samples:
            return {"nvdec_util_mean": None, "nvdec_util_max": None}
        return {"nvdec_util_mean": statistics.mean(self.samples), "nvdec_util_max": max(self.samples)}


def run_workers(target, args: tuple, procs: int) -> tuple[list, float, dict]:
    """Start ``procs`` spawned workers ``target(*args, start_barrier, result_queue)``, release
    them together, and return their results, the wall time and NVDEC utilisation meanwhile."""
    ctx = mp.get_context("spawn")
    start, q = ctx.Barrier(procs + 1), ctx.Queue()
    ps = [ctx.Process(target=target, args=(*args, start, q)) for _ in range(procs)]
    for p in ps:
        p.start()
    start.wait()
    t = time.perf_counter()
    with NvmlSampler() as s:
        results = [q.get(timeout=600) for _ in ps]
    wall = time.perf_counter() - t
    for p in ps:
        p.join()
    return results, wall, s.result()
