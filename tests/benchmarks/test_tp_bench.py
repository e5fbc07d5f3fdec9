"""The tensor-parallel benchmark runs end to end on the CPU (gloo, the tiny shape, two ranks), and the
emulated link it relies on is one link for every process given it."""

import json
import multiprocessing as mp
import subprocess
import sys
import time

import pytest

from benchmarks.lib.linkstore import Link


def _send(link, n, done):
    link.send(n)
    done.put(time.perf_counter())


def test_processes_given_one_link_share_its_rate():
    link = Link(2e6)  # 2 MB/s: 100 kB take 50 ms alone
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    procs = [ctx.Process(target=_send, args=(link, 100_000, done)) for _ in range(4)]
    for p in procs:
        p.start()
    ends = sorted(done.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(10)
    assert ends[-1] - ends[0] > 0.14  # one after another on the one link: 4 x 50 ms, not together
    assert link.bytes == 400_000


@pytest.mark.slow
def test_the_benchmark_runs_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "tp.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.tp.tp_bench", "--dry", "--world", "2", "--out", str(out),
                          "--contexts", "512", "--links", "10"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    res = json.loads(out.read_text())
    assert (res["world"], res["shape"], res["stored"]) == (2, "tiny", ["raw", "balanced"])
    (cell,) = res["cells"]
    assert cell["recompute_s"] > 0
    for m, want in (("raw", "raw"), ("balanced", "balanced"), ("auto", None)):
        assert cell[m]["seconds"] > 0 and cell[m]["error"] is None, cell[m]
        assert want is None or (cell[m]["decision"], cell[m]["loaded_tokens"]) == (want, 512)
    assert "| 0.5K | 10 |" in run.stdout  # the report
