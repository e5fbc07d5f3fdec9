"""linkserver: an S3-compatible object server on loopback whose link has a set bandwidth.

The TTFT benchmark needs "a 10 Gbit/s link to object storage" on one machine. This server
serves a directory as S3 buckets (enough of the API for the ``minio`` SDK, so the real
``kvfetcher.store.s3.S3Store`` reads through it: GET with ranges, HEAD, PUT, DELETE,
ListObjectsV2) and paces every response body through one token bucket shared by all
connections, so N parallel GETs share the set rate as they would share a real link. Bodies
go out with ``sendfile`` in slices of a few milliseconds' worth of bytes, so high rates
(tens of Gbit/s) cost little CPU. There is no added latency: first-byte latency is loopback's.

Control: ``POST /_link?rate=BYTES_PER_S`` (0: unlimited) sets the rate; ``GET /_link`` returns
``{"rate": ..., "bytes_sent": ...}``. Requests are not authenticated (signatures are ignored).

    python -m benchmarks.lib.linkserver --root DIR --port 9000 --rate 1.25e9
"""

from __future__ import annotations

import argparse
import email.utils
import hashlib
import json
import multiprocessing as mp
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

MIN_SLICE, MAX_SLICE = 64 * 1024, 4 * 1024 * 1024


class Pacer:
    """A shared link: bytes leave at ``rate`` bytes/s in total, whoever sends them.

    Each slice reserves the next ``n / rate`` seconds of the link and waits for its turn
    (no burst credit: an idle link does not save up). ``rate`` 0 means unlimited.
    """

    def __init__(self, rate: float = 0.0):
        self.lock = threading.Lock()
        self.rate = float(rate)
        self.next_t = 0.0
        self.sent = 0

    def set_rate(self, rate: float) -> None:
        with self.lock:
            self.rate, self.next_t = float(rate), 0.0

    def slice_bytes(self) -> int:
        return MAX_SLICE if self.rate <= 0 else int(min(MAX_SLICE, max(MIN_SLICE, self.rate * 0.002)))

    def take(self, n: int) -> None:
        with self.lock:
            self.sent += n
            if self.rate <= 0:
                return
            now = time.perf_counter()
            start = max(now, self.next_t)
            self.next_t = start + n / self.rate
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
        parts = unquote(u.path).lstrip("/").split("/", 1)
        return parts[0], parts[1] if len(parts) > 1 else "", parse_qs(u.query, keep_blank_values=True)

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
            body = json.dumps({"rate": self.server.pacer.rate, "bytes_sent": self.server.pacer.sent}).encode()
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
        bucket, key, _ = self._target()
        data = self._drain()
        if not key:
            (self.server.root / bucket).mkdir(parents=True, exist_ok=True)
            return self._reply(200)
        p = self._file(bucket, key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + f".tmp{threading.get_ident()}")
        tmp.write_bytes(data)
        os.replace(tmp, p)
        self._reply(200, headers=self._meta(p))

    def do_DELETE(self) -> None:
        bucket, key, _ = self._target()
        try:
            self._file(bucket, key).unlink()
        except (OSError, PermissionError):
            pass
        self._reply(204)

    def do_POST(self) -> None:
        bucket, _, q = self._target()
        self._drain()
        if bucket != "_link" or "rate" not in q:
            return self._error(400, "InvalidRequest", "only POST /_link?rate=BYTES_PER_S is supported")
        self.server.pacer.set_rate(float(q["rate"][0]))
        self._reply(200, json.dumps({"rate": self.server.pacer.rate}).encode(), "application/json")


class LinkServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, root: str | Path, port: int = 0, rate: float = 0.0, host: str = "127.0.0.1"):
        self.root = Path(root)
        self.pacer = Pacer(rate)
        super().__init__((host, port), Handler)

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


def _serve(root: str, rate: float, q) -> None:
    srv = LinkServer(root, 0, rate)
    q.put(srv.url)
    srv.serve_forever()


def start_process(root: str | Path, rate: float = 0.0) -> tuple[str, mp.Process]:
    """A server in its own process, so pacing and sendfile take no GIL from the client: (url, process)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_serve, args=(str(root), rate, q), daemon=True)
    p.start()
    return q.get(timeout=60), p


def set_rate(url: str, rate_Bps: float) -> None:
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{url}/_link?rate={rate_Bps}", data=b"", method="POST"), timeout=10).read()


def stats(url: str) -> dict:
    import urllib.request

    return json.loads(urllib.request.urlopen(f"{url}/_link", timeout=10).read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--rate", type=float, default=0.0, help="bytes per second, 0: unlimited")
    a = ap.parse_args()
    srv = LinkServer(a.root, a.port, a.rate)
    print(f"serving {a.root} at {srv.url}, rate {a.rate:.3g} B/s", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
