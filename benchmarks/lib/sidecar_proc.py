"""sidecar_proc: `kvfetcher serve` as its own process on a Unix socket, for benchmarks and tests
that run a serving engine against the real sidecar (and may kill it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvfetcher.api.client import KVClient


class SidecarProcess:
    """``kvfetcher serve --socket PATH`` (no TCP) with ``env`` added to this process' environment
    (``KVFETCHER_*`` settings: store, presets, chunk size); :meth:`start` returns once it answers.
    ``setup``: Python statements the sidecar's process runs first (a benchmark's variant of the library)."""

    def __init__(self, socket: str | Path, log: str | Path | None = None, setup: str = "", **env: str):
        self.socket = str(socket)
        self.env = dict(os.environ, **{"KVFETCHER_TRUST_STORE": "1", **env})  # (a benchmark's own store: docs/security.md)
        self.log = log
        self.setup = setup
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60) -> "SidecarProcess":
        out = open(self.log, "a") if self.log else subprocess.DEVNULL
        args = ["serve", "--port", "-1", "--socket", self.socket]
        cmd = ["-c", f"{self.setup}\nimport sys\nfrom kvfetcher.cli import main\nsys.exit(main({args!r}))"] if self.setup else ["-m", "kvfetcher.cli", *args]
        self.proc = subprocess.Popen([sys.executable, *cmd], env=self.env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the sidecar exited with {self.proc.returncode}")
            try:
                self.client(5).flush()
                return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("the sidecar never answered")

    def client(self, timeout_s: float = 60) -> KVClient:
        return KVClient(socket_path=self.socket, token="", timeout_s=timeout_s)

    def kill(self) -> None:
        """SIGKILL: no drain, the socket file stays behind."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
