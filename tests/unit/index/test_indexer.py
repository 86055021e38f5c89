"""pipeline/index/indexer.py over an in-memory object store, a deterministic embedder and a local LanceDB."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

from events.jobs import IndexJob, JobOp, JobSource
from pipeline.index.indexer import Indexer, JobResult, Outcome
from pipeline.index.result import ConsumerKilled
from pipeline.jobs.videostate import QueueingSink, VideoStates
from pipeline.settings import Settings
from storage.catalog import VideoRecord, VideoStatus
from storage.commits.catalog import PendingWrite
from storage.errors import CorruptVideo, LimitExceeded, TransientError
from storage.frames import VideoFrames
from storage.s3 import ObjectHead
from storage.s3_errors import ObjectGone
from storage.tables import IndexStore
from tests.media import write_corrupt_mp4, write_video


class MemoryObjects:
    """An object store in a dict: key -> file, its ETag the file's MD5. A download is conditional on the
    ETag it is given, as S3's ``If-Match``. ``on_download`` runs mid-job to simulate a race."""

    def __init__(self) -> None:
        self.files: dict[str, Path] = {}
        self.on_download: Callable[[], None] | None = None
        self.downloads = 0
        self.heads = 0

    def put(self, key: str, path: Path) -> None:
        self.files[key] = path

    def head(self, bucket: str, key: str) -> ObjectHead | None:
        self.heads += 1
        path = self.files.get(key)
        if path is None:
            return None
        return ObjectHead(bucket, key, path.stat().st_size, etag_of(path), None, "video/mp4", None)

    def download(self, head: ObjectHead, dest: Path) -> int:
        self.downloads += 1
        path = self.files.get(head.key)
        if path is None or (head.etag and etag_of(path) != head.etag):
            raise ObjectGone(f"GET s3://{head.bucket}/{head.key}: the object changed or disappeared")
        shutil.copyfile(path, dest)
        if self.on_download is not None:
            hook, self.on_download = self.on_download, None
            hook()
        return dest.stat().st_size


