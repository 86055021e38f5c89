"""pipeline/api/app.py: the v1 HTTP contract over stand-in services (no Ray, no storage)."""

from __future__ import annotations

import asyncio
import io
import statistics
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from pydantic import SecretStr

from events.jobs import IndexJob
from pipeline.api.app import create_app
from pipeline.api.guards import (
    IMAGE_SEARCH_PATH,
    MAX_BODY_BYTES,
    MULTIPART_OVERHEAD_BYTES,
    RETRY_AFTER_S,
    is_admin_path,
)
from pipeline.jobs.videostate import QueueingSink, VideoStates
from pipeline.query.search import MomentOut, SearchResponse, SearchService, decode_query_image
from pipeline.settings import LimitSettings, Settings
from storage.catalog import Catalog, VideoRecord, VideoStatus
from storage.db import FreshTable
from storage.errors import InvalidInput, LimitExceeded, TransientError
from storage.frames import FrameTable
from storage.ids import video_id

MOMENT = MomentOut(
    video_id="v1",
    uri="s3://videos/a.mp4",
    score=0.9,
    start_s=3.0,
    end_s=5.0,
    ts_s=4.0,
    thumbnail_url="http://t/v1/frames/f/thumbnail",
    video_url="http://m/videos/a.mp4?sig#t=4",
)


class FakeSearch:
    def __init__(self, limits: LimitSettings) -> None:
        self.fail: Exception | None = None
        self.limits = limits
        self.images: list[bytes] = []

    async def search_text(self, q: str, k: int, base_url: str, sources: str | None = None) -> SearchResponse:
        if self.fail:
            raise self.fail
        return SearchResponse(results=[MOMENT], took_ms=1.5, model="m")

    async def search_image(self, data: bytes, k: int, base_url: str) -> SearchResponse:
        self.images.append(data)
        if data != b"png":  # the real service's bounds, over the bytes the route handed on
            decode_query_image(data, self.limits.max_image_bytes, self.limits.max_image_pixels)
        return SearchResponse(results=[MOMENT], took_ms=2.5, model="m")


class FakeCatalog:
    """The catalog's reads and its one compare-and-set write, in memory; with ``fail`` set every
    call raises it (the store blipping)."""

    def __init__(self) -> None:
        self.rows: dict[str, VideoRecord] = {}
        self.fail: Exception | None = None

    def _answer(self) -> None:
        if self.fail is not None:
            raise self.fail

    def get(self, video_id: str) -> VideoRecord | None:
        self._answer()
        return self.rows.get(video_id)

    def find(self, *, uri: str | None = None, status: VideoStatus | None = None, limit: int = 100) -> list[VideoRecord]:
        self._answer()
        found = [
            r for r in self.rows.values() if (uri is None or r.uri == uri) and (status is None or r.status is status)
        ]
        return sorted(found, key=lambda r: r.updated_at, reverse=True)[:limit]

    def page(
        self, *, status: VideoStatus | None = None, limit: int = 100, after: tuple[datetime, str] | None = None
    ) -> tuple[list[VideoRecord], tuple[datetime, str] | None]:
        self._answer()
        found = sorted(
            (r for r in self.rows.values() if status is None or r.status is status),
            key=lambda r: (r.updated_at, r.video_id),
            reverse=True,
        )
        found = [r for r in found if after is None or (r.updated_at, r.video_id) < after]
        more = len(found) > limit
        return found[:limit], (found[limit - 1].updated_at, found[limit - 1].video_id) if more else None

    def counts(self) -> dict[str, int]:
        self._answer()
        return {s.value: sum(r.status is s for r in self.rows.values()) for s in VideoStatus}

    def write(self, record: VideoRecord, expected_rev: int) -> VideoRecord | None:
        self._answer()
        current = self.rows.get(record.video_id)
        if (current.rev if current else 0) != expected_rev:
            return None
        self.rows[record.video_id] = written = record.evolve(rev=expected_rev + 1)
        return written


