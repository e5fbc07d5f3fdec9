"""A client can neither make the sidecar map memory it names, nor
fault a registered buffer under it, nor register or reach another client's buffer, and the Unix
socket is never connectable by others. The race and the SIGBUS run against a sidecar in a
subprocess, as a hostile client would meet it."""

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from kvfetcher import ipc
from kvfetcher.api.client import KVClient, SidecarError
from kvfetcher.api.server import Embedded
from kvfetcher.config import Config
from kvfetcher.fetch.plan import FetchOptions
from kvfetcher.service import Sidecar
from kvfetcher.store.local import LocalStore

import kvtest

SHAPE = (2, 2, 1, 64, 8)  # [layers, 2, kv_heads, capacity, head_dim], float16
NBYTES = 2 * 2 * 1 * 64 * 8 * 2
TOKEN = "t0ken"


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", path, json.dumps(body), {"Authorization": f"Bearer {TOKEN}"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


# --- nothing a client names by path is ever mapped ------------------------------------

FLIPPER = """
import os, sys
from kvfetcher.fetch.plan import FetchOptions
name, good, victim = sys.argv[1:]
tmp = name + ".tmp"
while True:
    for target in (good, victim):
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if target == good:
            os.link(good, tmp)
        else:
            os.symlink(victim, tmp)
        os.replace(tmp, name)
"""


def test_a_path_swapped_for_a_symlink_is_never_mapped(tmp_path, monkeypatch):
    """A client flips a name in the buffer directory between a real buffer file and a symlink to a
    victim file while registering it by that name: the sidecar must never map the victim."""
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("KVFETCHER_SHM_DIR", str(shm))  # where a path-based sidecar looked for buffers
    good, victim, name = shm / "kvfetcher-good", tmp_path / "victim", shm / "kvfetcher-flip"
    good.write_bytes(b"\0" * NBYTES)
    victim.write_bytes(b"\1" * NBYTES)
    flipper = subprocess.Popen([sys.executable, "-c", FLIPPER, str(name), str(good), str(victim)])
    try:
        with Embedded(Sidecar(LocalStore(tmp_path / "store"), Config(chunk_tokens=32, presets=("raw",))), TOKEN) as sc:
            handle = {"kind": "shm", "path": str(name), "shape": list(SHAPE), "dtype": "float16"}
            registered, deadline = 0, time.monotonic() + 5
            while time.monotonic() < deadline:
                status, reply = _post(sc.where["port"], "/v1/buffers", {"handle": handle, "model": "m"})
                registered += status == 200
                maps = open("/proc/self/maps").read()
                assert str(victim) not in maps, f"the sidecar mapped the victim after {registered} registrations"
            assert registered == 0, "a buffer was registered by its name"
    finally:
        flipper.kill()
        flipper.wait()


# --- a client that shrinks its buffer cannot kill the sidecar --------------------------

def _shrink(handle: dict) -> None:
    """What a careless or hostile client does to its registered buffer: truncate it."""
    if "path" in handle:
        os.truncate(handle["path"], 0)
    else:
        os.ftruncate(handle["fd"], 0)


@pytest.fixture
def served(tmp_path):
    """``kvfetcher serve`` on a Unix socket only, in a subprocess; yields (process, socket path)."""
    sock = str(tmp_path / "run" / "kvfetcher.sock")
    with kvtest.served(sock, dict(KVFETCHER_STORE_DIR=str(tmp_path / "store"), KVFETCHER_PRESET="raw", KVFETCHER_CHUNK_TOKENS="32")) as proc:
        yield proc, sock


def test_a_client_truncating_its_buffer_cannot_kill_the_sidecar(served):
    proc, sock = served
    c = KVClient(socket_path=sock)
    buf = ipc.allocate(SHAPE, torch.float16)
    try:
        buf.tensor.normal_()
        kv = buf.tensor.clone()
        bid = c.register(buf.handle, "m")
        with contextlib.suppress(PermissionError):  # a sealed memfd refuses to shrink
            _shrink(buf.handle)
        tokens = list(range(64))
        c.store(bid, tokens)
        c.flush()
        buf.tensor.zero_()
        r = c.fetch(bid, tokens, options=FetchOptions(recompute_tokens_per_s=1e-6))
        assert proc.poll() is None, "the sidecar died"
        assert r.loaded_tokens == 64 and torch.equal(buf.tensor, kv), r
    finally:
        buf.close()
    assert proc.poll() is None and "kvfetcher_" in c.metrics()


def test_a_buffer_that_could_shrink_is_refused(served):
    """A client passing its own memfd without the seals (or not a memfd) is refused at registration."""
    proc, sock = served
    c = KVClient(socket_path=sock)
    for seals in (0, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW):  # unsealed; seals that could still change
        fd = os.memfd_create("hostile", os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, NBYTES)
            if seals:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            with pytest.raises(SidecarError, match="sealed") as e:
                c.register(ipc.memfd_handle(fd, SHAPE, "float16"), "m")
            assert e.value.status == 400
        finally:
            os.close(fd)
    assert proc.poll() is None


# --- a buffer belongs to the client that registered it ---------------------------------

