"""The restore-steps benchmark: every process restores its chunks and reports its steps; a process
that fails is reported, not waited for."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("zstandard")


def _run(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "benchmarks.transform.restore_steps", "--device", "cpu", "--chunks", "2",
                           "--out", str(tmp_path / "r.json"), *args], capture_output=True, text=True, timeout=300)


def test_each_count_of_processes_restores_and_times_its_steps(tmp_path):
    """From either memory (a process' own bytes, or a slab mapped as a decode worker maps staging)."""
    run = _run(tmp_path, "--presets", "transform-zstd", "--procs", "1,2", "--dests", "flat,paged", "--profile")
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [(r["dest"], r["procs"], r["memory"]) for r in rows] == [
        (d, n, m) for d in ("flat", "paged") for n in (1, 2) for m in ("bytes", "slab")]
    for r in rows:
        assert r["kv_GB_s"] > 0 and r["ms_a_chunk"] >= r["decode_ms"] + r["write_ms"] > 0
        assert ("kvfetcher/codec" in r.get("profile_first_process", "")) == (r["procs"] == 2)


def test_a_process_that_fails_is_reported(tmp_path):
    run = _run(tmp_path, "--presets", "no-such-preset", "--procs", "2")
    assert run.returncode != 0
    assert "no-such-preset" in run.stderr and not (tmp_path / "r.json").exists()