class FakeFrames:
    def __init__(self) -> None:
        self.fail: Exception | None = None

    def thumbnail(self, frame_id: str, version: str | None = None) -> bytes | None:
        if self.fail is not None:
            raise self.fail
        return b"\xff\xd8jpeg" if frame_id == "f1" and version in (None, "v1") else None

    def search(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        if self.fail is not None:
            raise self.fail
        return []


class FakeStore:
    """``IndexStore``'s shape: ``.catalog`` and ``.frames``."""

    def __init__(self) -> None:
        self.catalog = FakeCatalog()
        self.frames = FakeFrames()

    def frames_table(self, name: str) -> FakeFrames:
        return self.frames

    def blip(self, error: Exception) -> None:
        """Every read (and write) fails with ``error`` from now on."""
        self.catalog.fail = self.frames.fail = error


class FakeJobs:
    def __init__(self) -> None:
        self.jobs: list[IndexJob] = []
        self.fail: Exception | None = None

    def submit(self, job: IndexJob) -> str:
        if self.fail is not None:
            raise self.fail
        self.jobs.append(job)
        return "task-1"


async def router_stats() -> dict[str, Any]:
    return {"ignored_not_video": 2, "connected": 1}


def client(
    api_keys: list[str] | None = None,
    admin_key: str | None = None,
    limits: LimitSettings | None = None,
    *,
    queueing: bool = False,
) -> tuple[TestClient, FakeStore, FakeJobs, FakeSearch]:
    """The app over stand-ins. ``queueing``: submits go through ``QueueingSink``, as the Api
    deployment wires it (``pipeline.jobs.taskqueue.queueing_sink``); else straight to the task queue."""
    settings = Settings(
        api_keys=[SecretStr(k) for k in api_keys or []],
        admin_key=SecretStr(admin_key) if admin_key else None,
        limits=limits or LimitSettings(),
    )
    store, jobs, search = FakeStore(), FakeJobs(), FakeSearch(settings.limits)
    sink = QueueingSink(jobs, VideoStates(store.catalog)) if queueing else jobs  # type: ignore[arg-type]
    app = create_app(settings, search, store, sink, router_stats)  # type: ignore[arg-type]
    return TestClient(app, raise_server_exceptions=False), store, jobs, search


def test_index_accepts_s3_uris_in_configured_buckets() -> None:
    http, store, jobs, _ = client()
    resp = http.post("/v1/index", json={"uri": "s3://videos/clips/a b.mp4"})
    assert resp.status_code == 202
    assert resp.json() == {"video_id": video_id("videos", "clips/a b.mp4"), "task_id": "task-1", "status": "queued"}
    assert jobs.jobs[0].key == "clips/a b.mp4"
    # The route writes no catalog row of its own: marking queued is the sink's (next test).
    assert store.catalog.rows == {}


def test_index_through_the_queueing_sink_marks_the_video_queued() -> None:
    http, store, jobs, _ = client(queueing=True)
    resp = http.post("/v1/index", json={"uri": "s3://videos/clips/a b.mp4"})
    assert resp.status_code == 202 and [j.key for j in jobs.jobs] == ["clips/a b.mp4"]
    assert store.catalog.rows[jobs.jobs[0].video_id].status is VideoStatus.QUEUED


def test_index_is_accepted_while_the_catalog_blips() -> None:
    http, store, jobs, _ = client(queueing=True)
    store.blip(TransientError("index table write failed: connection reset"))
    resp = http.post("/v1/index", json={"uri": "s3://videos/a.mp4"})
    assert resp.status_code == 202 and len(jobs.jobs) == 1


@pytest.mark.parametrize("queueing", [False, True])
def test_index_is_503_with_retry_after_when_the_task_queue_refuses(queueing: bool) -> None:
    http, _, jobs, _ = client(queueing=queueing)
    jobs.fail = TransientError("task queue did not confirm the job")
    resp = http.post("/v1/index", json={"uri": "s3://videos/a.mp4"})
    assert resp.status_code == 503 and resp.headers["Retry-After"] == str(RETRY_AFTER_S)
    assert resp.json() == {"error": {"code": "unavailable", "message": "task queue did not confirm the job"}}


@pytest.mark.parametrize(
    "uri", ["file:///etc/passwd", "http://x/a.mp4", "s3://other/a.mp4", "s3://videos/../x.mp4", "s3://videos/"]
)
def test_index_rejects_other_uris_with_a_json_error(uri: str) -> None:
    http, _, jobs, _ = client()
    resp = http.post("/v1/index", json={"uri": uri})
    assert resp.status_code == 400
    assert set(resp.json()["error"]) == {"code", "message"} and jobs.jobs == []


def test_video_lookup_shape_and_404() -> None:
    http, store, _, _ = client()
    vid = video_id("videos", "a.mp4")
    store.catalog.write(
        VideoRecord(
            video_id=vid,
            uri="s3://videos/a.mp4",
            status=VideoStatus.FAILED,
            error="not a video: no video stream",
            updated_at=datetime(2026, 1, 1, tzinfo=UTC),
        ),
        0,
    )
    body = http.get(f"/v1/videos/{vid}").json()
    assert set(body) == {"video_id", "uri", "status", "error", "frames", "duration_s", "model", "models", "updated_at"}
    assert body["status"] == "failed" and body["error"] == "not a video: no video stream"
    assert http.get("/v1/videos", params={"uri": "s3://videos/a.mp4"}).json()["videos"][0]["video_id"] == vid
    assert [v["video_id"] for v in http.get("/v1/videos", params={"status": "failed"}).json()["videos"]] == [vid]
    missing = http.get("/v1/videos/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_search_shapes() -> None:
    http, _, _, _ = client()
    text = http.get("/v1/search", params={"q": "a dog"}).json()
    assert set(text) == {"results", "took_ms", "model"}
    assert set(text["results"][0]) == {
        "video_id",
        "uri",
        "score",
        "start_s",
        "end_s",
        "ts_s",
        "thumbnail_url",
        "video_url",
        "duration_s",
        "hits_s",
        "sources",
        "text",
        "text_source",
        "text_marks",
    }
    image = http.post("/v1/search/image", files={"image": ("q.png", b"png", "image/png")})
    assert image.status_code == 200 and image.json()["took_ms"] == 2.5


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (InvalidInput("k must be between 1 and 100"), 400),
        (LimitExceeded("q exceeds max length"), 413),
        (TransientError("encoder restarting"), 503),
        (RuntimeError("boom /secret/path"), 500),
    ],
)
def test_errors_are_json_never_tracebacks(error: Exception, status: int) -> None:
    http, _, _, search = client()
    search.fail = error
    resp = http.get("/v1/search", params={"q": "x"})
    assert resp.status_code == status
    assert set(resp.json()) == {"error"} and set(resp.json()["error"]) == {"code", "message"}
    assert "Traceback" not in resp.text and "/secret/path" not in resp.text
    assert ("Retry-After" in resp.headers) is (status == 503)


