"""pipeline/indexer.py over an in-memory object store, a deterministic embedder and a local LanceDB."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from events.jobs import IndexJob, JobOp, JobSource
from pipeline.indexer import Indexer, JobResult, Outcome, mark_queued
from pipeline.settings import Settings
from storage.catalog import VideoRecord, VideoStatus
from storage.errors import CorruptVideo, LimitExceeded
from storage.s3 import ObjectHead
from storage.tables import IndexStore
from tests.media import write_corrupt_mp4, write_video


class MemoryObjects:
    """An object store in a dict: key -> file. ``on_download`` runs mid-job to simulate a race."""

    def __init__(self) -> None:
        self.files: dict[str, Path] = {}
        self.on_download: Callable[[], None] | None = None
        self.downloads = 0

    def put(self, key: str, path: Path) -> None:
        self.files[key] = path

    def head(self, bucket: str, key: str) -> ObjectHead | None:
        path = self.files.get(key)
        if path is None:
            return None
        etag = hashlib.md5(path.read_bytes()).hexdigest()
        return ObjectHead(bucket, key, path.stat().st_size, etag, None, "video/mp4", None)

    def download(self, head: ObjectHead, dest: Path) -> int:
        self.downloads += 1
        shutil.copyfile(self.files[head.key], dest)
        if self.on_download is not None:
            hook, self.on_download = self.on_download, None
            hook()
        return dest.stat().st_size


class MeanColour:
    """A stand-in encoder: the normalised mean colour and its square (different frames differ)."""

    model_id = "test/mean-colour"

    def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]:
        means = np.stack([img.reshape(-1, 3).mean(axis=0) for img in images]).astype(np.float32) + 1.0
        vectors = np.concatenate([means, means**2 / 255.0], axis=1)
        return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture
def parts(tmp_path: Path) -> tuple[Indexer, IndexStore, MemoryObjects]:
    settings = Settings()
    store = IndexStore(settings.s3, uri=str(tmp_path / "lance"))
    objects = MemoryObjects()
    return Indexer(settings, MeanColour(), store, objects), store, objects


def job(key: str, op: JobOp = JobOp.INDEX) -> IndexJob:
    return IndexJob(op=op, bucket="videos", key=key, source=JobSource.EVENT)


def test_index_then_duplicate_is_a_no_op(parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path) -> None:
    indexer, store, objects = parts
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=4, seed=1))
    assert indexer.run(job("a.mp4")) == JobResult(job("a.mp4").video_id, Outcome.INDEXED, frames=4)
    record = store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.status is VideoStatus.INDEXED and record.duration_s == pytest.approx(4.0)
    assert indexer.run(job("a.mp4")).outcome is Outcome.UNCHANGED
    assert objects.downloads == 1 and store.frames.count() == 4


def test_queued_row_over_indexed_rows_settles_back_without_work(
    parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path
) -> None:
    indexer, store, objects = parts
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=2, seed=1))
    indexer.run(job("a.mp4"))
    mark_queued(store, IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.API))
    assert store.catalog.get(job("a.mp4").video_id).status is VideoStatus.QUEUED  # type: ignore[union-attr]
    assert indexer.run(job("a.mp4")).outcome is Outcome.UNCHANGED
    assert store.catalog.get(job("a.mp4").video_id).status is VideoStatus.INDEXED  # type: ignore[union-attr]
    assert objects.downloads == 1


def test_delete_event_for_an_existing_object_indexes_it(
    parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path
) -> None:
    indexer, _, objects = parts
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=2, seed=1))
    assert indexer.run(job("a.mp4", JobOp.DELETE)).outcome is Outcome.INDEXED


def test_create_event_for_a_gone_object_removes_it(
    parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path
) -> None:
    indexer, store, objects = parts
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=3, seed=1))
    indexer.run(job("a.mp4"))
    del objects.files["a.mp4"]
    assert indexer.run(job("a.mp4")).outcome is Outcome.DELETED
    assert store.frames.count(job("a.mp4").video_id) == 0
    # A repeated delete, and a delete of something never indexed, commit nothing.
    assert indexer.run(job("a.mp4", JobOp.DELETE)).outcome is Outcome.UNCHANGED
    assert indexer.run(job("never.mp4", JobOp.DELETE)).outcome is Outcome.UNCHANGED
    assert store.catalog.get(job("never.mp4").video_id) is None


def test_an_overwrite_during_indexing_is_followed_not_committed_stale(
    parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path
) -> None:
    indexer, store, objects = parts
    objects.put("a.mp4", write_video(tmp_path / "v1.mp4", seconds=3, seed=1))
    v2 = write_video(tmp_path / "v2.mp4", seconds=5, seed=2)
    objects.on_download = lambda: objects.put("a.mp4", v2)  # overwritten while v1 is being embedded
    result = indexer.run(job("a.mp4"))
    assert result.outcome is Outcome.INDEXED and result.frames == 5
    record = store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.version == hashlib.md5(v2.read_bytes()).hexdigest()
    assert store.frames.count(job("a.mp4").video_id) == 5


def test_a_delete_during_indexing_removes_instead(
    parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path
) -> None:
    indexer, store, objects = parts
    objects.put("a.mp4", write_video(tmp_path / "v1.mp4", seconds=3, seed=1))
    objects.on_download = lambda: objects.files.pop("a.mp4")
    assert indexer.run(job("a.mp4")).outcome is Outcome.DELETED
    assert store.frames.count() == 0


def test_permanent_failure_is_recorded_and_old_rows_stay(
    parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path
) -> None:
    indexer, store, objects = parts
    objects.put("a.mp4", write_video(tmp_path / "good.mp4", seconds=2, seed=1))
    indexer.run(job("a.mp4"))
    objects.put("a.mp4", write_corrupt_mp4(tmp_path / "bad.mp4"))
    with pytest.raises(CorruptVideo):
        indexer.run(job("a.mp4"))
    record = store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.status is VideoStatus.FAILED
    assert record.error is not None and record.error.startswith("decode error")
    assert store.frames.count(job("a.mp4").video_id) == 2


def test_limits_name_themselves_in_the_reason(tmp_path: Path) -> None:
    settings = Settings.model_validate({"limits": {"max_duration_s": 2.0}})
    store = IndexStore(settings.s3, uri=str(tmp_path / "lance"))
    objects = MemoryObjects()
    objects.put("long.mp4", write_video(tmp_path / "long.mp4", seconds=4, seed=1))
    with pytest.raises(LimitExceeded):
        Indexer(settings, MeanColour(), store, objects).run(job("long.mp4"))
    record = store.catalog.get(job("long.mp4").video_id)
    assert record is not None and "max duration" in (record.error or "")


def test_a_late_failure_does_not_overwrite_a_newer_outcome(parts: tuple[Indexer, IndexStore, MemoryObjects]) -> None:
    indexer, store, _ = parts
    vid = job("a.mp4").video_id
    store.put_video(VideoRecord(video_id=vid, uri="s3://videos/a.mp4", status=VideoStatus.INDEXED, version="v2"))
    indexer.record_failure(job("a.mp4"), "gave up after 4 attempts", version="v1")
    assert store.catalog.get(vid).status is VideoStatus.INDEXED  # type: ignore[union-attr]
    indexer.record_failure(job("a.mp4"), "gave up after 4 attempts")  # the giving-up consumer saw no version
    assert store.catalog.get(vid).status is VideoStatus.INDEXED  # type: ignore[union-attr]
    indexer.record_failure(job("a.mp4"), "gave up after 4 attempts", version="v2")
    assert store.catalog.get(vid).status is VideoStatus.FAILED  # type: ignore[union-attr]
    indexer.record_failure(job("b.mp4"), "HEAD s3://videos/b.mp4: object store answered 403")
    assert store.catalog.get(job("b.mp4").video_id).status is VideoStatus.FAILED  # type: ignore[union-attr]


def test_each_job_reports_where_its_time_went(parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path) -> None:
    indexer, _, objects = parts
    objects.put("t.mp4", write_video(tmp_path / "t.mp4", seconds=3, seed=4))
    stages = indexer.run(job("t.mp4")).stages
    assert {"head", "catalog", "fetch", "decode", "embed", "thumbnails", "write"} <= set(stages)
    assert all(seconds >= 0 for seconds in stages.values()) and stages["decode"] > 0


def test_an_overwrite_during_the_commit_is_followed(tmp_path: Path) -> None:
    # The job for v2 may finish before the v1 job's commit lands; the v1 job must not leave v1 behind.
    settings = Settings()
    store = IndexStore(settings.s3, uri=str(tmp_path / "lance"))
    objects = MemoryObjects()
    v1 = write_video(tmp_path / "v1.mp4", seconds=3, seed=1)
    v2 = write_video(tmp_path / "v2.mp4", seconds=5, seed=2)
    objects.put("a.mp4", v1)

    class OverwriteOnCommit:
        def __init__(self) -> None:
            self.commits = 0

        def replace_frames(self, **kwargs: Any) -> None:
            store.replace_frames(**kwargs)
            self.commits += 1
            if self.commits == 1:
                objects.put("a.mp4", v2)

    writer = OverwriteOnCommit()
    result = Indexer(settings, MeanColour(), store, objects, writer=writer).run(job("a.mp4"))
    head = objects.head("videos", "a.mp4")
    assert head is not None
    record = store.catalog.get(job("a.mp4").video_id)
    assert result.outcome is Outcome.INDEXED and result.frames == 5 and writer.commits == 2
    assert record is not None and record.version == head.version and record.frames == 5
    assert store.frames.count(job("a.mp4").video_id) == 5


def test_an_upload_during_a_removal_is_indexed(tmp_path: Path) -> None:
    settings = Settings()
    objects = MemoryObjects()
    v2 = write_video(tmp_path / "v2.mp4", seconds=2, seed=9)

    class UploadDuringDelete(IndexStore):
        def delete_frames(self, video_id: str) -> None:
            super().delete_frames(video_id)
            objects.put("a.mp4", v2)  # uploaded again, and its own job already done

    store = UploadDuringDelete(settings.s3, uri=str(tmp_path / "lance"))
    objects.put("a.mp4", write_video(tmp_path / "v1.mp4", seconds=3, seed=8))
    indexer = Indexer(settings, MeanColour(), store, objects)
    assert indexer.run(job("a.mp4")).frames == 3
    objects.files.pop("a.mp4")
    result = indexer.run(job("a.mp4", JobOp.DELETE))
    record = store.catalog.get(job("a.mp4").video_id)
    assert result.outcome is Outcome.INDEXED and result.frames == 2
    assert record is not None and record.status is VideoStatus.INDEXED and store.frames.count(record.video_id) == 2


def test_a_status_repair_never_touches_a_newer_version(parts: tuple[Indexer, IndexStore, MemoryObjects]) -> None:
    _, store, _ = parts
    vid = job("a.mp4").video_id
    store.put_video(
        VideoRecord(video_id=vid, uri="s3://videos/a.mp4", status=VideoStatus.INDEXED, version="v2", fingerprint="fp2")
    )
    store.set_status(vid, VideoStatus.QUEUED, only_if_fingerprint="fp1")
    assert store.catalog.get(vid).status is VideoStatus.INDEXED  # type: ignore[union-attr]
    store.set_status(vid, VideoStatus.QUEUED, only_if_fingerprint="fp2")
    assert store.catalog.get(vid).status is VideoStatus.QUEUED  # type: ignore[union-attr]
