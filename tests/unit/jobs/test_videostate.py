"""The per-video transitions and the queueing sink over a real local catalog."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from events.jobs import IndexJob, JobOp, JobSource
from pipeline.jobs.queued_marks import STALE_INTERVALS, DeferredMarks, VersionClock
from pipeline.jobs.videostate import QueueingSink, VideoStates
from pipeline.settings import Settings
from storage.catalog import VideoRecord, VideoStatus
from storage.errors import TransientError
from storage.tables import IndexStore

JOB = IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.API)


@pytest.fixture
def states(tmp_path: Path) -> VideoStates:
    return VideoStates(IndexStore(Settings().s3, uri=str(tmp_path / "lance")).catalog)


class Sink:
    def __init__(self, states: VideoStates, fail: bool = False) -> None:
        self.states, self.fail = states, fail
        self.seen_status: list[str | None] = []

    def submit(self, job: IndexJob) -> str:
        record = self.states.read(job.video_id)
        self.seen_status.append(record.status.value if record else None)
        if self.fail:
            raise TransientError("task queue unavailable: ConnectionRefusedError")
        return "task-1"


def test_queued_is_marked_once_the_job_is_submitted(states: VideoStates) -> None:
    sink = Sink(states)
    assert QueueingSink(sink, states).submit(JOB) == "task-1"
    assert sink.seen_status == [None]  # nothing is written before the submit
    record = states.read(JOB.video_id)
    assert record is not None and record.status is VideoStatus.QUEUED


def test_a_failed_submit_writes_nothing(states: VideoStates) -> None:
    done = VideoRecord(JOB.video_id, JOB.uri, VideoStatus.INDEXED, version="e1", frames=2, fingerprint="fp")
    states.catalog.write(done, 0)
    with pytest.raises(TransientError):
        QueueingSink(Sink(states, fail=True), states).submit(JOB)
    back = states.read(JOB.video_id)
    assert back is not None and back.status is VideoStatus.INDEXED and back.rev == 1
    other = IndexJob(op=JobOp.INDEX, bucket="videos", key="new.mp4", source=JobSource.API)
    with pytest.raises(TransientError):
        QueueingSink(Sink(states, fail=True), states).submit(other)
    assert states.read(other.video_id) is None


class JobRunsBeforeTheMark(Sink):
    """A submit whose job claims and finishes the video before ``submit`` returns (a fast consumer)."""

    def submit(self, job: IndexJob) -> str:
        seen = self.states.read(job.video_id)
        claimed = self.states.claim(job, seen, version="e2", model="m", sampling="s", attempt=None, crashes=0)
        assert claimed is not None
        assert self.states.finish(claimed, version="e2", fingerprint="fp2", frames=3, duration_s=1.0) is not None
        return "task-2"


@pytest.mark.parametrize("existing", [False, True], ids=["new-video", "indexed-video"])
def test_the_queued_mark_never_lands_over_the_outcome_of_the_job_it_submitted(
    states: VideoStates, existing: bool
) -> None:
    if existing:
        states.catalog.write(VideoRecord(JOB.video_id, JOB.uri, VideoStatus.INDEXED, version="e1"), 0)
    assert QueueingSink(JobRunsBeforeTheMark(states), states).submit(JOB) == "task-2"
    record = states.read(JOB.video_id)
    assert record is not None and record.status is VideoStatus.INDEXED and record.fingerprint == "fp2"


def test_a_row_being_indexed_is_not_marked_queued(states: VideoStates) -> None:
    states.catalog.write(VideoRecord(JOB.video_id, JOB.uri, VideoStatus.INDEXING, task_id="t0"), 0)
    QueueingSink(Sink(states), states).submit(JOB)
    record = states.read(JOB.video_id)
    assert record is not None and record.status is VideoStatus.INDEXING and record.rev == 1


def test_every_transition_loses_to_a_write_it_did_not_see(states: VideoStates) -> None:
    first = states.catalog.write(VideoRecord(JOB.video_id, JOB.uri, VideoStatus.QUEUED), 0)
    assert first is not None
    moved = states.claim(JOB, first, version="e1", model="m", sampling="s", attempt=None, crashes=0)
    assert moved is not None
    # Every writer still holding the first revision loses, whatever it wanted to write.
    assert states.finish(first, version="e1", fingerprint="fp", frames=2, duration_s=1.0) is None
    assert states.removed(JOB, first) is None
    assert states.fail(JOB, first, "boom", "e1") is None
    pending = states.queue_async(JOB, first.evolve(status=VideoStatus.DELETED))
    assert pending is not None and states.wait(pending) is None
    assert states.read(JOB.video_id) == moved


def test_a_settle_job_failing_over_a_settled_row_rewrites_it_so_a_late_queued_mark_loses(
    states: VideoStates,
) -> None:
    done = states.catalog.write(VideoRecord(JOB.video_id, JOB.uri, VideoStatus.INDEXED, version="e2"), 0)
    assert done is not None
    settle = JOB.model_copy(update={"settle": True})
    again = states.fail(settle, done, "gave up", "e1")
    assert again is not None and again.status is VideoStatus.INDEXED and again.rev == done.rev + 1
    mark = states.queue_async(JOB, done)  # the API's mark, on the row it read before the submit
    assert mark is not None and states.wait(mark) is None
    assert states.read(JOB.video_id) == again


def test_a_failure_of_another_version_leaves_a_settled_row_alone(states: VideoStates) -> None:
    done = states.catalog.write(VideoRecord(JOB.video_id, JOB.uri, VideoStatus.INDEXED, version="e2"), 0)
    assert done is not None
    assert states.fail(JOB, done, "gave up", "e1") is done
    assert states.fail(JOB, done, "gave up", None) is done
    failed = states.fail(JOB, done, "decode error", "e2")
    assert failed is not None and failed.status is VideoStatus.FAILED


# -- deferred marks (the API: nothing read before the submit) ------------------------------------
@pytest.fixture
def deferred(states: VideoStates) -> Iterator[DeferredMarks]:
    marks = DeferredMarks(states, VersionClock(states.catalog, interval_s=0.01)).start()
    deadline = time.monotonic() + 10
    while marks.version() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    yield marks
    marks.stop()


class CountingCatalogReads(Sink):
    """A sink that counts the catalog reads made between the sink's call and its return."""

    def __init__(self, states: VideoStates) -> None:
        super().__init__(states)
        self.reads_before = 0
        self._real = states.catalog.get
        states.catalog.get = self._count  # type: ignore[method-assign]

    def _count(self, video_id: str) -> VideoRecord | None:
        self.reads_before += 1
        return self._real(video_id)

    def submit(self, job: IndexJob) -> str:
        self.reads_at_submit = self.reads_before
        return "task-1"