def etag_of(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


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
    states = VideoStates(store.catalog)
    states.queue_async(job("a.mp4"), states.read(job("a.mp4").video_id))
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


def event(key: str, uploaded: Path) -> IndexJob:
    """The job of the bucket event of ``uploaded``'s upload as ``key``, with the ETag and size it reported."""
    size = uploaded.stat().st_size
    return IndexJob(
        op=JobOp.INDEX, bucket="videos", key=key, source=JobSource.EVENT, hint_etag=etag_of(uploaded), hint_size=size
    )


def test_an_event_at_the_objects_etag_is_fetched_on_it_and_looked_at_once_after_the_settle(
    parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path
) -> None:
    indexer, store, objects = parts
    objects.put("a.mp4", path := write_video(tmp_path / "a.mp4", seconds=3, seed=1))
    assert indexer.run(event("a.mp4", path)).outcome is Outcome.INDEXED
    assert objects.heads == 1 and objects.downloads == 1  # the look after the settle; no HEAD before
    record = store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.status is VideoStatus.INDEXED and record.version == etag_of(path)
    assert store.frames.count(job("a.mp4").video_id) == 3


def test_an_event_whose_etag_the_object_no_longer_has_indexes_the_object_as_it_is(
    parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path
) -> None:
    # Overwritten after the event: the fetch on the event's ETag fails, the next round HEADs and indexes v2.
    indexer, store, objects = parts
    v1 = write_video(tmp_path / "v1.mp4", seconds=3, seed=1)
    objects.put("a.mp4", v2 := write_video(tmp_path / "v2.mp4", seconds=5, seed=2))
    result = indexer.run(event("a.mp4", v1))
    assert result.outcome is Outcome.INDEXED and result.frames == 5
    record = store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.version == etag_of(v2)
    assert objects.downloads == 2 and store.frames.count(job("a.mp4").video_id) == 5


def test_a_redelivered_event_heads_before_it_fetches_so_a_stale_etag_costs_no_failed_fetch(
    parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path
) -> None:
    # Only a first start's first round fetches on the event's ETag: a redelivery (or a retry) looks first.
    indexer, store, objects = parts
    v1 = write_video(tmp_path / "v1.mp4", seconds=3, seed=1)
    objects.put("a.mp4", v2 := write_video(tmp_path / "v2.mp4", seconds=5, seed=2))
    result = indexer.run(event("a.mp4", v1), "t1", redelivered=True)
    assert result.outcome is Outcome.INDEXED and result.frames == 5
    assert objects.downloads == 1 and objects.heads == 3  # before, before the write, after the settle
    record = store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.version == etag_of(v2)


def test_an_event_of_an_object_deleted_since_leaves_nothing_behind(
    parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path
) -> None:
    indexer, store, objects = parts
    gone = write_video(tmp_path / "a.mp4", seconds=3, seed=1)
    assert indexer.run(event("a.mp4", gone)).outcome is Outcome.UNCHANGED
    assert objects.downloads == 1 and objects.heads == 1  # the fetch said so; the HEAD found it gone
    assert store.catalog.get(job("a.mp4").video_id) is None and store.frames.count() == 0


def test_a_late_event_of_an_indexed_version_is_looked_at_before_it_is_trusted(
    parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path
) -> None:
    # v1 indexed, then overwritten by v2 whose own event is still on its way: a repeat of v1's event finds
    # v1's rows in place. Nothing is fetched to check its ETag, so it HEADs, and indexes v2.
    indexer, store, objects = parts
    objects.put("a.mp4", v1 := write_video(tmp_path / "v1.mp4", seconds=3, seed=1))
    assert indexer.run(event("a.mp4", v1)).outcome is Outcome.INDEXED
    heads = objects.heads
    assert indexer.run(event("a.mp4", v1)).outcome is Outcome.UNCHANGED
    assert objects.heads == heads + 1  # the look, nothing fetched
    objects.put("a.mp4", v2 := write_video(tmp_path / "v2.mp4", seconds=5, seed=2))
    assert indexer.run(event("a.mp4", v1)).outcome is Outcome.INDEXED
    record = store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.version == etag_of(v2)
    assert store.frames.count(job("a.mp4").video_id) == 5


@pytest.mark.parametrize(("claim_after_s", "outcome"), [(0.0, Outcome.DELETED), (60.0, Outcome.UNCHANGED)])
def test_a_delete_during_indexing_removes_instead(tmp_path: Path, claim_after_s: float, outcome: Outcome) -> None:
    # A claimed row is settled deleted; a job that wrote no claim (a first start shorter than
    # claim_after_s) leaves no row of an object it never indexed, as a delete of an unknown object does.
    settings = Settings.model_validate({"serve": {"claim_after_s": claim_after_s}})
    store = IndexStore(settings.s3, uri=str(tmp_path / "lance"))
    objects = MemoryObjects()
    indexer = Indexer(settings, MeanColour(), store, objects)
    objects.put("a.mp4", write_video(tmp_path / "v1.mp4", seconds=3, seed=1))
    objects.on_download = lambda: objects.files.pop("a.mp4")
    assert indexer.run(job("a.mp4")).outcome is outcome
    assert store.frames.count() == 0
    record = store.catalog.get(job("a.mp4").video_id)
    if outcome is Outcome.DELETED:
        assert record is not None and record.status is VideoStatus.DELETED
    else:
        assert record is None


def test_an_event_whose_object_is_deleted_after_its_fetch_is_indexed_then_removed(
    parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path
) -> None:
    # An upload's job looks at the object by its fetch only: deleted once that fetch began, the job writes
    # and settles, the look after the settle finds the object gone, and the next round removes the rows.
    indexer, store, objects = parts
    objects.put("a.mp4", path := write_video(tmp_path / "v1.mp4", seconds=3, seed=1))
    objects.on_download = lambda: objects.files.pop("a.mp4")
    assert indexer.run(event("a.mp4", path)).outcome is Outcome.DELETED
    assert store.frames.count() == 0
    record = store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.status is VideoStatus.DELETED


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
    store.catalog.write(VideoRecord(video_id=vid, uri="s3://videos/a.mp4", status=VideoStatus.INDEXED, version="v2"), 0)
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

        def replace(self, frames: VideoFrames) -> None:
            store.frames.replace(frames)
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

    def upload_during_delete(step: str, _job: IndexJob) -> None:
        if step == "removed" and "a.mp4" not in objects.files:
            objects.put("a.mp4", v2)  # uploaded again, and its own job already done

    store = IndexStore(settings.s3, uri=str(tmp_path / "lance"))
    objects.put("a.mp4", write_video(tmp_path / "v1.mp4", seconds=3, seed=8))
    indexer = Indexer(settings, MeanColour(), store, objects, hooks=upload_during_delete)
    assert indexer.run(job("a.mp4")).frames == 3
    objects.files.pop("a.mp4")
    result = indexer.run(job("a.mp4", JobOp.DELETE))
    record = store.catalog.get(job("a.mp4").video_id)
    assert result.outcome is Outcome.INDEXED and result.frames == 2
    assert record is not None and record.status is VideoStatus.INDEXED and store.frames.count(record.video_id) == 2


def test_rows_written_over_an_indexed_video_are_found_and_rewritten(
    parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path
) -> None:
    # A job that lost a race may write its rows after the winner settled: the catalog still says
    # indexed with the winner's fingerprint. The next job for the video must not trust the catalog.
    indexer, store, objects = parts
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=3, seed=1))
    indexer.run(job("a.mp4"))
    record = store.catalog.get(job("a.mp4").video_id)
    assert record is not None
    rows = store.frames.summary(record.video_id)
    assert rows.rows == 3 and set(rows.fingerprints) == {record.fingerprint}
    store.frames.delete(record.video_id)  # the stray write: here, rows gone under an indexed row
    assert indexer.run(job("a.mp4")).outcome is Outcome.INDEXED
    assert store.frames.count(record.video_id) == 3 and objects.downloads == 2