def test_missing_query_is_a_json_422() -> None:
    http, _, _, _ = client()
    resp = http.get("/v1/search")
    assert resp.status_code == 422 and resp.json()["error"]["code"] == "invalid_request"


KEY = "user-key-0123456789abcdef"
OTHER_KEY = "user-key-rotated-0123456789"
ADMIN_KEY = "admin-key-0123456789abcdef"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def guarded() -> TestClient:
    http, _, _, _ = client(api_keys=[KEY, OTHER_KEY], admin_key=ADMIN_KEY)
    # Stand-ins for the admin routes another module adds: the rule is by path, not by route.
    app = http.app
    app.add_api_route("/v1/admin/dlq", lambda: {"messages": []}, methods=["GET"])  # type: ignore[attr-defined]
    return http


GUARDED = [
    ("GET", "/v1/search?q=x"),
    ("POST", "/v1/search/image"),
    ("POST", "/v1/index"),
    ("GET", "/v1/videos"),
    ("GET", "/v1/videos/v1"),
    ("GET", "/v1/frames/f1/thumbnail"),
    ("POST", "/v1/uploads"),
    ("GET", "/metrics"),
    ("GET", "/docs"),
    ("GET", "/openapi.json"),
    ("GET", "/no/such/path"),
]


@pytest.mark.parametrize(("method", "path"), GUARDED)
@pytest.mark.parametrize(
    "headers",
    [
        {},
        bearer("wrong-key-0123456789abcdef"),
        bearer(""),
        {"Authorization": KEY},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": f"Bearer {KEY[:-1]}"},
        {"X-Api-Key": KEY},
    ],
)
def test_every_endpoint_but_healthz_and_the_page_needs_a_valid_key(
    guarded: TestClient, method: str, path: str, headers: dict[str, str]
) -> None:
    resp = guarded.request(method, path, headers=headers)
    assert resp.status_code == 401
    assert resp.json() == {
        "error": {"code": "unauthorized", "message": "a valid API key is required: Authorization: Bearer KEY"}
    }
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert KEY not in resp.text and ADMIN_KEY not in resp.text


@pytest.mark.parametrize("key", [KEY, OTHER_KEY, ADMIN_KEY])
def test_each_configured_key_opens_the_api(guarded: TestClient, key: str) -> None:
    assert guarded.get("/v1/search", params={"q": "x"}, headers=bearer(key)).status_code == 200
    assert guarded.get("/metrics", headers={"Authorization": f"bearer  {key} "}).status_code == 200
    assert guarded.post("/v1/index", json={"uri": "s3://videos/a.mp4"}, headers=bearer(key)).status_code == 202


def test_healthz_needs_no_key(guarded: TestClient) -> None:
    assert guarded.get("/healthz").json() == {"status": "ok"}
    assert guarded.get("/healthz", headers=bearer("wrong-key-0123456789abcdef")).status_code == 200


@pytest.mark.parametrize("path", ["/v1/admin/dlq", "/v1/admin/reindex", "/V1/Admin/dlq", "/v1//admin/dlq", "/v1/admin"])
def test_admin_paths_need_the_admin_key(guarded: TestClient, path: str) -> None:
    assert guarded.get(path).status_code == 401
    assert guarded.get(path, headers=bearer("wrong-key-0123456789abcdef")).status_code == 401
    regular = guarded.get(path, headers=bearer(KEY))
    assert regular.status_code == 403
    assert regular.json()["error"] == {"code": "forbidden", "message": "this endpoint needs the admin key"}
    assert guarded.get(path, headers=bearer(ADMIN_KEY)).status_code != 403


def test_admin_route_answers_the_admin_key(guarded: TestClient) -> None:
    resp = guarded.get("/v1/admin/dlq", headers=bearer(ADMIN_KEY))
    assert resp.status_code == 200 and resp.json() == {"messages": []}


