"""pipeline/api.py: the v1 HTTP contract over stand-in services (no Ray, no storage)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from pipeline.api import create_app
from pipeline.errors import InvalidInput, LimitExceeded, TransientError
from pipeline.ids import video_id
from pipeline.jobs import IndexJob
from pipeline.search import MomentOut, SearchResponse
from pipeline.settings import Settings
from storage.tables import VideoRecord, VideoStatus

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
    def __init__(self) -> None:
        self.fail: Exception | None = None

    async def search_text(self, q: str, k: int, base_url: str) -> SearchResponse:
        if self.fail:
            raise self.fail
        return SearchResponse(results=[MOMENT], took_ms=1.5)

    async def search_image(self, data: bytes, k: int, base_url: str) -> SearchResponse:
        return SearchResponse(results=[MOMENT], took_ms=2.5)


class FakeStore:
    def __init__(self) -> None:
        self.videos: dict[str, VideoRecord] = {}

    def get_video(self, vid: str) -> VideoRecord | None:
        return self.videos.get(vid)

    def put_video(self, record: VideoRecord) -> None:
        self.videos[record.video_id] = record

    def insert_video_if_absent(self, record: VideoRecord) -> None:
        self.videos.setdefault(record.video_id, record)

    def set_status(self, vid: str, status: VideoStatus, error: str | None = None) -> None:
        self.videos[vid].status, self.videos[vid].error = status, error

    def find_videos(self, *, status: VideoStatus | None = None, limit: int = 100) -> list[VideoRecord]:
        return [v for v in self.videos.values() if status is None or v.status is status][:limit]

    def thumbnail(self, frame_id: str) -> bytes | None:
        return b"\xff\xd8jpeg" if frame_id == "f1" else None

    def count_videos(self) -> dict[str, int]:
        return {"indexed": len(self.videos)}


class FakeJobs:
    def __init__(self) -> None:
        self.jobs: list[IndexJob] = []

    def submit(self, job: IndexJob) -> str:
        self.jobs.append(job)
        return "task-1"


def client(api_key: str | None = None) -> tuple[TestClient, FakeStore, FakeJobs, FakeSearch]:
    settings = Settings(api_key=SecretStr(api_key) if api_key else None)
    store, jobs, search = FakeStore(), FakeJobs(), FakeSearch()

    async def stats() -> dict[str, Any]:
        return {"ignored_not_video": 2, "connected": 1}

    app = create_app(settings, search, store, jobs, stats)  # type: ignore[arg-type]
    return TestClient(app, raise_server_exceptions=False), store, jobs, search


def test_index_accepts_s3_uris_in_configured_buckets() -> None:
    http, store, jobs, _ = client()
    resp = http.post("/v1/index", json={"uri": "s3://videos/clips/a b.mp4"})
    assert resp.status_code == 202
    assert resp.json() == {"video_id": video_id("videos", "clips/a b.mp4"), "task_id": "task-1", "status": "queued"}
    assert jobs.jobs[0].key == "clips/a b.mp4"
    assert store.videos[jobs.jobs[0].video_id].status is VideoStatus.QUEUED


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
    store.put_video(
        VideoRecord(
            video_id=vid,
            uri="s3://videos/a.mp4",
            status=VideoStatus.FAILED,
            error="not a video: no video stream",
            updated_at=datetime(2026, 1, 1, tzinfo=UTC),
        )
    )
    body = http.get(f"/v1/videos/{vid}").json()
    assert set(body) == {"video_id", "uri", "status", "error", "frames", "duration_s", "model", "updated_at"}
    assert body["status"] == "failed" and body["error"] == "not a video: no video stream"
    assert http.get("/v1/videos", params={"uri": "s3://videos/a.mp4"}).json()["videos"][0]["video_id"] == vid
    assert [v["video_id"] for v in http.get("/v1/videos", params={"status": "failed"}).json()["videos"]] == [vid]
    missing = http.get("/v1/videos/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_search_shapes() -> None:
    http, _, _, _ = client()
    text = http.get("/v1/search", params={"q": "a dog"}).json()
    assert set(text) == {"results", "took_ms"}
    assert set(text["results"][0]) == {
        "video_id",
        "uri",
        "score",
        "start_s",
        "end_s",
        "ts_s",
        "thumbnail_url",
        "video_url",
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
    assert set(resp.json()) == {"error"}
    assert "Traceback" not in resp.text and "/secret/path" not in resp.text


def test_missing_query_is_a_json_422() -> None:
    http, _, _, _ = client()
    resp = http.get("/v1/search")
    assert resp.status_code == 422 and resp.json()["error"]["code"] == "invalid_request"


def test_api_key_guards_everything_but_healthz() -> None:
    http, _, _, _ = client(api_key="s3cret-key")
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.get("/v1/search", params={"q": "x"}).status_code == 401
    assert http.get("/v1/search", params={"q": "x"}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = http.get("/v1/search", params={"q": "x"}, headers={"Authorization": "Bearer s3cret-key"})
    assert ok.status_code == 200


def test_thumbnail_and_metrics() -> None:
    http, _, _, _ = client()
    assert http.get("/v1/frames/f1/thumbnail").headers["content-type"] == "image/jpeg"
    assert http.get("/v1/frames/f2/thumbnail").status_code == 404
    metrics = http.get("/metrics").text
    assert 'vidx_router_events{kind="ignored_not_video"} 2.0' in metrics
    assert 'vidx_videos{status="indexed"} 0.0' in metrics
