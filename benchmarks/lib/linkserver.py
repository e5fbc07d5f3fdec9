"""linkserver: an S3-compatible object server on loopback whose link has a set bandwidth.

The TTFT benchmark needs "a 10 Gbit/s link to object storage" on one machine. This server
serves a directory as S3 buckets (enough of the API for the ``minio`` SDK, so the real
``kvfetcher.store.s3.S3Store`` reads and writes through it: GET with ranges, HEAD, PUT, S3
multipart uploads, DELETE, ListObjectsV2) and paces every response body through one token
bucket shared by all connections, so N parallel GETs share the set rate as they would share a
real link. Bodies go out with ``sendfile`` in slices of a few milliseconds' worth of bytes.
There is no added latency: first-byte latency is loopback's.

One Python process tops out near 20 Gbit/s on loopback (its GIL), so :func:`start_process`
runs ``procs`` server processes on one port (``SO_REUSEPORT``: the kernel spreads connections
over them) sharing one token bucket in shared memory (:class:`Pacer` over a ``multiprocessing``
array and lock): the set rate stays the total of them all. Whatever the set rate, what counts is
what was delivered: ``GET /_link``'s ``bytes_sent`` over a transfer's wall time (the benchmarks
report it beside the label), and ``--self-check`` measures the most this machine delivers with N
parallel ranged GETs.

Uploads (``PUT``; ``POST ?uploads``, ``PUT ?partNumber&uploadId``, ``POST ?uploadId``, ``DELETE
?uploadId``: the multipart upload the ``minio`` SDK uses for objects over 5 MiB) are not paced;
they are counted in ``bytes_received`` and ``objects_put`` (``discard_puts``: answered and
counted, their bytes not kept, for runs whose saves would fill the disk).

Control: ``POST /_link?rate=BYTES_PER_S`` (0: unlimited) sets the rate; ``GET /_link`` returns
``{"rate", "bytes_sent", "bytes_received", "objects_put", "procs"}``. Requests are not
authenticated (signatures are ignored).

    python -m benchmarks.lib.linkserver --root DIR --port 9000 --rate 1.25e9 --procs 8
    python -m benchmarks.lib.linkserver --self-check --procs 8 --parallel 16   # the most it delivers here
"""

from __future__ import annotations

import argparse
import email.utils
import hashlib
import json
import multiprocessing as mp
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

MIN_SLICE, MAX_SLICE = 64 * 1024, 8 * 1024 * 1024
BURST_S = 0.002  # the link time a late sender may catch up on (a real link's buffer)


class Pacer:
    """A shared link: bytes leave at ``rate`` bytes/s in total, whoever sends them.

    Each slice reserves the next ``n / rate`` seconds of the link and waits for its turn
    (an idle link saves up no more than :data:`BURST_S` of its time). ``rate`` 0 means unlimited. With
    ``shared`` (from :meth:`shared_state`) the state is in shared memory and server processes
    share one link; else it is this process' own.
    """

    RATE, NEXT_T, SENT, RECEIVED, PUTS = range(5)

    def __init__(self, rate: float = 0.0, shared: tuple | None = None):
        if shared is None:
            shared = (threading.Lock(), [float(rate), 0.0, 0.0, 0.0, 0.0])
        self.lock, self.v = shared

    @classmethod
    def shared_state(cls, rate: float = 0.0) -> tuple:
        """(lock, array) shared by the :class:`Pacer` of every server process (passed at spawn)."""
        ctx = mp.get_context("spawn")
        v = ctx.RawArray("d", 5)
        v[cls.RATE] = float(rate)
        return ctx.Lock(), v

    @property
    def rate(self) -> float:
        return self.v[self.RATE]

    @property
    def sent(self) -> int:
        return int(self.v[self.SENT])

    def stats(self) -> dict:
        with self.lock:
            v = list(self.v)
        return {"rate": v[self.RATE], "bytes_sent": int(v[self.SENT]), "bytes_received": int(v[self.RECEIVED]),
                "objects_put": int(v[self.PUTS])}

    def set_rate(self, rate: float) -> None:
        with self.lock:
            self.v[self.RATE], self.v[self.NEXT_T] = float(rate), 0.0

    def received(self, n: int, objects: int = 0) -> None:
        with self.lock:
            self.v[self.RECEIVED] += n
            self.v[self.PUTS] += objects

    def slice_bytes(self) -> int:
        rate = self.rate
        return MAX_SLICE if rate <= 0 else int(min(MAX_SLICE, max(MIN_SLICE, rate * 0.002)))

    def take(self, n: int) -> None:
        with self.lock:
            v = self.v
            v[self.SENT] += n
            rate = v[self.RATE]
            if rate <= 0:
                return
            now = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process
            # a sender that woke late may use the last BURST_S of the link's time it missed (else every
            # late wake-up is capacity lost and a fast link delivers less than its rate), no more
            start = max(now - BURST_S, v[self.NEXT_T])
            v[self.NEXT_T] = start + n / rate
        if start > now:
            time.sleep(start - now)


