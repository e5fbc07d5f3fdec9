"""What a user typing `kvfetcher` gets wrong ends with one line and a non-zero status, never a
traceback; `--version`, the log level and JSON logs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from kvfetcher import cli, config
from kvtest import free_port


@pytest.fixture(autouse=True)
def _root_logger():
    """cli.main configures the root logger (on the test's captured stderr): put it back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        status = cli.main(list(argv))
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv, words", [
    (["eval", "--preset", "balnced"], ["--preset", "unknown preset 'balnced'", "balanced"]),
    (["eval", "--text", "/nonexistent/prompt.txt"], ["--text", "no such file"]),
    (["eval", "--tokens", "-5"], ["--tokens", "must be positive"]),
    (["eval", "--chunk-tokens", "0"], ["--chunk-tokens", "must be positive"]),
    (["eval", "--tokens", "many"], ["--tokens", "expected an integer"]),
    (["evict", "--max-bytes", "lots"], ["--max-bytes", "not a size"]),
    (["calibrate", "--model", "/nonexistent/model.gguf"], ["--model", "no such file"]),
    (["--log-level", "LOUD", "presets"], ["--log-level", "invalid choice"]),
])
def test_bad_arguments_are_one_line_and_status_2(capsys, argv, words):
    status, _, err = run(capsys, *argv)
    line = one_line(err)
    assert status == 2 and line.startswith("kvfetcher") and all(w in line for w in words), line


def test_a_bad_store_url_is_one_line_and_status_1(capsys):
    status, _, err = run(capsys, "evict", "--store", "s3://bucket/kv", "--once")
    assert status == 1 and "unknown store URL scheme 's3'" in one_line(err)


def test_a_malformed_log_setting_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv(config.LOG_LEVEL.name, "chatty")
    status, _, err = run(capsys, "presets")
    assert status == 2 and config.LOG_LEVEL.name in one_line(err)


@pytest.mark.parametrize("size, expected", [("10G", 10 * 10**9), ("700Gi", 700 * 2**30), ("1.5Ki", 1536), ("4096", 4096),
                                            ("1e3", 1000)])
def test_max_bytes_takes_the_quantities_a_pool_takes(capsys, monkeypatch, tmp_path, size, expected):
    from kvfetcher.store.retention import Evictor
    from kvfetcher_operator import spec

    assert config.quantity_bytes(size) == spec.quantity_bytes(size) == expected  # the CRD's reading, the CLI's
    bounds = []
    enforce = Evictor.enforce
    monkeypatch.setattr(Evictor, "enforce", lambda self, max_bytes, ttl_s: bounds.append(max_bytes) or enforce(self, max_bytes, ttl_s))
    status, out, err = run(capsys, "evict", "--store", str(tmp_path), "--max-bytes", size, "--once")
    assert status == 0 and json.loads(out)["errors"] == [], err
    assert bounds == [expected]


def test_version(capsys):
    status, out, _ = run(capsys, "--version")
    assert status == 0 and out.strip().startswith("kvfetcher ") and out.split()[1][0].isdigit()


def test_json_logs(capsys, monkeypatch):
    monkeypatch.setenv(config.LOG_FORMAT.name, "json")
    monkeypatch.setattr(cli, "_presets", lambda args: logging.getLogger("kvfetcher.test").info("hello %s", "there") or 0)
    status, _, err = run(capsys, "presets")
    record = json.loads(one_line(err))
    assert status == 0 and record["level"] == "INFO" and record["message"] == "hello there"
    assert record["logger"] == "kvfetcher.test" and "time" in record


def test_serve_logs_its_start_at_info_and_a_busy_port_is_one_line(tmp_path):
    port = free_port()
    env = dict(os.environ, KVFETCHER_STORE_DIR=str(tmp_path / "store"), KVFETCHER_WARM_UP="0", KVFETCHER_DECODE_PROCS="0")
    env.pop(config.LOG_LEVEL.name, None)
    serve = [sys.executable, "-m", "kvfetcher.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    first = subprocess.Popen(serve, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline, line = time.time() + 60, ""
        while "listening" not in line and time.time() < deadline:
            line = first.stderr.readline()
        assert line.startswith("INFO kvfetcher.api.server: kvfetcher sidecar listening"), line
        second = subprocess.run(serve, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith("kvfetcher serve: error:") and "address already in use" in last, last
    finally:
        first.terminate()
        first.wait(30)


@pytest.mark.slow
def test_a_text_shorter_than_asked_is_one_line(tmp_path):
    """Loads the real model (about 10 s)."""
    short = tmp_path / "short.txt"
    short.write_text("only a few words")
    done = subprocess.run([sys.executable, "-m", "kvfetcher.cli", "eval", "--text", str(short), "--tokens", "512"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr  # (above it: the model's loading bar)
    assert done.stderr.strip().splitlines()[-1].startswith("kvfetcher eval: error: text has only")


def test_the_operator_logs_json_at_the_configured_level(capsys, monkeypatch):
    from kvfetcher_operator.__main__ import configure_logging

    monkeypatch.setenv(config.LOG_FORMAT.name, "json")
    monkeypatch.setenv(config.LOG_LEVEL.name, "warning")
    configure_logging(verbose=False)
    logging.getLogger("kvfetcher_operator.test").info("not shown")
    logging.getLogger("kvfetcher_operator.test").warning("shown %d", 1)
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    ours = [r["message"] for r in records if r["message"] in ("shown 1", "not shown")]
    assert ours == ["shown 1"], records  # (other tests' operator threads may log here too)