def test_a_redelivery_in_the_same_process_is_not_a_crash(
    parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path
) -> None:
    indexer, store, objects = parts
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=2, seed=1))
    vid = job("a.mp4").video_id
    # A claim by this task, left by this (live) process: a retry or a redelivery.
    store.catalog.write(
        VideoRecord(vid, "s3://videos/a.mp4", VideoStatus.INDEXING, task_id="t1", holder=indexer.holder, crashes=1), 0
    )
    assert indexer.run(job("a.mp4"), task_id="t1").outcome is Outcome.INDEXED
    assert store.catalog.get(vid).crashes == 1  # type: ignore[union-attr]


def test_a_claim_left_by_a_dead_consumer_counts_and_the_last_start_fails_the_video(tmp_path: Path) -> None:
    settings = Settings.model_validate({"serve": {"max_crashes": 2}})
    store = IndexStore(settings.s3, uri=str(tmp_path / "lance"))
    objects = MemoryObjects()
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=2, seed=1))
    vid = job("a.mp4").video_id
    alive = {"proc:me"}
    indexer = Indexer(settings, MeanColour(), store, objects, holder="proc:me", holder_alive=lambda h: h in alive)
    store.catalog.write(
        VideoRecord(vid, "s3://videos/a.mp4", VideoStatus.INDEXING, task_id="t1", holder="proc:gone"), 0
    )

    # One dead holder: charged once (1 < 2), the job runs and indexes.
    claimed: list[int] = []

    def die_after_claim(step: str, _job: IndexJob) -> None:
        if step == "fetch":
            claimed.append(store.catalog.get(vid).crashes)  # type: ignore[union-attr]
            raise RuntimeError("consumer killed")  # the process dies here, holding the claim

    dying = Indexer(
        settings,
        MeanColour(),
        store,
        objects,
        holder="proc:gone2",
        holder_alive=lambda h: h in alive,
        hooks=die_after_claim,
    )
    with pytest.raises(RuntimeError):
        dying.run(job("a.mp4"), task_id="t1")
    assert claimed == [1]
    # Its holder is dead too: the second crash reaches max_crashes, the video fails without running.
    with pytest.raises(ConsumerKilled, match="died 2 times"):
        indexer.run(job("a.mp4"), task_id="t1")
    assert objects.downloads == 0
    # Another task for the same video starts from zero.
    store.catalog.write(store.catalog.get(vid).evolve(status=VideoStatus.QUEUED), store.catalog.get(vid).rev)  # type: ignore[union-attr]
    assert indexer.run(job("a.mp4"), task_id="t2").outcome is Outcome.INDEXED


