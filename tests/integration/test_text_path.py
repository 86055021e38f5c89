"""The words of a video through the real app: MinIO -> RabbitMQ -> EventRouter -> IndexConsumer (the
frames) -> text queue -> TextConsumer (the words) -> the text table in LanceDB on MinIO, with a subtitle
source on (``VIDX_TEXT__SUBTITLES``); an overwrite's words replace the old ones and a delete removes them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray import serve

from infra.dev.textclips import Cue, subtitled_clip
from infra.harness.faults import AppHost, start_app
from infra.harness.services import Services, eventually, queue_counts, unique_prefix
from storage.catalog import VideoRecord, VideoStatus
from storage.ids import text_fingerprint, video_id
from storage.tables import IndexStore
from tests.harness import report_lines

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SETTLE_S = 180.0


@pytest.fixture(scope="module")
def host(services: Services, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AppHost]:
    env = {"VIDX_TEXT__SUBTITLES": "true"}
    with start_app(services, unique_prefix(), tiny_model_dir, tmp_path_factory.mktemp("state"), env=env) as app:
        yield app


def _words(store: IndexStore, record: VideoRecord) -> list[tuple[float, float, str]]:
    state = store.models.read()
    assert state.text is not None
    table = store.text_table(state.text.table).table()
    if table is None:
        return []
    rows = table.search().where(f"video_id = '{record.video_id}'").select(["start_s", "end_s", "text"]).limit(None)
    return sorted((r["start_s"], r["end_s"], r["text"]) for r in rows.to_list())


def _with_words(store: IndexStore, vid: str, version: str | None = None) -> VideoRecord | None:
    """The row once it is indexed with the text table's entry of its version (None before)."""
    record = store.catalog.get(vid)
    state = store.models.read()
    if record is None or record.status is not VideoStatus.INDEXED or state.text is None:
        return None
    if version is not None and record.version == version:
        return None
    entry = record.index_in(state.text.table)
    pipeline = state.text.pipeline or ""
    if entry is None or entry.fingerprint != text_fingerprint(record.version or "", pipeline):
        return None
    return record


def test_an_upload_with_subtitles_has_its_words_read_by_the_text_consumer_and_they_follow_the_object(
    request: pytest.FixtureRequest, host: AppHost, tmp_path: Path
) -> None:
    settings, services = host.settings, host.services
    store = IndexStore(settings.s3)
    key = "talks/harbour.mp4"
    vid = video_id(host.bucket, key)
    minio = services.minio_client()
    # The TextConsumer runs beside the IndexConsumer while a text source is on
    deployments = serve.status().applications[settings.serve.app_name].deployments
    assert {"IndexConsumer", "TextConsumer"} <= set(deployments)
    # Given an upload with a subtitle track
    clip = subtitled_clip(
        tmp_path / "harbour", [Cue(1.0, 2.5, "the harbour at dawn"), Cue(4.0, 5.0, "a red boat")], 6, fmt="mov_text"
    )
    started = time.monotonic()
    minio.fput_object(host.bucket, key, str(clip), content_type="video/mp4")
    # When the bucket event is indexed, then its text job runs
    eventually(lambda: _with_words(store, vid) is not None, "the video's words in its row", SETTLE_S, 0.5)
    took_s = time.monotonic() - started
    record = _with_words(store, vid)
    assert record is not None
    # Then the text table holds the cues at their times, and the row still has its frames
    assert _words(store, record) == [(1.0, 2.5, "the harbour at dawn"), (4.0, 5.0, "a red boat")]
    assert record.frames == store.active_frames().count(vid) > 0
    # When the object is overwritten with other words
    other = subtitled_clip(tmp_path / "lighthouse", [Cue(2.0, 3.0, "a green lighthouse")], 5, fmt="mov_text")
    minio.fput_object(host.bucket, key, str(other), content_type="video/mp4")
    eventually(
        lambda: _with_words(store, vid, version=record.version) is not None, "the new version's words", SETTLE_S, 0.5
    )
    overwritten = _with_words(store, vid, version=record.version)
    assert overwritten is not None
    # Then only the new words are left
    assert _words(store, overwritten) == [(2.0, 3.0, "a green lighthouse")]
    # When it is deleted, its words go with it
    minio.remove_object(host.bucket, key)

    def gone() -> bool:
        now = store.catalog.get(vid)
        return now is not None and now.status is VideoStatus.DELETED and _words(store, overwritten) == []

    eventually(gone, "the video and its words removed", SETTLE_S, 0.5)
    eventually(lambda: queue_counts(services, settings.serve.text_queue) == (0, 0), "the text queue drained", 60, 0.5)
    report_lines(
        request.config,
        [f"text path: the words in the text table {took_s:.1f}s after the upload; overwrite and delete follow"],
    )
