"""linkrelay: a TCP relay on loopback whose server-to-client direction is a paced link.

For a peer that speaks its own TCP protocol, not S3 (LMCache's ``lm://`` server): the client
connects to the relay, the relay to ``target``. Bytes back to the client go through a
:class:`~benchmarks.lib.linkserver.Pacer` (the link server's token bucket, its rate shared by
all connections); bytes to the server are not paced. ``stats()`` has the link server's keys:
``bytes_sent`` (to clients), ``bytes_received`` (from clients, protocol headers included).
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading

from benchmarks.lib.linkserver import MAX_SLICE, Pacer


def _pipe(src: socket.socket, dst: socket.socket, pacer: Pacer, paced: bool, ends: threading.Barrier) -> None:
    buf = memoryview(bytearray(MAX_SLICE))
    try:
        while n := src.recv_into(buf, pacer.slice_bytes() if paced else MAX_SLICE):
            if paced:
                pacer.take(n)
            else:
                pacer.received(n)
            dst.sendall(buf[:n])
    except OSError:
        pass
    finally:  # either side gone: both directions end
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        ends.wait()  # both directions out of their socket calls: closing is safe
        src.close()


def _serve(target: tuple[str, int], shared: tuple, q) -> None:
    pacer, lsock = Pacer(shared=shared), socket.create_server(("127.0.0.1", 0))
    q.put(lsock.getsockname()[1])
    while True:
        client, _ = lsock.accept()
        try:
            server = socket.create_connection(target, timeout=30)
        except OSError:
            client.close()
            continue
        server.settimeout(None)
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a small reply must not wait for an ACK
        ends = threading.Barrier(2)
        threading.Thread(target=_pipe, args=(client, server, pacer, False, ends), daemon=True).start()
        threading.Thread(target=_pipe, args=(server, client, pacer, True, ends), daemon=True).start()


class Relay:
    """A relay process: ``url`` (``tcp://127.0.0.1:PORT``), ``set_rate(bytes_per_s)`` (0:
    unlimited), ``stats()``, ``terminate()``."""

    def __init__(self, target: tuple[str, int], rate: float = 0.0):
        ctx = mp.get_context("spawn")
        shared, q = Pacer.shared_state(rate), ctx.Queue()
        self.pacer = Pacer(shared=shared)
        self.proc = ctx.Process(target=_serve, args=(target, shared, q), daemon=True)
        self.proc.start()
        self.url = f"tcp://127.0.0.1:{q.get(timeout=60)}"

    def set_rate(self, rate: float) -> None:
        self.pacer.set_rate(rate)

    def stats(self) -> dict:
        return self.pacer.stats()

    def terminate(self) -> None:
        self.proc.terminate()
        self.proc.join(10)