@pytest.mark.parametrize(
    ("path", "admin"),
    [
        ("/v1/admin/dlq", True),
        ("/v1/admin", True),
        ("/v1/x/../admin/dlq", True),
        ("/v1/./admin/", True),
        ("/V1/ADMIN/dlq", True),
        ("/v1/administrator", False),
        ("/v1/videos", False),
        ("/admin/v1", False),
    ],
)
def test_admin_path_rule(path: str, admin: bool) -> None:
    assert is_admin_path(path) is admin


def test_without_an_admin_key_admin_paths_are_closed() -> None:
    http, _, _, _ = client(api_keys=[KEY])
    assert http.get("/v1/admin/dlq", headers=bearer(KEY)).status_code == 403
    assert http.get("/v1/videos", headers=bearer(KEY)).status_code == 200


def test_without_keys_the_api_is_open() -> None:
    http, _, _, _ = client()
    assert http.get("/v1/videos").status_code == 200


# -- bounds ---------------------------------------------------------------------------------------------


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 30)).save(out, format="PNG")
    return out.getvalue()


SMALL_LIMITS = LimitSettings(max_image_bytes=100_000, max_image_pixels=1_000_000)


def test_an_image_within_bounds_is_searched() -> None:
    http, _, _, search = client(limits=SMALL_LIMITS)
    resp = http.post("/v1/search/image", files={"image": ("q.png", png(64, 48), "image/png")})
    assert resp.status_code == 200, resp.text
    assert len(search.images) == 1


def test_an_image_over_the_byte_limit_is_413() -> None:
    http, _, _, search = client(limits=SMALL_LIMITS)
    resp = http.post("/v1/search/image", files={"image": ("q.bin", b"\0" * 150_000, "image/png")})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "too_large"
    # Within the multipart slack the body is read, but only one byte past the bound is handed on.
    assert [len(d) for d in search.images] == [SMALL_LIMITS.max_image_bytes + 1]


def test_an_image_just_over_the_limit_inside_the_multipart_slack_is_413() -> None:
    http, _, _, _ = client(limits=SMALL_LIMITS)
    resp = http.post("/v1/search/image", files={"image": ("q.bin", b"\0" * 100_001, "image/png")})
    assert resp.status_code == 413
    assert "max bytes 100000" in resp.json()["error"]["message"]


def test_a_40_mb_image_is_413_with_default_limits() -> None:
    http, _, _, search = client()
    resp = http.post("/v1/search/image", files={"image": ("big.png", b"\0" * (40 * 1024**2), "image/png")})
    assert resp.status_code == 413 and search.images == []


def _multipart(part: bytes) -> tuple[bytes, str]:
    boundary = "vidxboundary"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="q.png"\r\n'
        f"Content-Type: image/png\r\n\r\n"
    ).encode()
    return body + part + f"\r\n--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def test_a_chunked_image_body_is_bounded_while_read() -> None:
    http, _, _, search = client(limits=SMALL_LIMITS)
    body, content_type = _multipart(b"\0" * 300_000)

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(body), 8192):
            yield body[i : i + 8192]

    resp = http.post("/v1/search/image", content=chunks(), headers={"Content-Type": content_type})
    assert resp.status_code == 413 and search.images == []


def test_a_body_longer_than_its_declared_length_is_bounded() -> None:
    http, _, _, search = client(limits=SMALL_LIMITS)
    body, content_type = _multipart(b"\0" * 300_000)
    resp = http.post("/v1/search/image", content=body, headers={"Content-Type": content_type, "Content-Length": "1000"})
    assert resp.status_code == 413 and search.images == []


def test_a_declared_length_over_the_bound_is_refused_before_reading() -> None:
    http, _, _, _ = client(limits=SMALL_LIMITS)
    body, content_type = _multipart(b"\0" * 10)
    limit = SMALL_LIMITS.max_image_bytes + MULTIPART_OVERHEAD_BYTES
    resp = http.post(
        "/v1/search/image", content=body, headers={"Content-Type": content_type, "Content-Length": str(limit + 1)}
    )
    assert resp.status_code == 413


def test_other_bodies_are_bounded_too() -> None:
    http, _, jobs, _ = client()
    resp = http.post("/v1/index", json={"uri": "s3://videos/" + "a" * MAX_BODY_BYTES})
    assert resp.status_code == 413 and jobs.jobs == []


def test_too_many_pixels_is_413_before_decoding() -> None:
    http, _, _, _ = client(limits=SMALL_LIMITS)
    data = png(4000, 3000)
    assert len(data) < SMALL_LIMITS.max_image_bytes
    resp = http.post("/v1/search/image", files={"image": ("q.png", data, "image/png")})
    assert resp.status_code == 413 and "max pixels" in resp.json()["error"]["message"]


def test_formats_outside_the_allowed_few_are_refused() -> None:
    http, _, _, _ = client(limits=SMALL_LIMITS)
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n%%EndComments\nshowpage\n"
    resp = http.post("/v1/search/image", files={"image": ("q.eps", eps, "application/postscript")})
    assert resp.status_code == 400 and "not a readable image" in resp.json()["error"]["message"]


