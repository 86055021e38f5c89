"""The per-video transitions and the queueing sink over a real local catalog."""

from __future__ import annotations

from pathlib import Path

import pytest

from events.jobs import IndexJob, JobOp, JobSource
from pipeline.settings import Settings
from pipeline.videostate import QueueingSink, VideoStates
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
