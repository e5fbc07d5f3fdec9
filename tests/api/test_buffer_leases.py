"""A registration lives no longer than the process that made it: the client leases it with a pidfd
of its process, and the sidecar releases the buffer when that process exits without unregistering
(a crashed or restarted engine must find its GPU's memory free, not mapped by the sidecar)."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from kvfetcher import ipc
from kvfetcher.api.client import KVClient
from kvfetcher.api.server import Embedded
from kvfetcher.config import Config
from kvfetcher.service import Sidecar
from kvfetcher.store.local import LocalStore

SHAPE = (2, 2, 1, 64, 8)

def _has_pidfds() -> bool:
    fd = ipc.lease_fd()
    if fd is not None:
        os.close(fd)
    return fd is not None


pytestmark = pytest.mark.skipif(not _has_pidfds(), reason="needs pidfds (Linux 5.3)")

CLIENT = """
import sys, time, torch
from kvfetcher import ipc
from kvfetcher.api.client import KVClient
buf = ipc.allocate({shape}, torch.float16)
print(KVClient(socket_path=sys.argv[1]).register(buf.handle, "m"), flush=True)
time.sleep(600)
"""


def served(tmp_path) -> Embedded:
    return Embedded(Sidecar(LocalStore(tmp_path / "store"), Config(chunk_tokens=32, presets=("raw",))), None, str(tmp_path / "kvfetcher.sock"))


def until(cond, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_buffer_is_released_when_the_process_that_registered_it_dies(tmp_path):
    with served(tmp_path) as sc:
        client = subprocess.Popen([sys.executable, "-c", CLIENT.format(shape=SHAPE), sc.socket], stdout=subprocess.PIPE, text=True)
        try:
            bid = client.stdout.readline().strip()
            assert bid in sc.sidecar.buffers and bid in sc.sidecar.leases
        finally:
            client.kill()  # no unregister, no goodbye
            client.wait()
        assert until(lambda: bid not in sc.sidecar.buffers), "the dead client's buffer is still registered"
        assert not sc.sidecar.leases and "kvfetcher_released_buffers_total 1.0" in KVClient(socket_path=sc.socket).metrics()


def test_a_live_clients_buffer_stays_and_unregistering_ends_its_lease(tmp_path):
    with served(tmp_path) as sc:
        c = KVClient(socket_path=sc.socket)
        buf = ipc.allocate(SHAPE, torch.float16)
        try:
            bid = c.register(buf.handle, "m")
            time.sleep(0.2)
            assert bid in sc.sidecar.buffers and bid in sc.sidecar.leases  # this process lives on
            c.unregister(bid)
            assert until(lambda: not sc.sidecar.leases) and bid not in sc.sidecar.buffers
        finally:
            buf.close()


def _lease(sock: str, message: dict, fd: int) -> dict:
    return ipc.pass_fd(ipc.fd_socket(sock), message, fd, 10.0)


def test_a_lease_needs_a_pidfd_and_a_registered_buffer_and_is_given_once(tmp_path):
    with served(tmp_path) as sc:
        buf = ipc.allocate(SHAPE, torch.float16)
        pidfd = ipc.lease_fd()
        r, w = os.pipe()
        try:
            bid = KVClient(socket_path=sc.socket).register(buf.handle, "m")  # leased already
            assert "already has a lease" in _lease(sc.socket, {"lease": bid}, pidfd)["detail"]
            assert "unknown buffer" in _lease(sc.socket, {"lease": "nope"}, pidfd)["detail"]
            assert "pidfd" in _lease(sc.socket, {"lease": bid}, r)["detail"]  # a pipe would read ready whenever its writer says
            with socket.socket(socket.AF_UNIX) as s:  # no fd at all
                s.connect(ipc.fd_socket(sc.socket))
                s.sendall(json.dumps({"lease": bid}).encode())
                s.shutdown(socket.SHUT_WR)
                assert "pidfd" in json.loads(s.makefile("rb").read())["detail"]
            assert list(sc.sidecar.buffers) == [bid] and list(sc.sidecar.leases) == [bid]
        finally:
            for fd in (pidfd, r, w):
                os.close(fd)
            buf.close()
