"""events/router.py: bucket events -> jobs, with a stand-in sink (no broker)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pika.exceptions
import pytest

from events.config import AmqpSettings, VideoFilterSettings
from events.jobs import IndexJob, JobOp, JobSource
from events.records import EventDecodeError
from events.router import EventRouter, JobSink, _describe
from storage.errors import TransientError
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


def test_a_record_with_a_wrong_field_type_raises_for_parking() -> None:
    record = minio_record("s3:ObjectCreated:Put", "a.mp4")
    record["s3"]["object"]["sequencer"] = 7
    body = minio_body(record)
    sink = ListSink()
    with pytest.raises(EventDecodeError) as caught:
        router(sink).handle(body)
    assert caught.value.raw == body
    assert sink.jobs == []


@dataclass(frozen=True)
class Method:
    delivery_tag: int


@dataclass
class RecordingChannel:
    """Stands in for a pika channel: records what the router does with each delivery."""

    published: list[tuple[str, bytes, dict[str, Any]]] = field(default_factory=list)
    acked: list[int] = field(default_factory=list)
    nacked: list[tuple[int, bool]] = field(default_factory=list)

    def basic_publish(self, exchange: str, routing_key: str, body: bytes, properties: Any) -> None:
        assert exchange == ""
        self.published.append((routing_key, body, dict(properties.headers or {})))

    def basic_ack(self, delivery_tag: int) -> None:
        self.acked.append(delivery_tag)

    def basic_nack(self, delivery_tag: int, requeue: bool = True) -> None:
        self.nacked.append((delivery_tag, requeue))


class BrokenSink:
    def submit(self, job: IndexJob) -> str:
        raise RuntimeError("bug in the sink")


def deliver(sink: JobSink, body: bytes) -> tuple[EventRouter, RecordingChannel]:
    amqp = AmqpSettings(reconnect_delay_s=0.01)
    r = EventRouter(amqp, VideoFilterSettings(), sink, buckets=["videos"])
    channel = RecordingChannel()
    r._on_message(channel, Method(delivery_tag=7), body)
    return r, channel


def test_on_message_parks_an_undecodable_body_and_acks_it() -> None:
    r, channel = deliver(ListSink(), b"\xffnot json")
    ((queue, body, headers),) = channel.published
    assert (queue, body) == (AmqpSettings().parked_queue, b"\xffnot json")
    assert headers["x-vidx-reason"].startswith("not JSON")
    assert channel.acked == [7] and channel.nacked == []
    assert r.stats["parked"] == 1


def test_on_message_parks_and_acks_when_routing_fails_unexpectedly() -> None:
    body = minio_body(minio_record("s3:ObjectCreated:Put", "a.mp4"))
    r, channel = deliver(BrokenSink(), body)
    ((queue, parked, headers),) = channel.published
    assert (queue, parked) == (AmqpSettings().parked_queue, body)
    assert headers["x-vidx-reason"] == "unexpected RuntimeError: bug in the sink"
    assert channel.acked == [7] and channel.nacked == []
    assert r.stats["parked"] == 1


def test_on_message_truncates_a_long_reason() -> None:
    class LoudSink:
        def submit(self, job: IndexJob) -> str:
            raise ValueError("x" * 2000)

    _, channel = deliver(LoudSink(), minio_body(minio_record("s3:ObjectCreated:Put", "a.mp4")))
    ((_, _, headers),) = channel.published
    assert len(headers["x-vidx-reason"]) == 500


def test_on_message_requeues_when_the_task_queue_refuses() -> None:
    body = minio_body(minio_record("s3:ObjectCreated:Put", "a.mp4"))
    r, channel = deliver(ListSink(fail=True), body)
    assert channel.nacked == [(7, True)]
    assert channel.published == [] and channel.acked == []
    assert r.stats["requeued"] == 1 and r.stats["parked"] == 0


def test_on_message_acks_a_routed_message() -> None:
    sink = ListSink()
    _, channel = deliver(sink, json.dumps({"Records": [minio_record("s3:ObjectCreated:Put", "a.mp4")]}).encode())
    assert channel.acked == [7] and channel.published == [] and channel.nacked == []
    assert len(sink.jobs) == 1


def test_a_broker_close_is_described_by_its_reply_not_just_its_type() -> None:
    closed = pika.exceptions.ConnectionClosedByBroker(320, "CONNECTION_FORCED - shutdown")
    assert _describe(closed) == "ConnectionClosedByBroker 320: CONNECTION_FORCED - shutdown"
    channel_closed = pika.exceptions.ChannelClosedByBroker(404, "NOT_FOUND - no queue 'vidx.bucket-events'")
    assert _describe(channel_closed) == "ChannelClosedByBroker 404: NOT_FOUND - no queue 'vidx.bucket-events'"
    assert _describe(pika.exceptions.AMQPConnectionError("amqp://guest:secret@host")) == "AMQPConnectionError"