def test_a_job_leaving_after_it_changed_the_rows_puts_the_row_back_in_flight(
    parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path
) -> None:
    # A job rewrote the rows, then failed before it settled the row (the store blipped): the row
    # must not keep saying "indexed" over rows it no longer describes.
    indexer, store, objects = parts
    objects.put("a.mp4", write_video(tmp_path / "v1.mp4", seconds=2, seed=1))
    indexer.run(job("a.mp4"))
    objects.put("a.mp4", write_video(tmp_path / "v2.mp4", seconds=3, seed=2))

    def blip_after_write(step: str, _job: IndexJob) -> None:
        if step == "written":
            raise TransientError("index table read failed: connection reset")

    settings = Settings()
    failing = Indexer(settings, MeanColour(), store, objects, hooks=blip_after_write)
    with pytest.raises(TransientError):
        failing.run(job("a.mp4"))
    record = store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.status is VideoStatus.INDEXING and record.frames == -1
    # The retry finds the row unsettled, looks at the rows, and settles the video.
    assert indexer.run(job("a.mp4")).outcome is Outcome.INDEXED
    record = store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.status is VideoStatus.INDEXED and record.frames == 3


class RunsTheJobInsideTheSubmit:
    """A task queue whose consumer runs the job before ``submit`` returns: the `queued` mark, written
    after the submit, comes after the job's whole run."""

    def __init__(self, indexer: Indexer) -> None:
        self.indexer = indexer
        self.results: list[JobResult] = []

    def submit(self, job: IndexJob) -> str:
        self.results.append(self.indexer.run(job, "t-api"))
        return "t-api"


@pytest.mark.parametrize("present", [True, False], ids=["indexed-object", "missing-object"])
def test_a_queued_mark_landing_after_its_job_found_nothing_to_do_is_not_left_behind(
    parts: tuple[Indexer, IndexStore, MemoryObjects], tmp_path: Path, present: bool
) -> None:
    indexer, store, objects = parts
    if present:
        objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=2, seed=1))
        assert indexer.run(job("a.mp4")).outcome is Outcome.INDEXED
    api_job = IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.API)
    queue = RunsTheJobInsideTheSubmit(indexer)
    QueueingSink(queue, VideoStates(store.catalog)).submit(api_job)
    assert [r.outcome for r in queue.results] == [Outcome.UNCHANGED]
    row = store.catalog.get(api_job.video_id)
    assert row is not None and row.status is (VideoStatus.INDEXED if present else VideoStatus.DELETED)
    assert objects.downloads == (1 if present else 0)


class LosesTheReplyToTheFinish:
    """Catalog writes that land, but the reply to the ``indexed`` write is lost (the writer was replaced,
    or answered after the caller's deadline): the caller gets a transient error for a landed write."""

    def __init__(self, store: IndexStore) -> None:
        from storage.commits.catalog import DirectWrites

        self.direct = DirectWrites(store.catalog)
        self.lost = 0

    def submit(self, record: VideoRecord, expected_rev: int) -> PendingWrite:
        pending = self.direct.submit(record, expected_rev)
        if record.status is not VideoStatus.INDEXED:
            return pending
        outcome = pending.result(0)
        assert outcome is not None  # it landed
        self.lost += 1
        return _LostReply()


class _LostReply:
    def result(self, timeout_s: float) -> VideoRecord | None:
        raise TransientError(f"catalog write failed: ActorDiedError (deadline {timeout_s:g}s)")


def test_a_lost_reply_of_a_landed_finish_leaves_the_video_indexed_without_a_re_embed(
    tmp_path: Path,
) -> None:
    settings = Settings()
    store = IndexStore(settings.s3, uri=str(tmp_path / "lance"))
    objects = MemoryObjects()
    writes = LosesTheReplyToTheFinish(store)
    embeds = CountingEmbedder()
    indexer = Indexer(settings, embeds, store, objects, catalog_writes=writes)
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=3, seed=1))
    assert indexer.run(job("a.mp4"), "t-1").outcome is Outcome.INDEXED
    assert writes.lost == 1
    record = store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.status is VideoStatus.INDEXED and record.frames == 3
    assert store.frames.count(job("a.mp4").video_id) == 3
    # A redelivery of the same task finds it done: nothing fetched or embedded again.
    assert indexer.run(job("a.mp4"), "t-1").outcome is Outcome.UNCHANGED
    assert objects.downloads == 1 and embeds.calls == 1


class CountingEmbedder(MeanColour):
    def __init__(self) -> None:
        self.calls = 0

    def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]:
        self.calls += 1
        return super().embed_images(images)