@pytest.mark.parametrize(
    "uri",
    [
        "s3://videos/a/%2e%2e/b.mp4",
        "s3://videos/a%2Fb.mp4",
        "s3://videos/a\\b.mp4",
        "s3://videos/a\u0000b.mp4",
        "s3://videos/" + "k" * 1025,
        "S3://videos/a.mp4",
        "s3://videos.evil/a.mp4",
        "s3://videos@evil/a.mp4",
    ],
)
def test_index_rejects_tricky_uris(uri: str) -> None:
    http, _, jobs, _ = client()
    resp = http.post("/v1/index", json={"uri": uri})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "bad_request" and jobs.jobs == []


def test_thumbnail_and_metrics() -> None:
    http, _, _, _ = client()
    assert http.get("/v1/frames/f1/thumbnail").headers["content-type"] == "image/jpeg"
    assert http.get("/v1/frames/f2/thumbnail").status_code == 404
    metrics = http.get("/metrics").text
    assert "vidx_router_connected 1.0" in metrics


def test_the_rules_hold_under_a_route_prefix(guarded: TestClient) -> None:
    # Serve mounts the app under its route prefix, handed over as the ASGI root_path.
    http = TestClient(guarded.app, root_path="/vidx", raise_server_exceptions=False)
    assert http.get("/vidx/healthz").status_code == 200
    assert http.get("/vidx/v1/videos").status_code == 401
    assert http.get("/vidx/v1/videos", headers=bearer(KEY)).status_code == 200
    assert http.get("/vidx/v1/admin/dlq", headers=bearer(KEY)).status_code == 403
    assert http.get("/vidx/v1/admin/dlq", headers=bearer(ADMIN_KEY)).status_code == 200


# -- a store that blips -----------------------------------------------------------------------------


class BrokenLanceTable:
    """A Lance table (or connection) whose every call fails as Lance does when its object store drops."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("lance error: IO: Generic S3 error: connection reset by peer\n  at lance/src/io.rs:1")

        if name == "schema":  # a property on a real table: it reads the manifest
            fail()
        return fail


class BrokenLanceDatabase:
    """``IndexDatabase``'s shape over broken tables: handles open, every read fails."""

    def create(self, name: str, schema: Any) -> BrokenLanceTable:
        return BrokenLanceTable()

    def open(self, name: str) -> BrokenLanceTable:
        return BrokenLanceTable()

    def connect(self, consistency: Any) -> BrokenLanceTable:
        return BrokenLanceTable()

    def fresh(self, name: str) -> FreshTable:
        return FreshTable(BrokenLanceTable)


class LanceStore:
    """The real table modules (``read_errors_are_transient`` included) over a broken database."""

    def __init__(self) -> None:
        db = BrokenLanceDatabase()
        self.catalog = Catalog(db)  # type: ignore[arg-type]
        self.frames = FrameTable(db)  # type: ignore[arg-type]

    def frames_table(self, name: str) -> FrameTable:
        return self.frames


class StubEncoder:
    async def embed_text(self, text: str, model_id: str | None = None) -> np.ndarray[Any, np.dtype[np.float32]]:
        return np.full(4, 0.5, dtype=np.float32)

    async def embed_image(
        self, rgb: np.ndarray[Any, np.dtype[np.uint8]], model_id: str | None = None
    ) -> np.ndarray[Any, np.dtype[np.float32]]:
        return np.full(4, 0.5, dtype=np.float32)


def blipping_store(kind: str) -> FakeStore | LanceStore:
    if kind == "lance":
        return LanceStore()
    store = FakeStore()
    store.blip(TransientError("index table read failed: connection reset by peer"))
    return store


READS = [
    ("GET", f"/v1/videos/{video_id('videos', 'a.mp4')}"),
    ("GET", "/v1/videos?uri=s3://videos/a.mp4"),
    ("GET", "/v1/videos"),
    ("GET", "/v1/videos?status=failed"),
    ("GET", "/v1/frames/f1/thumbnail"),
    ("GET", "/v1/search?q=a%20dog"),
    ("POST", "/v1/search/image"),
]


@pytest.mark.parametrize("kind", ["transient", "lance"])
@pytest.mark.parametrize(("method", "path"), READS)
def test_reads_answer_503_with_retry_after_when_the_store_blips(kind: str, method: str, path: str) -> None:
    settings = Settings()
    store = blipping_store(kind)
    # The real search service: its reads of ``frames`` must surface the store's TransientError too.
    search = SearchService(settings, store, StubEncoder())  # type: ignore[arg-type]
    app = create_app(settings, search, store, FakeJobs(), router_stats)  # type: ignore[arg-type]
    http = TestClient(app, raise_server_exceptions=False)
    files = {"image": ("q.png", png(8, 8), "image/png")} if path == IMAGE_SEARCH_PATH else None
    resp = http.request(method, path, files=files)
    assert resp.status_code == 503, resp.text
    assert resp.headers["Retry-After"] == str(RETRY_AFTER_S)
    body = resp.json()
    assert set(body) == {"error"} and body["error"]["code"] == "unavailable"
    assert body["error"]["message"].startswith("index table read failed: ")
    assert "Traceback" not in resp.text and "io.rs" not in resp.text  # first line of Lance's message only


