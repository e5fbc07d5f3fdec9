"""S3-compatible object storage through the ``minio`` SDK (MinIO in production).

A PUT is atomic by nature (an object appears whole or not at all); a HEAD first makes
re-storing an existing chunk a cheap no-op. Reads use ranged GETs. The HTTP pool is sized
for the fetch pipeline's concurrent GETs and retries little: a store that is down should
turn into a recompute quickly, not after a long backoff.

Connections are kept alive: a response read to its end goes back to the pool (a response
abandoned mid-body is closed instead). Over plain HTTP on Linux a range's body lands in the
caller's buffer through one blocking ``recv_into(MSG_WAITALL)`` on the connection's socket (with
the read timeout as ``SO_RCVTIMEO``): the GIL is released once per range rather than once per
socket read, so reader threads are not starved by busy Python threads in the same process.
"""

from __future__ import annotations

import contextlib
import functools
import io
import socket
import struct
import sys
from urllib.parse import urlparse

import urllib3
from minio import Minio
from minio.error import S3Error

from kvfetcher.store import NotFound, Stat, StoreError, Unavailable, fill

_MISSING = {"NoSuchKey", "NoSuchObject", "NotFound", "ResourceNotFound"}


def _http(connect_s: float, read_s: float, pool: int, ca_file: str | None, verify_tls: bool) -> urllib3.PoolManager:
    retry = urllib3.Retry(total=1, connect=0, backoff_factor=0.05, status_forcelist=[500, 502, 503, 504])
    tls = {"cert_reqs": "CERT_REQUIRED", "ca_certs": ca_file} if verify_tls else {"cert_reqs": "CERT_NONE"}
    return urllib3.PoolManager(timeout=urllib3.Timeout(connect=connect_s, read=read_s), maxsize=pool, retries=retry, **tls)