def test_a_retry_after_its_last_attempts_process_was_scaled_down_is_not_counted_as_a_crash(tmp_path: Path) -> None:
    """Attempt 0 of a task claims the video and leaves with a transient error (the claim stays, holder
    and all); its replica is then scaled down. Attempt 1 runs in another process: the dead holder
    ended its start by a retry, not by dying, so nothing is charged; a redelivery of attempt 1 after
    its process really died is charged. (The claims are eager here: a first start claims only past
    ``claim_after_s``, and this is about a start that did.)"""
    settings = Settings.model_validate({"serve": {"max_crashes": 1, "claim_after_s": 0}})
    store = IndexStore(settings.s3, uri=str(tmp_path / "lance"))
    objects = MemoryObjects()
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=2, seed=1))
    vid = job("a.mp4").video_id
    alive = {"proc:first", "proc:second"}

    def blip(step: str, _job: IndexJob) -> None:
        if step == "fetch":
            raise TransientError("object store answered 503")

    first = Indexer(
        settings, MeanColour(), store, objects, holder="proc:first", holder_alive=alive.__contains__, hooks=blip
    )
    with pytest.raises(TransientError):
        first.run(job("a.mp4"), "t1", attempt=0)
    left = store.catalog.get(vid)
    assert left is not None and left.holder == "proc:first" and left.attempt == 0
    alive.discard("proc:first")  # scaled down
    second = Indexer(settings, MeanColour(), store, objects, holder="proc:second", holder_alive=alive.__contains__)
    assert second.run(job("a.mp4"), "t1", attempt=1).outcome is Outcome.INDEXED
    indexed = store.catalog.get(vid)
    assert indexed is not None and indexed.crashes == 0
    # A real death: attempt 1's claim (of new content) left by a dead process, the same attempt delivered again.
    objects.put("a.mp4", write_video(tmp_path / "a2.mp4", seconds=3, seed=2))
    store.catalog.write(indexed.evolve(status=VideoStatus.INDEXING, holder="proc:dead", attempt=1), indexed.rev)
    third = Indexer(settings, MeanColour(), store, objects, holder="proc:third", holder_alive=alive.__contains__)
    with pytest.raises(ConsumerKilled):
        third.run(job("a.mp4"), "t1", attempt=1)


class LandsTheRemovalLate:
    """Catalog writes that land at once, except the ``deleted`` write: its caller gets a transient error,
    the row read back doesn't have it yet, and it lands right after that read (a frozen writer that
    resumes): whoever reads the row next sees it landed."""

    def __init__(self, store: IndexStore) -> None:
        from storage.commits.catalog import DirectWrites

        self.direct = DirectWrites(store.catalog)
        self.late: tuple[VideoRecord, int] | None = None
        self.landed_late = 0
        read = store.catalog.get

        def get(video_id: str) -> VideoRecord | None:
            row = read(video_id)
            if self.late is not None:  # the read-back of the failed write: then it lands
                record, rev = self.late
                self.late = None
                assert self.direct.submit(record, rev).result(0) is not None
                self.landed_late += 1
            return row

        store.catalog.get = get  # type: ignore[method-assign]

    def submit(self, record: VideoRecord, expected_rev: int) -> PendingWrite:
        if record.status is not VideoStatus.DELETED or self.landed_late:
            return self.direct.submit(record, expected_rev)
        self.late = (record, expected_rev)
        return _LostReply()


def test_a_removal_that_lands_after_its_caller_gave_up_is_not_undone(tmp_path: Path) -> None:
    """A delete job clears the rows and writes ``deleted``; the write's outcome is in doubt (the caller
    timed out, the read-back didn't see it) and it lands just after. The job leaves with a transient
    error: its clean-up must not put the row back to ``indexing`` over its own landed write (before
    the fix it did, and the row said ``indexing`` with -1 frames until a retry or the scheduled check)."""
    settings = Settings()
    store = IndexStore(settings.s3, uri=str(tmp_path / "lance"))
    objects = MemoryObjects()
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=2, seed=1))
    writes = LandsTheRemovalLate(store)
    indexer = Indexer(settings, MeanColour(), store, objects, catalog_writes=writes)
    assert indexer.run(job("a.mp4"), "t-1").outcome is Outcome.INDEXED
    del objects.files["a.mp4"]
    with pytest.raises(TransientError):
        indexer.run(job("a.mp4", JobOp.DELETE), "t-2")
    assert writes.landed_late == 1
    record = store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.status is VideoStatus.DELETED, record
    assert store.frames.count(job("a.mp4").video_id) == 0
