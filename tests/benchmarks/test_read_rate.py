"""The read-rate benchmark: the reader processes read every object whole from the link server, each
read checked against what was written, and each reader count is reported."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("minio")


def test_each_reader_count_reads_every_object_and_reports_its_rate(tmp_path):
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.paged_restore.read_rate", "--objects", "6", "--object-mb", "0.5",
                          "--procs", "1,2", "--window", "3", "--repeats", "1", "--server-procs", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(out.read_text())
    assert (r["objects"], r["object_bytes"], r["server_procs"]) == (6, 500000, 1)
    assert [row["procs"] for row in r["rows"]] == [1, 2]
    assert all(row["stored_GB_s"] > 0 and row["read_ms_p90"] >= row["read_ms_median"] > 0 for row in r["rows"])


def test_a_read_that_does_not_match_what_was_written_fails_the_run(tmp_path):
    from benchmarks.lib import linkserver
    from benchmarks.paged_restore import read_rate
    from kvfetcher.fetch.readers import ReadProcs, SharedStaging
    from kvfetcher.store.s3 import S3Store

    crcs = read_rate.write_objects(tmp_path, 3, 4096)
    (tmp_path / read_rate.BUCKET / "obj-0001").write_bytes(bytes(4096))  # changed after its CRC was taken
    url, group = linkserver.start_process(tmp_path, 0.0, 1)
    staging = SharedStaging()
    readers = ReadProcs(S3Store(url, read_rate.BUCKET, "bench", "bench", verify_tls=False).opener(), 1, staging)
    try:
        with pytest.raises(RuntimeError, match="obj-0001"):
            read_rate.read_all(readers, staging, crcs, 4096, 2, False)
    finally:
        readers.close()
        group.terminate()