def test_status_and_metrics_show_the_scheduled_checks_last_round() -> None:
    settings = Settings()
    store, jobs, search = FakeStore(), FakeJobs(), FakeSearch(settings.limits)
    state = {
        "rounds": 4,
        "leader": True,
        "last_error": None,
        "last": {
            "started_at": "2026-12-01T09:00:00+00:00",
            "took_s": 0.4,
            "inconsistencies": 2,
            "counts": {"missing": 1, "stuck": 1, "stale": 0},
            "in_flight": 3,
            "submitted": 2,
            "listed": 40,
            "summary": "…",
        },
    }

    services = {"maintenance": {"alive": True, "last_ok": 1_700_000_000.0}}

    async def check_state() -> dict[str, Any]:
        return {**state, "services": services}

    app = create_app(settings, search, store, jobs, router_stats, None, check_state)  # type: ignore[arg-type]
    http = TestClient(app, raise_server_exceptions=False)
    answer = http.get("/v1/status").json()
    router = answer["services"].pop("router")
    assert router["alive"] is True and router["last_ok"] > 1_700_000_000  # connected, as of the answer
    assert answer == {"check": state, "services": services, "videos": store.catalog.counts()}
    metrics = http.get("/metrics").text
    assert 'vidx_check_last_inconsistencies{finding="missing"} 1.0' in metrics
    assert 'vidx_check_last_inconsistencies{finding="stuck"} 1.0' in metrics
    assert "vidx_check_rounds 4.0" in metrics and "vidx_check_last_in_flight 3.0" in metrics
    assert "vidx_check_last_run_timestamp_seconds 1.7961156e+09" in metrics


def test_metrics_show_replicas_per_deployment_and_the_queue_depths() -> None:
    settings = Settings()
    store, jobs, search = FakeStore(), FakeJobs(), FakeSearch(settings.limits)

    async def replicas() -> dict[str, dict[str, int]]:
        return {"IndexConsumer": {"RUNNING": 3, "STARTING": 1}, "Encoder": {"RUNNING": 1}}

    async def queues() -> dict[str, int]:
        return {"index": 42, "failed": 2, "parked": 0}

    app = create_app(settings, search, store, jobs, router_stats, replicas=replicas, queues=queues)  # type: ignore[arg-type]
    metrics = TestClient(app, raise_server_exceptions=False).get("/metrics").text
    assert 'vidx_serve_replicas{deployment="IndexConsumer",state="RUNNING"} 3.0' in metrics
    assert 'vidx_serve_replicas{deployment="IndexConsumer",state="STARTING"} 1.0' in metrics
    assert 'vidx_serve_replicas{deployment="Encoder",state="RUNNING"} 1.0' in metrics
    assert 'vidx_queue_messages{queue="index"} 42.0' in metrics
    assert 'vidx_queue_messages{queue="failed"} 2.0' in metrics and 'vidx_queue_messages{queue="parked"} 0.0' in metrics


def test_metrics_answer_when_replica_counts_queues_and_nodes_are_unavailable() -> None:
    settings = Settings()
    store, jobs, search = FakeStore(), FakeJobs(), FakeSearch(settings.limits)

    async def replicas() -> dict[str, dict[str, int]]:
        raise RuntimeError("controller restarting")

    async def queues() -> dict[str, int]:
        return {}

    async def recorded() -> list[Any]:
        raise RuntimeError("GCS unreachable")

    app = create_app(
        settings,
        search,  # type: ignore[arg-type]
        store,  # type: ignore[arg-type]
        jobs,
        router_stats,
        replicas=replicas,
        queues=queues,
        recorded=recorded,
    )
    resp = TestClient(app, raise_server_exceptions=False).get("/metrics")
    assert resp.status_code == 200 and "vidx_router_connected 1.0" in resp.text
    assert "vidx_serve_replicas{" not in resp.text and "vidx_queue_messages{" not in resp.text


class GatedSearch(FakeSearch):
    """Text searches wait on ``gate``: they stay in flight until the test opens it."""

    def __init__(self, limits: LimitSettings) -> None:
        super().__init__(limits)
        self.gate = asyncio.Event()
        self.waiting = 0

    async def search_text(self, q: str, k: int, base_url: str, sources: str | None = None) -> SearchResponse:
        self.waiting += 1
        await self.gate.wait()
        return await super().search_text(q, k, base_url)