_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``Range`` header -> [start, end) within ``size``; None for the whole object.
    Raises ValueError for a range that starts past the end (S3's InvalidRange)."""
    if not header:
        return None
    m = _RANGE.match(header.strip())
    if not m or (m.group(1) == "" and m.group(2) == ""):
        return None  # malformed ranges are ignored, as HTTP says
    a, b = m.group(1), m.group(2)
    if a == "":  # suffix: the last b bytes
        n = min(int(b), size)
        return size - n, size
    start = int(a)
    end = size if b == "" else min(int(b) + 1, size)
    if start >= size or end <= start:
        raise ValueError(f"range {header} outside an object of {size} bytes")
    return start, end


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else a small body waits for the client's delayed ACK (40 ms)
    server: "LinkServer"

    def log_message(self, *args) -> None:  # quiet: thousands of requests per run
        pass

    # --- helpers ---------------------------------------------------------------------------

    def _target(self) -> tuple[str, str, dict]:
        u = urlsplit(self.path)
        path, q = unquote(u.path).lstrip("/"), parse_qs(u.query, keep_blank_values=True)
        if self.server.bucket and path != "_link":  # a client that names no bucket: the whole path is the key
            return self.server.bucket, path, q
        parts = path.split("/", 1)
        return parts[0], parts[1] if len(parts) > 1 else "", q

    def _file(self, bucket: str, key: str) -> Path:
        p = (self.server.root / bucket / key).resolve()
        if self.server.root.resolve() not in p.parents:
            raise PermissionError(key)
        return p

    def _reply(self, status: int, body: bytes = b"", ctype: str = "application/xml", headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, msg: str, bucket: str = "", key: str = "") -> None:
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{escape(msg)}</Message>'
            f"<Key>{escape(key)}</Key><BucketName>{escape(bucket)}</BucketName><Resource>/{escape(bucket)}/{escape(key)}</Resource>"
            "<RequestId>0</RequestId><HostId>linkserver</HostId></Error>"
        ).encode()
        self._reply(status, body)

    def _meta(self, path: Path) -> dict:
        st = path.stat()
        etag = hashlib.md5(f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}".encode()).hexdigest()
        return {"ETag": f'"{etag}"', "Last-Modified": email.utils.formatdate(st.st_mtime, usegmt=True), "Accept-Ranges": "bytes"}

    def _drain(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    # --- verbs -----------------------------------------------------------------------------

    def do_HEAD(self) -> None:
        bucket, key, _ = self._target()
        if not key:
            if (self.server.root / bucket).is_dir():
                return self._reply(200)
            return self._error(404, "NoSuchBucket", "no such bucket", bucket)
        try:
            p = self._file(bucket, key)
            size = p.stat().st_size
        except (OSError, PermissionError):
            return self._error(404, "NoSuchKey", "no such key", bucket, key)
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.send_header("Content-Type", "application/octet-stream")
        for k, v in self._meta(p).items():
            self.send_header(k, v)
        self.end_headers()

    def do_GET(self) -> None:
        bucket, key, q = self._target()
        if bucket == "_link":
            body = json.dumps({**self.server.pacer.stats(), "procs": self.server.procs}).encode()
            return self._reply(200, body, "application/json")
        if not key:
            if "location" in q:
                return self._reply(200, b'<?xml version="1.0" encoding="UTF-8"?><LocationConstraint>us-east-1</LocationConstraint>')
            return self._list(bucket, q)
        try:
            p = self._file(bucket, key)
            f = open(p, "rb")
        except (OSError, PermissionError):
            return self._error(404, "NoSuchKey", "The specified key does not exist.", bucket, key)
        with f:
            size = os.fstat(f.fileno()).st_size
            try:
                rng = parse_range(self.headers.get("Range"), size)
            except ValueError as e:
                return self._error(416, "InvalidRange", str(e), bucket, key)
            start, end = rng or (0, size)
            self.send_response(206 if rng else 200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start))
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            for k, v in self._meta(p).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.flush()
            self._send(f.fileno(), start, end)

    def _send(self, fd: int, start: int, end: int) -> None:
        pacer, out = self.server.pacer, self.connection.fileno()
        pos = start
        while pos < end:
            n = min(pacer.slice_bytes(), end - pos)
            pacer.take(n)
            stop = pos + n
            while pos < stop:
                sent = os.sendfile(out, fd, pos, stop - pos)
                if sent == 0:
                    raise ConnectionError("client went away")
                pos += sent

    def _list(self, bucket: str, q: dict) -> None:
        root = self.server.root / bucket
        if not root.is_dir():
            return self._error(404, "NoSuchBucket", "no such bucket", bucket)
        prefix = q.get("prefix", [""])[0]
        # Only the directory the prefix names is walked (prefixes are chunk folders here).
        base = root / os.path.dirname(prefix) if "/" in prefix else root
        items = []
        if base.is_dir():
            for dirpath, _, files in os.walk(base):
                for fn in files:
                    rel = os.path.relpath(os.path.join(dirpath, fn), root)
                    if rel.startswith(prefix) and ".tmp" not in fn:
                        st = os.stat(os.path.join(dirpath, fn))
                        items.append((rel, st.st_size, st.st_mtime))
        items.sort()
        contents = "".join(
            f"<Contents><Key>{escape(k)}</Key><LastModified>{time.strftime('%Y-%m-%dT%H:%M:%S.000Z', time.gmtime(m))}</LastModified>"
            f'<ETag>"0"</ETag><Size>{s}</Size><StorageClass>STANDARD</StorageClass></Contents>'
            for k, s, m in items
        )
        body = (
            '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(items)}</KeyCount>"
            f"<MaxKeys>100000</MaxKeys><IsTruncated>false</IsTruncated>{contents}</ListBucketResult>"
        ).encode()
        self._reply(200, body)

    def do_PUT(self) -> None:
        bucket, key, q = self._target()
        data = self._drain()
        if not key:
            (self.server.root / bucket).mkdir(parents=True, exist_ok=True)
            return self._reply(200)
        if "uploadId" in q:  # a part of a multipart upload
            try:
                d, n = self._upload_dir(q["uploadId"][0]), int(q["partNumber"][0])
            except (PermissionError, KeyError, ValueError):
                return self._error(400, "InvalidArgument", "bad uploadId or partNumber", bucket, key)
            if not d.is_dir():
                return self._error(404, "NoSuchUpload", "no such upload", bucket, key)
            if not self.server.discard_puts:
                (d / f"{n:05d}").write_bytes(data)
            self.server.pacer.received(len(data))
            return self._reply(200, headers={"ETag": f'"{hashlib.md5(data).hexdigest()}"'})
        p = self._file(bucket, key)
        self.server.pacer.received(len(data), 1)
        if self.server.discard_puts:
            return self._reply(200, headers={"ETag": f'"{hashlib.md5(data).hexdigest()}"'})
        self._write(p, [data])
        self._reply(200, headers=self._meta(p))

    def _write(self, p: Path, parts) -> None:
        """``parts`` (bytes or files) as the object at ``p``, atomically (a reader never sees half)."""
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + f".tmp{os.getpid()}-{threading.get_ident()}")
        with open(tmp, "wb") as out:
            for part in parts:
                out.write(part if isinstance(part, bytes) else part.read_bytes())
        os.replace(tmp, p)

    def _upload_dir(self, upload_id: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{32}", upload_id):
            raise PermissionError(upload_id)
        return self.server.root / "_uploads" / upload_id

    def do_DELETE(self) -> None:
        bucket, key, q = self._target()
        if "uploadId" in q:  # abort a multipart upload
            try:
                shutil.rmtree(self._upload_dir(q["uploadId"][0]), ignore_errors=True)
            except PermissionError:
                pass
            return self._reply(204)
        try:
            self._file(bucket, key).unlink()
        except (OSError, PermissionError):
            pass
        self._reply(204)

    def do_POST(self) -> None:
        bucket, key, q = self._target()
        body = self._drain()
        if bucket == "_link" and "rate" in q:
            self.server.pacer.set_rate(float(q["rate"][0]))
            return self._reply(200, json.dumps({"rate": self.server.pacer.rate}).encode(), "application/json")
        if key and "uploads" in q:  # start a multipart upload
            upload_id = uuid.uuid4().hex
            self._upload_dir(upload_id).mkdir(parents=True)
            return self._reply(200, (
                '<?xml version="1.0" encoding="UTF-8"?><InitiateMultipartUploadResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                f"<Bucket>{escape(bucket)}</Bucket><Key>{escape(key)}</Key><UploadId>{upload_id}</UploadId>"
                "</InitiateMultipartUploadResult>").encode())
        if key and "uploadId" in q:  # complete it: the parts the body lists, in its order
            try:
                d = self._upload_dir(q["uploadId"][0])
            except PermissionError:
                return self._error(400, "InvalidArgument", "bad uploadId", bucket, key)
            if not d.is_dir():
                return self._error(404, "NoSuchUpload", "no such upload", bucket, key)
            numbers = [int(n) for n in re.findall(rb"<PartNumber>\s*(\d+)\s*</PartNumber>", body)]
            numbers = numbers or sorted(int(f.name) for f in d.iterdir())
            if self.server.discard_puts:
                shutil.rmtree(d, ignore_errors=True)
                self.server.pacer.received(0, 1)
                return self._reply(200, (
                    '<?xml version="1.0" encoding="UTF-8"?><CompleteMultipartUploadResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                    f"<Bucket>{escape(bucket)}</Bucket><Key>{escape(key)}</Key><ETag>\"0\"</ETag></CompleteMultipartUploadResult>").encode())
            if not all((d / f"{n:05d}").is_file() for n in numbers):
                return self._error(400, "InvalidPart", "a listed part was not uploaded", bucket, key)
            p = self._file(bucket, key)
            self._write(p, [d / f"{n:05d}" for n in numbers])
            shutil.rmtree(d, ignore_errors=True)
            self.server.pacer.received(0, 1)
            return self._reply(200, (
                '<?xml version="1.0" encoding="UTF-8"?><CompleteMultipartUploadResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                f"<Location>/{escape(bucket)}/{escape(key)}</Location><Bucket>{escape(bucket)}</Bucket><Key>{escape(key)}</Key>"
                f"<ETag>{escape(self._meta(p)['ETag'])}</ETag></CompleteMultipartUploadResult>").encode())
        return self._error(400, "InvalidRequest", "POST is /_link?rate=BYTES_PER_S or a multipart upload (?uploads, ?uploadId)")


class LinkServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024

    def __init__(self, root: str | Path, port: int = 0, rate: float = 0.0, host: str = "127.0.0.1", shared: tuple | None = None,
                 reuse_port: bool = False, procs: int = 1, discard_puts: bool = False, bucket: str = ""):
        self.root = Path(root)
        self.bucket = bucket  # set: every path is a key in this bucket (LMCache's S3 connector sends "/<key>")
        self.discard_puts = discard_puts  # uploads counted, their bytes not kept (a long run's saves would fill the disk)
        self.pacer = Pacer(rate, shared)
        self.reuse_port, self.procs = reuse_port, procs
        super().__init__((host, port), Handler)

    def server_bind(self) -> None:
        if self.reuse_port:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()

    @property
    def url(self) -> str:
        return f"http://{self.server_address[0]}:{self.server_address[1]}"


def free_port() -> int:
    """A loopback port nothing listens on (the OS's pick, released at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_thread(root: str | Path, rate: float = 0.0) -> LinkServer:
    """A server in a daemon thread of this process (tests); ``shutdown()`` stops it."""
    srv = LinkServer(root, 0, rate)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _serve(root: str, port: int, shared: tuple, procs: int, q, discard_puts: bool = False, bucket: str = "") -> None:
    srv = LinkServer(root, port, shared=shared, reuse_port=True, procs=procs, discard_puts=discard_puts, bucket=bucket)
    q.put(srv.url)
    srv.serve_forever()


class ServerGroup:
    """The server processes of one link; ``terminate()`` stops them all."""

    def __init__(self, procs: list):
        self.procs = procs

    def terminate(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.join(10)

    def is_alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)


def default_procs() -> int:
    """Server processes for this machine: half its cores, 1 to 8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def start_process(root: str | Path, rate: float = 0.0, procs: int = 1, discard_puts: bool = False,
                  bucket: str = "") -> tuple[str, ServerGroup]:
    """``procs`` servers, each a process of its own, on one port (``SO_REUSEPORT``) sharing one
    link, so pacing and sendfile take no GIL from the client or from each other: (url, group).
    ``discard_puts``: uploads are answered and counted, their bytes not kept. ``bucket``: every
    request path is a key in that bucket (clients that name none)."""
    ctx = mp.get_context("spawn")
    shared = Pacer.shared_state(rate)
    q = ctx.Queue()
    group = ServerGroup([])
    port = 0
    for _ in range(max(1, procs)):
        p = ctx.Process(target=_serve, args=(str(root), port, shared, procs, q, discard_puts, bucket), daemon=True)
        p.start()
        group.procs.append(p)
        url = q.get(timeout=60)
        port = port or int(url.rsplit(":", 1)[1])
    return f"http://127.0.0.1:{port}", group

def set_rate(url: str, rate_Bps: float) -> None:
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{url}/_link?rate={rate_Bps}", data=b"", method="POST"), timeout=10).read()


def stats(url: str) -> dict:
    import urllib.request

    return json.loads(urllib.request.urlopen(f"{url}/_link", timeout=10).read())



# --- self-check: the most this machine delivers ---------------------------------------------------


def _reader(url: str, name: str, size: int, piece: int, go, stop, q) -> None:
    """Ranged GETs of ``piece`` bytes, round the object, from ``go`` until ``stop`` (events): says
    "ready" on ``q`` once started, then the bytes read."""
    import http.client

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    buf = bytearray(piece)
    got, pos = 0, 0
    q.put("ready")
    go.wait(120)
    while not stop.is_set():
        end = min(pos + piece, size)
        conn.request("GET", f"/bench/{name}", headers={"Range": f"bytes={pos}-{end - 1}"})
        r = conn.getresponse()
        view, left = memoryview(buf), end - pos
        while left:
            n = r.readinto(view[: min(left, len(view))])
            if not n:
                raise ConnectionError("short body")
            left -= n
            got += n
        pos = 0 if end >= size else end
    conn.close()
    q.put(got)


def self_check(procs: int, parallel: int, seconds: float = 5.0, rate: float = 0.0, object_mib: int = 256,
               piece_mib: int = 8) -> dict:
    """Deliver one object with ``parallel`` readers (processes, one connection each, ranged GETs
    of ``piece_mib``) from ``procs`` server processes at ``rate`` (0: unpaced) for ``seconds``,
    timed once every reader has started (a slow start must not pass for a slow link): the rate
    delivered, by the server's counter and by the readers'."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "bench").mkdir()
        size = object_mib << 20
        with open(Path(root) / "bench" / "obj", "wb") as f:
            f.write(os.urandom(1 << 20) * object_mib)
        url, group = start_process(root, rate, procs)
        try:
            q, go, stop = ctx.Queue(), ctx.Event(), ctx.Event()
            before = stats(url)["bytes_sent"]
            readers = [ctx.Process(target=_reader, args=(url, "obj", size, piece_mib << 20, go, stop, q)) for _ in range(parallel)]
            for p in readers:
                p.start()
            for _ in readers:
                q.get(timeout=120)  # "ready"
            a, t1 = stats(url)["bytes_sent"], time.monotonic()
            go.set()
            time.sleep(seconds)
            b, t2 = stats(url)["bytes_sent"], time.monotonic()
            stop.set()
            total = sum(q.get(timeout=120) for _ in readers)
            for p in readers:
                p.join(30)
        finally:
            group.terminate()
    gbit = (b - a) * 8 / (t2 - t1) / 1e9
    return {"procs": procs, "parallel": parallel, "set_gbit": rate * 8 / 1e9, "seconds": round(t2 - t1, 2),
            "delivered_gbit": round(gbit, 2), "readers_bytes": total, "server_bytes": b - before, "cpus": os.cpu_count()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", help="the directory served (its folders are buckets)")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--rate", type=float, default=0.0, help="bytes per second, 0: unlimited")
    ap.add_argument("--procs", type=int, default=default_procs(), help="server processes sharing the link (SO_REUSEPORT)")
    ap.add_argument("--self-check", action="store_true", help="measure the most this machine delivers, then exit")
    ap.add_argument("--parallel", type=int, default=16, help="self-check: parallel readers (ranged GETs)")
    ap.add_argument("--seconds", type=float, default=5.0, help="self-check: seconds measured")
    a = ap.parse_args()
    if a.self_check:
        res = self_check(a.procs, a.parallel, a.seconds, a.rate)
        print(json.dumps(res))
        paced = f", paced at {res['set_gbit']:.1f}" if a.rate else ", unpaced"
        print(f"linkserver self-check: {res['delivered_gbit']:.1f} Gbit/s delivered by {a.procs} server processes to {a.parallel} "
              f"parallel ranged GETs{paced} ({res['cpus']} CPUs)", flush=True)
        return
    if not a.root:
        ap.error("--root is required (or --self-check)")
    url, group = start_process(a.root, a.rate, a.procs)
    print(f"serving {a.root} at {url}, rate {a.rate:.3g} B/s, {a.procs} processes", flush=True)
    try:
        while group.is_alive():
            time.sleep(1)
    finally:
        group.terminate()


if __name__ == "__main__":
    main()