def test_a_deferred_submit_reads_nothing_and_the_mark_follows(states: VideoStates, deferred: DeferredMarks) -> None:
    sink = CountingCatalogReads(states)
    assert QueueingSink(sink, states, deferred).submit(JOB) == "task-1"
    assert sink.reads_at_submit == 0
    assert deferred.wait_idle(10)
    record = states.read(JOB.video_id)
    assert record is not None and record.status is VideoStatus.QUEUED


@pytest.mark.parametrize("existing", [False, True], ids=["new-video", "indexed-video"])
def test_a_deferred_mark_never_lands_over_the_outcome_of_the_job_it_submitted(
    states: VideoStates, deferred: DeferredMarks, existing: bool
) -> None:
    if existing:
        states.catalog.write(VideoRecord(JOB.video_id, JOB.uri, VideoStatus.INDEXED, version="e1"), 0)
        _wait_for_version_past(deferred, states.catalog.version() - 1)
    assert QueueingSink(JobRunsBeforeTheMark(states), states, deferred).submit(JOB) == "task-2"
    assert deferred.wait_idle(10)
    record = states.read(JOB.video_id)
    assert record is not None and record.status is VideoStatus.INDEXED and record.fingerprint == "fp2"


def test_a_row_changed_after_the_clocks_version_is_left_as_it_is(states: VideoStates) -> None:
    class Frozen:
        def start(self) -> None: ...

        def stop(self) -> None: ...

        def version(self) -> int:
            return 1  # the empty table: any row written since makes the mark lose

    marks = DeferredMarks(states, Frozen()).start()  # type: ignore[arg-type]
    done = states.catalog.write(VideoRecord(JOB.video_id, JOB.uri, VideoStatus.INDEXED, version="e1"), 0)
    assert done is not None
    QueueingSink(Sink(states), states, marks).submit(JOB)
    assert marks.wait_idle(10)
    assert states.read(JOB.video_id) == done
    marks.stop()


