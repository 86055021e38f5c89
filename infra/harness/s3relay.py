"""Where the app's S3 requests go: it talks to MinIO through a loopback TCP relay that reads each HTTP
request line on its way (bytes are forwarded untouched, so signatures hold) and counts requests by API and
by what they touch (which table and which of its folders, the uploads). ``python -m bench.e2e --trace-s3``
prints them per video; MinIO's own counters give the totals.
"""

from __future__ import annotations

import collections
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from urllib.parse import parse_qs, unquote, urlsplit

#: A request line as it starts an HTTP/1.1 message on a client connection.
REQUEST_LINE = re.compile(rb"(GET|PUT|HEAD|POST|DELETE) (/\S*) HTTP/1\.1\r\n")
#: Bytes kept from the end of one read so a request line cut in two is still seen.
CARRY_BYTES = 4096
#: Requests counted, by (api, where).
Counts = collections.Counter[tuple[str, str]]
#: Longest one relayed connection may sit idle before the relay closes it.
IDLE_TIMEOUT_S = 600.0


def classify(method: str, target: str) -> tuple[str, str]:
    """(api, where) of one request: the S3 API by method and query (``ListObjectsV2``, ``GetObject``, ...)
    and what it touches: ``<table>/<folder>`` in the index bucket (``videos.lance/_versions``), else the
    bucket's role (``uploads``, ``index``)."""
    parts = urlsplit(target)
    query = parse_qs(parts.query, keep_blank_values=True)
    path = unquote(parts.path).lstrip("/")
    bucket, _, key = path.partition("/")
    if method == "GET" and "list-type" in query:
        api, key = "ListObjectsV2", query.get("prefix", [""])[0]
    elif method == "GET" and "uploads" in query:
        api = "ListMultipartUploads"
    else:
        api = {"GET": "GetObject", "PUT": "PutObject", "HEAD": "HeadObject", "DELETE": "DeleteObject"}.get(
            method, method
        )
        if method == "PUT" and "partNumber" in query:
            api = "UploadPart"
        elif method == "POST" and "uploads" in query:
            api = "CreateMultipartUpload"
        elif method == "POST" and "uploadId" in query:
            api = "CompleteMultipartUpload"
    if bucket.endswith("-index"):
        segments = [s for s in key.split("/") if s]
        table = next((s for s in segments if s.endswith(".lance")), None)
        if table is None:
            return api, f"index/{segments[0] if segments else ''}"
        rest = segments[segments.index(table) + 1 :]
        return api, f"{table}/{rest[0] if rest else ''}"
    return api, "uploads" if bucket.endswith("-videos") else bucket


class S3Relay:
    """A TCP relay from a loopback port to ``upstream`` (host, port) counting the requests it carries."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._lock = threading.Lock()
        self.counts: Counts = collections.Counter()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def snapshot(self) -> Counts:
        with self._lock:
            return collections.Counter(self.counts)

    def close(self) -> None:
        self._closed.set()
        with suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
        self._server.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._upstream, timeout=10)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.settimeout(IDLE_TIMEOUT_S)
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, requests: bool) -> None:
        carry = b""
        try:
            while data := source.recv(65536):
                if requests:  # counted before it is forwarded: once answered, a request is in the counts
                    carry = self._count(carry + data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def _count(self, data: bytes) -> bytes:
        last = 0
        found = []
        for match in REQUEST_LINE.finditer(data):
            found.append(classify(match.group(1).decode(), match.group(2).decode(errors="replace")))
            last = match.end()
        if found:
            with self._lock:
                self.counts.update(found)
        return data[max(last, len(data) - CARRY_BYTES) :]


@contextmanager
def relay(endpoint: str) -> Iterator[S3Relay]:
    """An ``S3Relay`` in front of the S3 endpoint URL ``endpoint`` (http only)."""
    parts = urlsplit(endpoint)
    r = S3Relay((parts.hostname or "127.0.0.1", parts.port or 80))
    try:
        yield r
    finally:
        r.close()


def trace_lines(before: Counts, after: Counts, n: int) -> list[str]:
    """Readable lines: requests per video by (api, where), biggest first, and the total."""
    diff = after - before
    lines = [f"{'api':<26} {'where':<34} {'per video':>9}"]
    for (api, where), count in sorted(diff.items(), key=lambda kv: -kv[1]):
        lines.append(f"{api:<26} {where:<34} {count / n:>9.2f}")
    lines.append(f"{'total':<61} {sum(diff.values()) / n:>9.2f}")
    return lines