def test_another_client_cannot_register_or_reach_a_buffer(tmp_path):
    sock = str(tmp_path / "kvfetcher.sock")
    with Embedded(Sidecar(LocalStore(tmp_path / "store"), Config(chunk_tokens=32, presets=("raw",))), TOKEN, sock) as sc:
        a = ipc.allocate(SHAPE, torch.float16)
        try:
            bid = KVClient(socket_path=sock).register(a.handle, "m")
            held = sc.sidecar.buffers[bid].handle  # the sidecar's own fd of A's buffer
            for handle in (a.handle, held):  # naming A's memory, as A or as the sidecar holds it
                status, reply = _post(sc.where["port"], "/v1/buffers", {"handle": handle, "model": "m"})
                assert status == 400 and "only a CUDA handle" in reply["detail"], reply
            # on the buffer socket, the only memory is the fd passed: a message without one is refused
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(ipc.fd_socket(sock))
                s.sendall(json.dumps({"handle": dict(held, kind="memfd"), "model": "m"}).encode())
                s.shutdown(socket.SHUT_WR)
                reply = json.loads(s.makefile("rb").read())
            assert reply["error"] == "bad_request" and "pass exactly one memfd" in reply["detail"], reply
            assert list(sc.sidecar.buffers) == [bid]
            assert len(bid) >= 32  # the id is the capability: 192 random bits
        finally:
            a.close()


# --- the Unix sockets are never connectable by others -------------------------------

def test_the_unix_sockets_are_never_world_connectable_even_under_umask_0(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o777)  # a world-searchable directory: only the socket's own protection counts
    exposed = []
    real_bind = socket.socket.bind

    def bind(self, address):
        real_bind(self, address)
        if self.family == socket.AF_UNIX:  # at this instant, could anyone connect?
            parent = os.path.dirname(address)
            if os.stat(address).st_mode & 0o002 and os.stat(parent).st_mode & 0o001:
                exposed.append(address)

    monkeypatch.setattr(socket.socket, "bind", bind)
    old = os.umask(0)
    try:
        sock = str(run / "kvfetcher.sock")
        with Embedded(Sidecar(LocalStore(tmp_path / "store"), Config()), TOKEN, socket_path=sock):
            assert exposed == [], f"bound world-connectable: {exposed}"
            for path in (sock, ipc.fd_socket(sock)):
                assert os.stat(path).st_mode & 0o777 == 0o660, path
            assert sorted(os.listdir(run)) == ["kvfetcher.sock", "kvfetcher.sock.fd"]  # no private directory left
    finally:
        os.umask(old)


# --- the memfd checks themselves -----------------------------------------------------------------

def test_only_a_sealed_tmpfs_memfd_of_the_buffers_size_opens(tmp_path):
    b = ipc.allocate(SHAPE, torch.float16)
    try:
        with pytest.raises(ValueError, match="not"):
            ipc.open_handle(dict(b.handle, shape=[4, 2, 1, 64, 8]))  # the size must be the buffer's
        ro = os.open(f"/proc/self/fd/{b.handle['fd']}", os.O_RDONLY)
        try:
            with pytest.raises(ValueError, match="read-write"):
                ipc.open_handle(ipc.memfd_handle(ro, SHAPE, "float16"))
        finally:
            os.close(ro)
        f = tmp_path / "file"
        f.write_bytes(b"\0" * NBYTES)
        fd = os.open(f, os.O_RDWR)
        try:
            with pytest.raises(ValueError, match="sealed"):
                ipc.open_handle(ipc.memfd_handle(fd, SHAPE, "float16"))
        finally:
            os.close(fd)
    finally:
        b.close()


def test_a_handle_whose_fd_now_names_other_memory_is_refused():
    a, b = ipc.allocate(SHAPE, torch.float16), ipc.allocate(SHAPE, torch.float16)
    stale = dict(a.handle)
    a.close()
    os.dup2(b.handle["fd"], stale["fd"])  # the number now names B's memory
    try:
        with pytest.raises(ValueError, match="another file"):
            ipc.open_handle(stale)
    finally:
        os.close(stale["fd"])
        b.close()


def test_a_buffer_not_shaped_like_kv_is_refused_and_released(tmp_path):
    """[layers, 2, kv_heads, capacity, head_dim] or a 400; the sidecar keeps no fd of a refused buffer."""
    sock = str(tmp_path / "run" / "kvfetcher.sock")
    with Embedded(Sidecar(LocalStore(tmp_path / "store"), Config(chunk_tokens=32, presets=("raw",))), TOKEN, sock) as sc:
        c = KVClient(socket_path=sock)
        for shape in ((2, 3, 1, 64, 8), (2, 2, 64, 8)):
            buf = ipc.allocate(shape, torch.float16)
            try:
                before = len(os.listdir("/proc/self/fd"))
                with pytest.raises(SidecarError, match="KV buffer must be") as e:
                    c.register(buf.handle, "m")
                assert e.value.status == 400 and not sc.sidecar.buffers
                assert len(os.listdir("/proc/self/fd")) <= before  # the received fd was closed again
            finally:
                buf.close()