def test_marks_racing_their_jobs_on_threads_never_leave_a_video_queued(
    states: VideoStates, deferred: DeferredMarks
) -> None:
    """Each submit starts its job on a thread at once (claim, then finish): the jobs, the marks'
    thread and the submits all run concurrently; whatever their order, every video ends indexed."""
    jobs = [IndexJob(op=JobOp.INDEX, bucket="videos", key=f"race-{i}.mp4", source=JobSource.API) for i in range(12)]
    running: list[threading.Thread] = []

    class StartsTheJob(Sink):
        def submit(self, job: IndexJob) -> str:
            def run() -> None:
                for _ in range(20):  # the job's rounds: a mark that landed first makes it go again
                    seen = self.states.read(job.video_id)
                    claimed = self.states.claim(
                        job, seen, version="e1", model="m", sampling="s", attempt=None, crashes=0
                    )
                    if claimed is None:
                        continue
                    time.sleep(0.005)
                    if self.states.finish(claimed, version="e1", fingerprint="fp", frames=1, duration_s=1.0):
                        return

            thread = threading.Thread(target=run)
            thread.start()
            running.append(thread)
            return f"task-{job.key}"

    sink = QueueingSink(StartsTheJob(states), states, deferred)
    submitters = [threading.Thread(target=sink.submit, args=(job,)) for job in jobs]
    for t in submitters:
        t.start()
    for t in submitters:
        t.join(30)
    for t in running:
        t.join(60)
    assert deferred.wait_idle(30)
    statuses = {job.key: getattr(states.read(job.video_id), "status", None) for job in jobs}
    assert set(statuses.values()) == {VideoStatus.INDEXED}, statuses


def _wait_for_version_past(marks: DeferredMarks, version: int) -> None:
    deadline = time.monotonic() + 10
    while (marks.version() or 0) <= version and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_version_clock_stops_handing_out_a_version_it_could_not_refresh(states: VideoStates) -> None:
    clock = VersionClock(states.catalog, interval_s=0.02).start()
    deadline = time.monotonic() + 10
    while clock.version() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert clock.version() is not None
    clock.stop()  # no more lookups: the last one ages
    time.sleep(0.02 * (STALE_INTERVALS + 5))
    assert clock.version() is None  # the submit then reads the row itself


DELETE = IndexJob(op=JobOp.DELETE, bucket="videos", key="a.mp4", source=JobSource.EVENT)


def test_a_delete_marks_an_indexed_row_queued_but_not_an_absent_or_deleted_one(states: VideoStates) -> None:
    QueueingSink(Sink(states), states).submit(DELETE)
    assert states.read(DELETE.video_id) is None  # no row is created for a delete
    done = VideoRecord(DELETE.video_id, DELETE.uri, VideoStatus.INDEXED, version="e1", frames=2, fingerprint="fp")
    states.catalog.write(done, 0)
    QueueingSink(Sink(states), states).submit(DELETE)
    marked = states.read(DELETE.video_id)
    assert marked is not None and marked.status is VideoStatus.QUEUED
    gone = marked.evolve(status=VideoStatus.DELETED, frames=0, fingerprint=None)
    states.catalog.write(gone, marked.rev)
    QueueingSink(Sink(states), states).submit(DELETE)
    back = states.read(DELETE.video_id)
    assert back is not None and back.status is VideoStatus.DELETED and back.rev == marked.rev + 1


class NoVersionYet:
    def version(self) -> int | None:
        return None

    def mark(self, job: IndexJob, version: int) -> None:
        raise AssertionError("no version: nothing to mark from")


class ReadsNothing(Sink):
    def submit(self, job: IndexJob) -> str:
        self.seen_status.append("submitted")
        return "task-3"


def test_without_a_catalog_version_the_routers_sink_submits_unmarked_and_reads_nothing(states: VideoStates) -> None:
    """The router's marks (``read_first=False``) never hold up routing with a catalog read."""
    done = VideoRecord(DELETE.video_id, DELETE.uri, VideoStatus.INDEXED, version="e1", frames=2, fingerprint="fp")
    states.catalog.write(done, 0)
    reads: list[str] = []
    read = states.read

    def counting_read(video_id: str) -> VideoRecord | None:
        reads.append(video_id)
        return read(video_id)

    states.read = counting_read  # type: ignore[method-assign]
    sink = ReadsNothing(states)
    assert QueueingSink(sink, states, NoVersionYet(), read_first=False).submit(DELETE) == "task-3"
    assert reads == [] and sink.seen_status == ["submitted"]
    states.read = read  # type: ignore[method-assign]
    back = states.read(DELETE.video_id)
    assert back is not None and back.status is VideoStatus.INDEXED  # unmarked
