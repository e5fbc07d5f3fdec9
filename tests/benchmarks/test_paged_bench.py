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
