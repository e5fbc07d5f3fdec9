"""The paged-restore benchmark's tunings and S3 source: every tuning (reader processes included)
restores the same bytes into every destination, whether the objects are read from a directory or over S3."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("minio")


def test_each_tuning_and_the_s3_source_restore_what_the_flat_buffer_holds(tmp_path):
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.paged_restore.paged_bench", "--device", "cpu", "--shape", "tiny",
                          "--chunks", "2", "--presets", "raw,q8-zstd", "--repeats", "1", "--source", "s3",
                          "--tunings", "8x8x4,2x2x1x2", "--dests", "flat,paged_cross_layer", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["source"] == "s3"
    assert set(r["fetch"]) == {f"{p} {t}" for p in ("raw", "q8-zstd") for t in ("8x8x4", "2x2x1x2")}
    assert all(row[d]["identical_to_flat"] for row in r["fetch"].values() for d in ("flat", "paged_cross_layer"))


def test_a_tuning_is_three_or_four_numbers():
    from benchmarks.paged_restore.paged_bench import tunings

    assert tunings("4x8x2,8x16x4x8") == [(4, 8, 2, 0), (8, 16, 4, 8)]
    for bad in ("4x8", "4x8x2x8x1"):
        with pytest.raises(ValueError, match="window x reads"):
            tunings(bad)


def test_the_neighbour_steps_at_its_rate_until_stopped(monkeypatch):
    """The idle engine the benchmark runs beside a fetch (``--neighbour-steps``): each step waits for its
    last event and records the next, at the rate asked, until stopped (here with a stand-in event)."""
    import threading
    import time
    from multiprocessing import Value

    from benchmarks.paged_restore import paged_bench

    calls = []

    class Event:
        def __init__(self, blocking=False):
            pass

        def record(self):
            calls.append("record")

        def synchronize(self):
            calls.append("sync")

    monkeypatch.setattr(paged_bench.torch.cuda, "Event", Event)
    stop, steps = threading.Event(), Value("q", 0)
    threading.Timer(0.5, stop.set).start()
    t = time.perf_counter()
    paged_bench._step(100.0, stop, steps)
    assert 0.45 < time.perf_counter() - t < 1.5 and 30 <= steps.value <= 60  # about 100 a second for half a second
    assert calls[:3] == ["record", "sync", "record"]
    with paged_bench.neighbour(None) as beside:  # no neighbour: nothing started, nothing reported
        pass
    assert beside == {}