def test_a_full_app_sheds_load_with_503_and_retry_after_but_probes_answer() -> None:
    settings = Settings.model_validate(
        {
            "serve": {
                "api_max_in_flight": 2,
                "metrics_max_in_flight": 1,
                "api_max_ongoing_requests": 4,
                "retry_after_s": 7,
            }
        }
    )
    store, jobs, search = FakeStore(), FakeJobs(), GatedSearch(settings.limits)
    app = create_app(settings, search, store, jobs, router_stats)  # type: ignore[arg-type]

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            held = [asyncio.create_task(http.get("/v1/search", params={"q": "cat"})) for _ in range(2)]
            while search.waiting < 2:
                await asyncio.sleep(0.01)
            shed = await http.get("/v1/search", params={"q": "dog"})
            assert shed.status_code == 503 and shed.headers["Retry-After"] == "7"
            assert shed.json()["error"]["code"] == "overloaded"
            assert search.waiting == 2  # the shed request never reached the route
            # The probe is neither counted nor shed: "busy" is not "down"; scrapes have their own bound.
            assert (await http.get("/healthz")).status_code == 200
            assert (await http.get("/metrics")).status_code == 200
            search.gate.set()
            assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
            assert (await http.get("/v1/search", params={"q": "dog"})).status_code == 200

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_admission_must_leave_room_for_the_probes() -> None:
    with pytest.raises(ValueError, match="api_max_in_flight"):
        Settings.model_validate({"serve": {"api_max_in_flight": 8, "api_max_ongoing_requests": 8}})
    with pytest.raises(ValueError, match="metrics_max_in_flight"):
        Settings.model_validate(
            {"serve": {"api_max_in_flight": 6, "metrics_max_in_flight": 2, "api_max_ongoing_requests": 8}}
        )


#: Scrapes fired at once at a /metrics whose node fan-out hangs.
SCRAPES = 200


def test_two_hundred_concurrent_scrapes_take_their_own_few_slots_and_healthz_answers() -> None:
    """Each scrape fans out to every node; 200 at once used to take every one of the replica's slots
    (``/metrics`` was unbounded) so ``/healthz`` queued behind them. Now at most
    ``metrics_max_in_flight`` run, the rest are answered 503 at once, and probes and searches go on."""
    settings = Settings()
    release = asyncio.Event()
    running = {"now": 0, "most": 0}

    async def slow_stats() -> dict[str, Any]:
        running["now"] += 1
        running["most"] = max(running["most"], running["now"])
        try:
            await release.wait()  # the nodes don't answer
            return await router_stats()
        finally:
            running["now"] -= 1

    store, jobs, search = FakeStore(), FakeJobs(), FakeSearch(settings.limits)
    app = create_app(settings, search, store, jobs, slow_stats)  # type: ignore[arg-type]

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as http:
            scrapes = [asyncio.create_task(http.get("/metrics")) for _ in range(SCRAPES)]
            admitted = settings.serve.metrics_max_in_flight
            while sum(t.done() for t in scrapes) < SCRAPES - admitted or running["now"] < admitted:
                await asyncio.sleep(0.01)
            assert (await http.get("/healthz")).status_code == 200
            assert (await http.get("/v1/search", params={"q": "cat"})).status_code == 200
            release.set()
            codes = [r.status_code for r in await asyncio.gather(*scrapes)]
            assert codes.count(200) == settings.serve.metrics_max_in_flight
            assert codes.count(503) == SCRAPES - settings.serve.metrics_max_in_flight
            assert running["most"] == settings.serve.metrics_max_in_flight

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_7000_by_7000_image_query_is_decoded_off_the_loop_and_scaled_down_while_healthz_answers(
    tmp_path: Path,
) -> None:
    """The real ``SearchService`` decodes a 7000x7000 PNG (~1 s of CPU, ~147 MB) on a thread and hands
    the Encoder at most ``query_image_max_side`` pixels a side; /healthz, probed every 10 ms on the same
    event loop meanwhile, keeps answering (its p50 stays under 50 ms; before, the loop was blocked)."""
    from storage.tables import IndexStore
    from tests.unit.query.test_search import BlockEncoder, add_video

    settings = Settings()
    index = IndexStore(settings.s3, uri=str(tmp_path / "lance"))
    add_video(index, "v", [(1.0, BlockEncoder.vector(np.zeros((8, 8, 3), np.uint8)))], duration_s=4.0)
    encoder = BlockEncoder()
    buffer = io.BytesIO()
    Image.new("RGB", (7000, 7000), (40, 90, 160)).save(buffer, format="PNG")
    big = buffer.getvalue()

    async def scenario() -> tuple[int, list[float], int]:
        service = SearchService(settings, index, encoder)
        app = create_app(settings, service, FakeStore(), FakeJobs(), router_stats)  # type: ignore[arg-type]
        transport = httpx.ASGITransport(app=app)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as http:
                query = asyncio.create_task(http.post("/v1/search/image", files={"image": ("big.png", big)}))
                probes: list[float] = []
                while not query.done():
                    started = time.perf_counter()
                    assert (await http.get("/healthz")).status_code == 200
                    probes.append(time.perf_counter() - started)
                    await asyncio.sleep(0.01)
                return (await query).status_code, probes, len(probes)
        finally:
            await service.aclose()

    status, probes, answered = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert status == 200
    (sent,) = encoder.images
    assert max(sent.shape[:2]) <= settings.limits.query_image_max_side
    assert answered >= 5, f"only {answered} probes answered while the image was decoded"
    p50_ms = 1000 * statistics.median(probes)
    print(f"image 7000x7000 ({len(big)} bytes): {answered} /healthz probes during it, p50 {p50_ms:.1f} ms")
    assert p50_ms < 50