class S3Store:
    def __init__(
        self,
        endpoint: str,
        bucket: str,
        access_key: str,
        secret_key: str,
        *,
        region: str = "us-east-1",
        create_bucket: bool = False,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float = 30.0,
        pool: int = 32,
        ca_file: str | None = None,
        verify_tls: bool = True,
    ):
        self._args = (endpoint, bucket, access_key, secret_key)
        self._kw = dict(region=region, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s, pool=pool, ca_file=ca_file,
                        verify_tls=verify_tls)
        u = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
        self.endpoint = f"{u.scheme}://{u.netloc}/{bucket}"
        self.bucket = bucket
        self.client = Minio(
            u.netloc,
            access_key=access_key,
            secret_key=secret_key,
            secure=u.scheme == "https",
            region=region,
            http_client=_http(connect_timeout_s, read_timeout_s, pool, ca_file, verify_tls),
        )
        if create_bucket:
            self._call(lambda: self.client.bucket_exists(bucket) or self.client.make_bucket(bucket))

    def opener(self):
        """A picklable call that opens this store again (in another process: it carries the credentials)."""
        return functools.partial(S3Store, *self._args, **self._kw)

    def _call(self, fn, name: str = ""):
        try:
            return fn()
        except S3Error as e:
            if e.code in _MISSING:
                raise NotFound(f"no object {name!r} in bucket {self.bucket!r}") from None
            raise StoreError(f"S3 {e.code}: {e.message}") from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise Unavailable(f"S3 endpoint {self.endpoint} unreachable: {type(e).__name__}: {e}") from e

    def put(self, name: str, data: bytes) -> bool:
        if self.exists(name):
            return False
        self._call(
            lambda: self.client.put_object(
                self.bucket, name, io.BytesIO(data), len(data), content_type="application/octet-stream"
            ),
            name,
        )
        return True

    @contextlib.contextmanager
    def _response(self, name: str, offset: int, length: int):
        """A ranged GET's response; its connection goes back to the pool if the body was read to
        its end (the block left without an exception), else it is closed."""
        r = self.client.get_object(self.bucket, name, offset=offset, length=length)
        try:
            yield r
        except BaseException:
            r.close()
            raise
        r.release_conn()

    def get(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        def read() -> bytes:
            with self._response(name, offset, length or 0) as r:
                return r.read()

        return self._ranged(read, name, b"")

    def _ranged(self, read, name: str, past_end):
        """``read()`` through :meth:`_call`; a range that starts past the end gives ``past_end``."""
        try:
            return self._call(read, name)
        except StoreError as e:
            if "InvalidRange" in str(e):  # the range starts past the end: the object is shorter
                return past_end
            raise

    def get_into(self, name: str, offset: int, buf: memoryview) -> int:
        """A ranged GET read into ``buf``; the number of bytes the object had there.

        The body goes from the socket into ``buf`` without an intermediate copy (:func:`_body_into`)
        when it is not content-encoded. A connection that ends before the promised
        ``Content-Length`` is the link's fault (:class:`Unavailable`), not a truncated object.
        """
        if len(buf) == 0:
            return 0

        def read() -> int:
            with self._response(name, offset, len(buf)) as r:
                promised = int(r.headers.get("Content-Length", -1))
                n = _body_into(r, buf) if not r.headers.get("Content-Encoding") else fill(r.readinto, buf)
                if 0 <= promised != n and n < len(buf):
                    raise urllib3.exceptions.ProtocolError(f"connection closed after {n} of {promised} bytes")
                if n == len(buf) and promised > n:
                    raise urllib3.exceptions.ProtocolError(f"{promised} bytes sent for a range of {n}")
                return n

        return self._ranged(read, name, 0)

    def list(self, prefix: str) -> dict[str, int]:
        return {name: st.size for name, st in self.scan(prefix).items()}

    def scan(self, prefix: str) -> dict[str, Stat]:
        return self._call(lambda: {o.object_name: Stat(o.size, o.last_modified.timestamp() if o.last_modified else 0.0)
                                   for o in self.client.list_objects(self.bucket, prefix=prefix, recursive=True)})

    def exists(self, name: str) -> bool:
        try:
            self._call(lambda: self.client.stat_object(self.bucket, name), name)
            return True
        except NotFound:
            return False

    def delete(self, name: str) -> None:
        self._call(lambda: self.client.remove_object(self.bucket, name), name)

    def ping(self) -> None:
        if not self._call(lambda: self.client.bucket_exists(self.bucket)):
            raise StoreError(f"bucket {self.bucket!r} does not exist")


def _body_into(r: urllib3.BaseHTTPResponse, buf: memoryview) -> int:
    """Read the body of ``r`` (not content-encoded) into ``buf``; the bytes read.

    What ``http.client`` has buffered is taken first; the rest comes with one blocking
    ``recv_into(MSG_WAITALL)`` where the socket is a plain TCP socket on Linux (the read timeout
    becomes ``SO_RCVTIMEO`` meanwhile), else by ``http.client``'s own ``readinto`` loop. The
    response's remaining length is kept right, so that a body read to its end lets the
    connection be reused.
    """
    fp = getattr(r, "_fp", None)  # the http.client response
    stream = getattr(fp, "fp", None)
    sock = getattr(getattr(stream, "raw", None), "_sock", None)
    if stream is None or type(sock) is not socket.socket or fp.length is None or sys.platform != "linux":
        return fill(fp.readinto if fp is not None and hasattr(fp, "readinto") else r.readinto, buf)
    want = min(len(buf), fp.length)
    n = stream.readinto(buf[: min(want, len(stream.peek(0)))]) if want else 0
    if n < want:
        n += _recv_all(sock, buf[n:want])
    fp.length -= n
    if fp.length == 0:
        fp.read()  # the body's end: lets http.client mark the response complete
    return n


def _recv_all(sock: socket.socket, buf: memoryview) -> int:
    """``recv_into(MSG_WAITALL)`` until ``buf`` is full or the peer closes; the socket's timeout
    applies to each wait for data (as ``SO_RCVTIMEO``), and is restored after."""
    timeout = sock.gettimeout()
    sock.settimeout(None)
    if timeout:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(timeout), int(timeout % 1 * 1e6)))
    n = 0
    try:
        while n < len(buf):
            k = sock.recv_into(buf[n:], len(buf) - n, socket.MSG_WAITALL)
            if not k:
                break
            n += k
    except BlockingIOError:  # SO_RCVTIMEO passed with no data
        raise TimeoutError(f"no data for {timeout} s") from None
    finally:
        if timeout:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
        sock.settimeout(timeout)
    return n
