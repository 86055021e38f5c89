"""The S3 relay of ``bench.e2e --trace-s3``: requests classed by API and table, counted on their way
through a real loopback connection, bytes untouched."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import httpx
import pytest

from infra.harness.s3relay import classify, relay, trace_lines


@pytest.mark.parametrize(
    ("method", "target", "expected"),
    [
        (
            "GET",
            "/p-index?list-type=2&prefix=index%2Fvideos.lance%2F_versions%2F",
            ("ListObjectsV2", "videos.lance/_versions"),
        ),
        ("GET", "/p-index/index/frames.lance/data/abc.lance", ("GetObject", "frames.lance/data")),
        ("PUT", "/p-index/index/videos.lance/_versions/5.manifest", ("PutObject", "videos.lance/_versions")),
        ("HEAD", "/p-videos/batch/v001.mp4", ("HeadObject", "uploads")),
        ("PUT", "/p-index/thumbs/x.jpg?partNumber=1&uploadId=u", ("UploadPart", "index/thumbs")),
    ],
)
def test_requests_are_classed_by_api_and_what_they_touch(method: str, target: str, expected: tuple[str, str]) -> None:
    assert classify(method, target) == expected


@pytest.fixture
def upstream() -> Iterator[str]:
    class Echo(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            body = self.rfile.read(length) if length else self.path.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = _answer

        def log_message(self, *args: object) -> None:
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_relay_counts_requests_on_a_kept_alive_connection_and_forwards_them_untouched(upstream: str) -> None:
    # The relay reads request lines, not messages: a body made of request lines is counted too.
    body = b"GET /p-index/fake HTTP/1.1\r\n" * 3
    with relay(upstream) as s3, httpx.Client(base_url=f"http://127.0.0.1:{s3.port}", timeout=10) as client:
        before = s3.snapshot()
        assert client.get("/p-index/index/videos.lance/_versions/1.manifest").content.endswith(b"1.manifest")
        assert client.put("/p-videos/a.mp4", content=body).content == body
        assert client.get("/p-index?list-type=2&prefix=index/frames.lance/_versions/").status_code == 200
        after = s3.snapshot()
    counts = after - before
    assert counts[("GetObject", "videos.lance/_versions")] == 1
    assert counts[("PutObject", "uploads")] == 1
    assert counts[("ListObjectsV2", "frames.lance/_versions")] == 1
    assert sum(counts.values()) == 3 + 3
    assert trace_lines(before, after, 3)[-1].split()[-1] == "2.00"