def test_each_key_is_rate_limited_on_index_and_search_with_429_and_retry_after() -> None:
    """A key past its burst gets 429 with ``Retry-After``; another key, and the other endpoint class,
    are not affected; a bad key is refused (401) before it is counted."""
    limits = LimitSettings(index_rate_per_s=0.5, index_burst=3, search_rate_per_s=0.25, search_burst=2)
    http, _, jobs, _ = client(api_keys=[KEY, OTHER_KEY], limits=limits)
    body = {"uri": "s3://videos/a.mp4"}
    codes = [http.post("/v1/index", json=body, headers=bearer(KEY)).status_code for _ in range(4)]
    assert codes == [202, 202, 202, 429]
    refused = http.post("/v1/index", json=body, headers=bearer(KEY))
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "2"
    assert refused.json()["error"]["code"] == "rate_limited" and len(jobs.jobs) == 3
    assert http.post("/v1/index", json=body, headers=bearer(OTHER_KEY)).status_code == 202  # its own bucket
    searches = [http.get("/v1/search", params={"q": "cat"}, headers=bearer(KEY)).status_code for _ in range(3)]
    assert searches == [200, 200, 429]
    image = http.post("/v1/search/image", files={"image": ("q.png", b"png")}, headers=bearer(KEY))
    assert image.status_code == 429 and image.headers["Retry-After"] == "4"  # one class for both searches
    assert http.get("/v1/search", params={"q": "x"}, headers=bearer("wrong-key-0123456789abcdef")).status_code == 401
    assert http.get("/healthz").status_code == 200  # never limited
    # Another spelling of the same key is the same caller.
    assert http.post("/v1/index", json=body, headers={"Authorization": f"bearer   {KEY}"}).status_code == 429


def test_without_keys_callers_are_told_apart_by_address_not_by_a_made_up_header() -> None:
    limits = LimitSettings(index_rate_per_s=0.5, index_burst=2)
    http, _, _, _ = client(limits=limits)
    body = {"uri": "s3://videos/a.mp4"}
    codes = [
        http.post("/v1/index", json=body, headers={"Authorization": f"Bearer made-up-{i}"}).status_code
        for i in range(3)
    ]
    assert codes == [202, 202, 429]


def test_a_token_bucket_refills_at_its_rate() -> None:
    from pipeline.api.guards import RateLimit

    now = [0.0]
    limit = RateLimit(2.0, 2, clock=lambda: now[0], max_callers=2)
    assert [limit.take("a"), limit.take("a"), limit.take("a")] == [None, None, 1]
    now[0] += 0.5  # one token back
    assert limit.take("a") is None and limit.take("a") == 1
    limit.take("b")
    limit.take("c")  # "a" is forgotten: it starts again with a full bucket
    assert limit.take("a") is None


def test_videos_are_listed_newest_first_a_page_at_a_time_through_the_real_catalog(tmp_path: Path) -> None:
    """``GET /v1/videos`` pages with an opaque cursor over the real catalog: every video once, newest
    first, the status filter in the query; a cursor it never handed out is a 400."""
    from storage.tables import IndexStore

    settings = Settings()
    index = IndexStore(settings.s3, uri=str(tmp_path / "lance"))
    written = [
        index.catalog.write_many(
            [
                (
                    VideoRecord(
                        f"v{i:02d}{j}", f"s3://videos/{i:02d}{j}.mp4", VideoStatus.INDEXED if j else VideoStatus.FAILED
                    ),
                    0,
                )
                for j in range(2)
            ]
        )
        for i in range(12)
    ]  # 12 commits of 2: ties on updated_at within each, told apart by video_id
    assert all(w is not None for pair in written for w in pair)
    app = create_app(settings, FakeSearch(settings.limits), index, FakeJobs(), router_stats)  # type: ignore[arg-type]
    http = TestClient(app)
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 5, **({"cursor": cursor} if cursor else {})}
        body = http.get("/v1/videos", params=params).json()
        seen += [v["video_id"] for v in body["videos"]]
        pages += 1
        cursor = body["next_cursor"]
        if cursor is None:
            break
        assert pages < 10
    newest_first = [f"v{i:02d}{j}" for i in reversed(range(12)) for j in (1, 0)]
    assert seen == newest_first and pages == 5
    indexed = http.get("/v1/videos", params={"status": "indexed", "limit": 100}).json()
    assert [v["video_id"] for v in indexed["videos"]] == [f"v{i:02d}1" for i in reversed(range(12))]
    assert indexed["next_cursor"] is None
    bad = http.get("/v1/videos", params={"cursor": "not-a-cursor"})
    assert bad.status_code == 400 and "cursor" in bad.json()["error"]["message"]
