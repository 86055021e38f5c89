"""The whole product: the Ray Serve app (Api, EventRouter, IndexConsumer on the Celery task queue,
Encoder) over real MinIO and RabbitMQ containers. Videos are uploaded with the plain ``minio``
client — no API call — and found by search."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from infra.harness.faults import start_app
from infra.harness.services import Services, eventually, unique_prefix
from pipeline.settings import Settings
from storage.ids import video_id
from tests.e2e.test_metrics import metric_sum
from tests.media import frame_at, write_corrupt_mp4, write_video

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

INDEX_TIMEOUT_S = 120.0
MOMENT_KEYS = {
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
VIDEO_KEYS = {"video_id", "uri", "status", "error", "frames", "duration_s", "model", "models", "updated_at"}


@dataclass
class App:
    settings: Settings
    services: Services
    http: httpx.Client

    @property
    def bucket(self) -> str:
        return self.settings.s3.upload_bucket

    def upload(self, key: str, path: Path) -> str:
        self.services.minio_client().fput_object(self.bucket, key, str(path), content_type="video/mp4")
        return video_id(self.bucket, key)

    def video(self, vid: str) -> dict[str, Any] | None:
        resp = self.http.get(f"/v1/videos/{vid}")
        return resp.json() if resp.status_code == 200 else None

    def wait_status(self, vid: str, *statuses: str, timeout_s: float = INDEX_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            last = self.video(vid)
            if last is not None and last["status"] in statuses:
                return last
            time.sleep(0.5)
        raise AssertionError(f"{vid} did not reach {statuses} in {timeout_s}s; last: {last}")

    def image_search(self, rgb: Any, k: int = 5) -> dict[str, Any]:
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, format="PNG")
        resp = self.http.post(f"/v1/search/image?k={k}", files={"image": ("q.png", buf.getvalue(), "image/png")})
        assert resp.status_code == 200, resp.text
        return dict(resp.json())


@pytest.fixture(scope="module")
def app(services: Services, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    with start_app(services, unique_prefix(), tiny_model_dir, tmp_path_factory.mktemp("state")) as host:
        yield App(host.settings, services, host.http)


def test_uploaded_videos_are_found_by_image_and_text(app: App, tmp_path: Path) -> None:
    ids = [
        app.upload(f"e2e/clip {n}.mp4", write_video(tmp_path / f"{n}.mp4", seconds=8, seed=300 + n)) for n in (1, 2, 3)
    ]
    records = [app.wait_status(v, "indexed") for v in ids]
    for record in records:
        assert set(record) == VIDEO_KEYS
        assert record["frames"] == 8 and record["error"] is None
    # The frame of video 2 at t = 4 s finds video 2 at 4 s.
    body = app.image_search(frame_at(4, 302))
    assert set(body) == {"results", "took_ms", "model"} and body["model"] == app.settings.model.id
    top = body["results"][0]
    assert set(top) == MOMENT_KEYS
    assert top["video_id"] == ids[1]
    assert top["ts_s"] == 4.0
    assert top["start_s"] <= top["ts_s"] < top["end_s"]
    assert app.http.get(top["thumbnail_url"].replace(app.settings.api_url, "")).headers["content-type"] == "image/jpeg"
    playable = httpx.get(top["video_url"].split("#")[0], timeout=10)
    assert playable.status_code == 200 and len(playable.content) > 0
    # Text search answers with well-formed moments.
    resp = app.http.get("/v1/search", params={"q": "a red car at night", "k": 3})
    assert resp.status_code == 200, resp.text
    text = resp.json()
    assert set(text) == {"results", "took_ms", "model"} and 1 <= len(text["results"]) <= 3
    for moment in text["results"]:
        assert set(moment) == MOMENT_KEYS
        assert moment["start_s"] <= moment["ts_s"] < moment["end_s"]
        assert moment["video_url"].endswith(f"#t={moment['ts_s']:g}")
    listed = app.http.get("/v1/videos", params={"uri": f"s3://{app.bucket}/e2e/clip 2.mp4"}).json()
    assert [v["video_id"] for v in listed["videos"]] == [ids[1]]


def test_delete_and_overwrite_follow_the_bucket(app: App, tmp_path: Path) -> None:
    vid = app.upload("e2e/changing.mp4", write_video(tmp_path / "a.mp4", seconds=5, seed=400))
    app.wait_status(vid, "indexed")
    before = app.image_search(frame_at(3, 400))["results"][0]
    assert before["video_id"] == vid
    old_thumbnail = before["thumbnail_url"].replace(app.settings.api_url, "")
    assert app.http.get(old_thumbnail).status_code == 200
    # Overwrite with different content: search follows the new content.
    app.upload("e2e/changing.mp4", write_video(tmp_path / "b.mp4", seconds=6, seed=401))
    eventually(
        lambda: (app.video(vid) or {}).get("frames") == 6 and app.video(vid)["status"] == "indexed",  # type: ignore[index]
        "the overwrite to be indexed",
        INDEX_TIMEOUT_S,
    )
    top = app.image_search(frame_at(5, 401))["results"][0]
    assert top["video_id"] == vid and top["ts_s"] == 5.0
    # Frame ids repeat across versions; thumbnail links don't: the old one no longer shows a picture.
    assert app.http.get(old_thumbnail).status_code == 404
    assert app.http.get(top["thumbnail_url"].replace(app.settings.api_url, "")).status_code == 200
    # Delete: status deleted and gone from results within 10 s.
    app.services.minio_client().remove_object(app.bucket, "e2e/changing.mp4")
    app.wait_status(vid, "deleted", timeout_s=10)
    assert all(r["video_id"] != vid for r in app.image_search(frame_at(5, 401), k=20)["results"])


def test_bad_objects_are_answered_and_good_ones_still_indexed(app: App, tmp_path: Path) -> None:
    app.services.minio_client().put_object(app.bucket, "e2e/notes.txt", io.BytesIO(b"hi"), 2, content_type="text/plain")
    bad = app.upload("e2e/broken.mp4", write_corrupt_mp4(tmp_path / "broken.mp4"))
    good = app.upload("e2e/after-broken.mp4", write_video(tmp_path / "g.mp4", seconds=3, seed=500))
    failed = app.wait_status(bad, "failed")
    assert failed["error"].startswith("decode error")
    app.wait_status(good, "indexed")
    assert app.video(video_id(app.bucket, "e2e/notes.txt")) is None
    eventually(
        lambda: (
            metric_sum(app.http.get("/metrics").text, "ray_vidx_bucket_events_total", kind="ignored_not_video") == 1
        ),
        "the .txt to be counted as ignored",
        30,
    )
    failed_list = app.http.get("/v1/videos", params={"status": "failed"}).json()["videos"]
    assert bad in [v["video_id"] for v in failed_list]


def test_http_contract_shapes_and_errors(app: App, tmp_path: Path) -> None:
    assert app.http.get("/healthz").json() == {"status": "ok"}
    app.services.minio_client().fput_object(
        app.bucket, "e2e/api.mp4", str(write_video(tmp_path / "api.mp4", seconds=2, seed=600))
    )
    resp = app.http.post("/v1/index", json={"uri": f"s3://{app.bucket}/e2e/api.mp4"})
    assert resp.status_code == 202
    body = resp.json()
    assert set(body) == {"video_id", "task_id", "status"} and body["status"] == "queued"
    app.wait_status(body["video_id"], "indexed")
    for bad_uri in ("http://example.com/x.mp4", "s3://other-bucket/x.mp4", f"s3://{app.bucket}/../x.mp4"):
        resp = app.http.post("/v1/index", json={"uri": bad_uri})
        assert resp.status_code == 400 and set(resp.json()["error"]) == {"code", "message"}
    missing = app.http.get("/v1/videos/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert app.http.get("/v1/search", params={"q": "x", "k": 0}).status_code == 400
