"""events/router.py: bucket events -> jobs, with a stand-in sink (no broker)."""

from __future__ import annotations

import pytest

from events.config import AmqpSettings, VideoFilterSettings
from events.records import EventDecodeError
from events.router import EventRouter
from pipeline.errors import TransientError
from pipeline.jobs import IndexJob, JobOp, JobSource
from tests.unit.test_records import minio_body, minio_record


class ListSink:
    def __init__(self, fail: bool = False) -> None:
        self.jobs: list[IndexJob] = []
        self.fail = fail

    def submit(self, job: IndexJob) -> str:
        if self.fail:
            raise TransientError("broker down")
        self.jobs.append(job)
        return f"task-{len(self.jobs)}"


def router(sink: ListSink, queued: list[IndexJob] | None = None) -> EventRouter:
    on_queued = queued.append if queued is not None else None
    return EventRouter(AmqpSettings(), VideoFilterSettings(), sink, buckets=["videos"], on_queued=on_queued)


def test_created_video_becomes_an_index_job_and_is_marked_queued() -> None:
    sink, queued = ListSink(), []
    routed = router(sink, queued).handle(minio_body(minio_record("s3:ObjectCreated:Put", "clips/a+b.mp4")))
    assert routed.submitted == 1
    (job,) = sink.jobs
    assert (job.op, job.bucket, job.key, job.source) == (JobOp.INDEX, "videos", "clips/a b.mp4", JobSource.EVENT)
    assert job.hint_version == "f1671feacb8bbf7b0397c6e9364e8c92"
    assert queued == [job]


def test_removed_object_becomes_a_delete_job_whatever_its_name() -> None:
    sink = ListSink()
    body = minio_body(minio_record("s3:ObjectRemoved:Delete", "notes.txt", size=None, etag=None, content_type=None))
    router(sink).handle(body)
    assert [j.op for j in sink.jobs] == [JobOp.DELETE]


@pytest.mark.parametrize(
    ("key", "content_type", "is_video"),
    [
        ("a.MP4", "application/octet-stream", True),
        ("a.webm", None, True),
        ("no-extension", "video/quicktime", True),
        ("readme.txt", "text/plain", False),
        ("photo.jpg", "image/jpeg", False),
    ],
)
def test_videos_are_recognised_by_extension_or_content_type(key: str, content_type: str | None, is_video: bool) -> None:
    sink = ListSink()
    r = router(sink)
    r.handle(minio_body(minio_record("s3:ObjectCreated:Put", key, content_type=content_type)))
    assert len(sink.jobs) == int(is_video)
    assert r.stats["ignored_not_video"] == int(not is_video)


def test_foreign_bucket_is_ignored_and_counted() -> None:
    sink = ListSink()
    r = router(sink)
    r.handle(minio_body(minio_record("s3:ObjectCreated:Put", "a.mp4", bucket="elsewhere")))
    assert sink.jobs == [] and r.stats["ignored_foreign_bucket"] == 1


def test_undecodable_body_raises_for_parking_with_its_raw_bytes() -> None:
    with pytest.raises(EventDecodeError) as caught:
        router(ListSink()).handle(b"\xffnot json")
    assert caught.value.raw == b"\xffnot json"


def test_sink_failure_propagates_so_the_message_is_requeued_not_acked() -> None:
    with pytest.raises(TransientError):
        router(ListSink(fail=True)).handle(minio_body(minio_record("s3:ObjectCreated:Put", "a.mp4")))


def test_a_failing_catalog_hint_does_not_stop_the_job() -> None:
    sink = ListSink()

    def broken(_: IndexJob) -> None:
        raise OSError("catalog unreachable")

    r = EventRouter(AmqpSettings(), VideoFilterSettings(), sink, buckets=["videos"], on_queued=broken)
    r.handle(minio_body(minio_record("s3:ObjectCreated:Put", "a.mp4")))
    assert len(sink.jobs) == 1
