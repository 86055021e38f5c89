"""events/router.py: bucket events -> jobs, with a stand-in sink, channel, executor and clock (no broker)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import amqp.exceptions
import kombu.exceptions
import pika.exceptions
import pytest

from events.config import AmqpSettings, VideoFilterSettings
from events.jobs import IndexJob, JobOp, JobSource
from events.parked import ATTEMPTS_HEADER, REASON_HEADER
from events.records import EventDecodeError
from events.router import EventRouter, JobSink, describe
from storage.errors import TransientError
from tests.unit.events.test_records import minio_body, minio_record


def body_for(*keys: str) -> bytes:
    return minio_body(*(minio_record("s3:ObjectCreated:Put", key) for key in keys))


class ListSink:
    """Takes every job, except the first ``failures`` calls for each key named in ``flaky``."""

    def __init__(self, fail: bool = False, flaky: dict[str, int] | None = None) -> None:
        self.jobs: list[IndexJob] = []
        self.calls: list[str] = []
        self.fail = fail
        self.flaky = dict(flaky or {})
        self.threads: set[str] = set()

    def submit(self, job: IndexJob) -> str:
        self.calls.append(job.key)
        self.threads.add(threading.current_thread().name)
        if self.fail:
            raise TransientError("broker down")
        if self.flaky.get(job.key, 0) > 0:
            self.flaky[job.key] -= 1
            raise TransientError("broker down")
        self.jobs.append(job)
        return f"task-{len(self.jobs)}"


class BrokenSink:
    def submit(self, job: IndexJob) -> str:
        raise RuntimeError("bug in the sink")


def router(sink: JobSink, **amqp: Any) -> EventRouter:
    return EventRouter(AmqpSettings(**amqp), VideoFilterSettings(), sink, buckets=["videos"])


# -- routing: handle() -----------------------------------------------------------------------------------


def test_created_video_becomes_an_index_job() -> None:
    sink = ListSink()
    routed = router(sink).handle(minio_body(minio_record("s3:ObjectCreated:Put", "clips/a+b.mp4")))
    assert routed.submitted == 1
    (job,) = sink.jobs
    assert (job.op, job.bucket, job.key, job.source) == (JobOp.INDEX, "videos", "clips/a b.mp4", JobSource.EVENT)
    assert job.hint_version == "f1671feacb8bbf7b0397c6e9364e8c92"


@pytest.mark.parametrize(
    ("record", "hinted"),
    [
        (minio_record("s3:ObjectCreated:Put", "a.mp4"), True),
        # a version id fetches that version whether or not it is current: no check, so no hint
        (minio_record("s3:ObjectCreated:Put", "a.mp4", version_id="3b0c5d2e-9f41-4a6e-8d0a-1c2b3d4e5f60"), False),
        # no size to hold against the limit before the fetch, or no ETag to fetch on: a HEAD first
        (minio_record("s3:ObjectCreated:Put", "a.mp4", size=None), False),
        (minio_record("s3:ObjectCreated:Put", "a.mp4", etag=None), False),
    ],
)
def test_an_uploads_job_carries_the_etag_and_size_to_fetch_on_only_for_an_unversioned_object(
    record: dict[str, Any], hinted: bool
) -> None:
    sink = ListSink()
    router(sink).handle(minio_body(record))
    (job,) = sink.jobs
    want = ("f1671feacb8bbf7b0397c6e9364e8c92", 248_682) if hinted else (None, None)
    assert (job.hint_etag, job.hint_size) == want


def test_removed_object_becomes_a_delete_job_whatever_its_name() -> None:
    sink = ListSink()
    body = minio_body(minio_record("s3:ObjectRemoved:Delete", "notes.txt", size=None, etag=None, content_type=None))
    router(sink).handle(body)
    assert [j.op for j in sink.jobs] == [JobOp.DELETE]
    assert sink.jobs[0].hint_etag is None  # a delete's job HEADs


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


def test_sink_failure_propagates_so_the_message_is_tried_again_not_acked() -> None:
    with pytest.raises(TransientError):
        router(ListSink(fail=True)).handle(body_for("a.mp4"))


def test_a_record_with_a_wrong_field_type_raises_for_parking() -> None:
    record = minio_record("s3:ObjectCreated:Put", "a.mp4")
    record["s3"]["object"]["sequencer"] = 7
    body = minio_body(record)
    sink = ListSink()
    with pytest.raises(EventDecodeError) as caught:
        router(sink).handle(body)
    assert caught.value.raw == body
    assert sink.jobs == []


# -- deliveries: on_delivery() on the pika thread, submits on the executor, settle() acks ------------------


@dataclass(frozen=True)
class Method:
    delivery_tag: int
    redelivered: bool = False


@dataclass
class RecordingChannel:
    """Stands in for a pika channel: records what the router does with each delivery, and on which thread."""

    published: list[tuple[str, bytes, dict[str, Any]]] = field(default_factory=list)
    acked: list[int] = field(default_factory=list)
    nacked: list[tuple[int, bool]] = field(default_factory=list)
    threads: set[str] = field(default_factory=set)

    def basic_publish(
        self, exchange: str, routing_key: str, body: bytes, properties: Any, mandatory: bool = False
    ) -> None:
        assert exchange == "" and mandatory
        self.threads.add(threading.current_thread().name)
        self.published.append((routing_key, body, dict(properties.headers or {})))

    def basic_ack(self, delivery_tag: int) -> None:
        self.threads.add(threading.current_thread().name)
        self.acked.append(delivery_tag)

    def basic_nack(self, delivery_tag: int, requeue: bool = True) -> None:
        self.nacked.append((delivery_tag, requeue))


class ManualExecutor(concurrent.futures.Executor):
    """Holds each submitted call until the test runs it: a submit that takes as long as the test likes."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], object]] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.pending.append(lambda: fn(*args, **kwargs))
        return concurrent.futures.Future()

    def run_all(self) -> None:
        for _ in range(100):  # bounded: a call may submit more
            if not self.pending:
                return
            self.pending.pop(0)()
        raise AssertionError("calls kept coming")


class InlineExecutor(ManualExecutor):
    """Runs each call at once, on the caller's thread."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        fn(*args, **kwargs)
        return concurrent.futures.Future()


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def consumer(
    sink: JobSink, executor: concurrent.futures.Executor | None = None, clock: FakeClock | None = None, **amqp: Any
) -> EventRouter:
    settings = AmqpSettings(**{"retry_delay_s": 1.0, **amqp})
    return EventRouter(
        settings,
        VideoFilterSettings(),
        sink,
        buckets=["videos"],
        executor=executor or InlineExecutor(),
        clock=clock or FakeClock(),
    )


def deliver(r: EventRouter, channel: RecordingChannel, tag: int, body: bytes, redelivered: bool = False) -> None:
    r.on_delivery(channel, Method(tag, redelivered), None, body)


def test_a_routed_message_is_acked_only_after_its_jobs_are_confirmed() -> None:
    sink, executor, channel = ListSink(), ManualExecutor(), RecordingChannel()
    r = consumer(sink, executor)
    deliver(r, channel, 7, body_for("a.mp4"))
    r.settle(channel)
    assert channel.acked == [] and sink.jobs == []  # the submit has not run yet
    executor.run_all()
    assert channel.acked == []  # confirmed, but acks happen on the pika thread's settle
    r.settle(channel)
    assert channel.acked == [7] and channel.published == [] and channel.nacked == []
    assert len(sink.jobs) == 1 and r.stats["messages"] == 1


def test_submits_run_on_the_worker_and_acks_on_the_pika_thread() -> None:
    sink, channel = ListSink(), RecordingChannel()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="submitter") as pool:
        r = consumer(sink, pool)
        deliver(r, channel, 7, body_for("a.mp4"))
        deadline = time.monotonic() + 5
        while not channel.acked and time.monotonic() < deadline:
            r.settle(channel)
            time.sleep(0.01)
    assert channel.acked == [7]
    assert [t.startswith("submitter") for t in sink.threads] == [True]
    assert channel.threads == {threading.current_thread().name}


def test_an_undecodable_body_is_parked_with_its_reason_then_acked() -> None:
    channel = RecordingChannel()
    r = consumer(ListSink())
    deliver(r, channel, 7, b"\xffnot json")
    r.settle(channel)
    ((queue, body, headers),) = channel.published
    assert (queue, body) == (AmqpSettings().parked_queue, b"\xffnot json")
    assert headers[REASON_HEADER].startswith("not JSON") and headers[ATTEMPTS_HEADER] == 1
    assert channel.acked == [7] and channel.nacked == []
    assert r.stats["parked"] == 1


def test_a_message_routing_fails_on_unexpectedly_is_parked_and_acked() -> None:
    body, channel = body_for("a.mp4"), RecordingChannel()
    r = consumer(BrokenSink())
    deliver(r, channel, 7, body)
    r.settle(channel)
    ((queue, parked, headers),) = channel.published
    assert (queue, parked) == (AmqpSettings().parked_queue, body)
    assert headers[REASON_HEADER] == "unexpected RuntimeError: bug in the sink"
    assert channel.acked == [7] and channel.nacked == []


def test_a_long_reason_is_truncated() -> None:
    class LoudSink:
        def submit(self, job: IndexJob) -> str:
            raise ValueError("x" * 2000)

    channel = RecordingChannel()
    r = consumer(LoudSink())
    deliver(r, channel, 7, body_for("a.mp4"))
    r.settle(channel)
    ((_, _, headers),) = channel.published
    assert len(headers[REASON_HEADER]) == 500


def test_a_refused_message_waits_without_blocking_while_other_messages_flow() -> None:
    sink, clock, channel = ListSink(flaky={"flaky.mp4": 2}), FakeClock(), RecordingChannel()
    r = consumer(sink, clock=clock)
    started = time.monotonic()
    deliver(r, channel, 1, body_for("flaky.mp4"))
    r.settle(channel)
    assert channel.acked == [] and channel.nacked == [] and channel.published == []
    deliver(r, channel, 2, body_for("steady.mp4"))  # flows while the first one waits
    r.settle(channel)
    assert channel.acked == [2]
    clock.now = 0.99
    r.settle(channel)
    assert sink.calls == ["flaky.mp4", "steady.mp4"]  # not before its backoff
    clock.now = 1.0
    r.settle(channel)  # second try: refused again, next in 2 s
    clock.now = 3.0
    r.settle(channel)  # third try: taken
    r.settle(channel)
    assert channel.acked == [2, 1] and channel.published == []
    assert sink.calls == ["flaky.mp4", "steady.mp4", "flaky.mp4", "flaky.mp4"]
    assert [j.key for j in sink.jobs] == ["steady.mp4", "flaky.mp4"]
    assert r.stats["retried"] == 2
    assert time.monotonic() - started < 1.0  # the backoff is a deadline, never a sleep


def test_the_backoff_doubles_up_to_its_cap() -> None:
    sink, clock, channel = ListSink(fail=True), FakeClock(), RecordingChannel()
    tried_at: list[float] = []
    real_submit = sink.submit

    def timed(job: IndexJob) -> str:
        tried_at.append(clock.now)
        return real_submit(job)

    sink.submit = timed  # type: ignore[method-assign]
    r = consumer(sink, clock=clock, retry_delay_s=1.0, max_retry_delay_s=3.0, max_attempts=5)
    deliver(r, channel, 1, body_for("a.mp4"))
    for step in range(100):  # bounded: 10 s of fake time in 0.1 s steps
        clock.now = step / 10
        r.settle(channel)
    assert tried_at == [0.0, 1.0, 3.0, 6.0, 9.0]


def test_a_message_out_of_attempts_is_parked_with_its_reason_and_acked() -> None:
    sink, clock, channel = ListSink(fail=True), FakeClock(), RecordingChannel()
    r = consumer(sink, clock=clock, max_attempts=3)
    body = body_for("doomed.mp4")
    deliver(r, channel, 1, body)
    for step in range(20):
        clock.now = float(step)
        r.settle(channel)
    assert len(sink.calls) == 3
    ((queue, parked, headers),) = channel.published
    assert (queue, parked) == (AmqpSettings().parked_queue, body)
    assert headers[REASON_HEADER] == "gave up after 3 attempts: broker down"
    assert headers[ATTEMPTS_HEADER] == 3
    assert channel.acked == [1] and channel.nacked == []
    assert r.stats["retried"] == 2 and r.stats["parked"] == 1


def test_a_retry_resumes_after_the_jobs_already_confirmed() -> None:
    sink, clock, channel = ListSink(flaky={"b.mp4": 1}), FakeClock(), RecordingChannel()
    r = consumer(sink, clock=clock)
    deliver(r, channel, 1, body_for("a.mp4", "b.mp4"))
    r.settle(channel)
    clock.now = 1.0
    r.settle(channel)
    r.settle(channel)
    assert [j.key for j in sink.jobs] == ["a.mp4", "b.mp4"]  # a.mp4 once, not again with the retry
    assert channel.acked == [1]


def test_a_redelivery_after_a_reconnect_waits_for_the_submit_in_progress() -> None:
    sink, executor = ListSink(), ManualExecutor()
    old, new = RecordingChannel(), RecordingChannel()
    r = consumer(sink, executor)
    body = body_for("slow.mp4")
    deliver(r, old, 7, body)
    r.detach()  # the connection drops while the submit runs
    deliver(r, new, 1, body, redelivered=True)
    assert len(executor.pending) == 1  # the redelivery started no second submit
    executor.run_all()
    r.settle(new)
    assert len(sink.jobs) == 1
    assert new.acked == [1] and old.acked == []
    assert r.stats["redelivered_in_progress"] == 1


def test_a_redelivered_message_whose_ack_was_lost_is_acked_without_a_second_submit() -> None:
    sink, old, new = ListSink(), RecordingChannel(), RecordingChannel()
    r = consumer(sink)
    body = body_for("a.mp4")
    deliver(r, old, 7, body)
    r.settle(old)
    assert old.acked == [7]
    r.detach()  # ... and that ack never reached the broker
    deliver(r, new, 1, body, redelivered=True)
    assert new.acked == [1] and len(sink.jobs) == 1
    assert r.stats["redelivered_settled"] == 1


def test_the_same_body_published_anew_after_the_copy_window_is_routed_again() -> None:
    sink, channel, clock = ListSink(), RecordingChannel(), FakeClock()
    r = consumer(sink, clock=clock, copy_window_s=30)
    body = body_for("a.mp4")
    deliver(r, channel, 1, body)
    r.settle(channel)
    clock.now += 30.0
    deliver(r, channel, 2, body)  # not a redelivery: e.g. an event replayed
    r.settle(channel)
    assert len(sink.jobs) == 2 and channel.acked == [1, 2]
    assert r.stats["copies"] == 0


def test_the_second_copy_of_a_dual_delivered_event_is_acked_without_a_second_submit() -> None:
    """MinIO's ``dual`` delivery publishes each event twice (at once, then from its store on the 3 s tick),
    byte for byte the same: the later copy, within ``copy_window_s`` of the first's routing, is dropped."""
    sink, channel, clock = ListSink(), RecordingChannel(), FakeClock()
    r = consumer(sink, clock=clock, copy_window_s=30)
    body = body_for("a.mp4")
    deliver(r, channel, 1, body)
    r.settle(channel)
    clock.now += 3.2
    deliver(r, channel, 2, body)
    r.settle(channel)
    assert len(sink.jobs) == 1 and channel.acked == [1, 2]
    assert r.stats["copies"] == 1


def test_a_parked_message_published_again_at_once_is_routed_again() -> None:
    """Only a message whose jobs were all submitted makes a later copy redundant; a parked one's does not."""
    sink, channel, clock = ListSink(fail=True), RecordingChannel(), FakeClock()
    r = consumer(sink, clock=clock, max_attempts=1, copy_window_s=30)
    body = body_for("a.mp4")
    deliver(r, channel, 1, body)
    r.settle(channel)  # refused once: parked
    assert r.stats["parked"] == 1
    sink.fail = False
    deliver(r, channel, 2, body)
    r.settle(channel)
    assert len(sink.jobs) == 1 and r.stats["copies"] == 0


def test_attempts_are_counted_across_a_reconnect() -> None:
    sink, clock = ListSink(fail=True), FakeClock()
    old, new = RecordingChannel(), RecordingChannel()
    r = consumer(sink, clock=clock, max_attempts=2)
    body = body_for("doomed.mp4")
    deliver(r, old, 7, body)
    r.settle(old)  # first try refused, next one due at 1.0
    r.detach()
    clock.now = 5.0
    r.settle(new)
    assert len(sink.calls) == 1  # no delivery to answer for: no retry
    deliver(r, new, 1, body, redelivered=True)
    r.settle(new)  # second and last try
    r.settle(new)
    assert len(sink.calls) == 2
    ((_, _, headers),) = new.published
    assert headers[REASON_HEADER] == "gave up after 2 attempts: broker down"
    assert new.acked == [1] and old.acked == []


def test_the_memory_of_settled_messages_is_bounded() -> None:
    """Beyond the copy window (here none) the memory holds ``redelivery_memory`` digests."""
    sink, channel = ListSink(), RecordingChannel()
    r = consumer(sink, redelivery_memory=2, copy_window_s=0)
    bodies = [body_for(f"{i}.mp4") for i in range(3)]
    for tag, body in enumerate(bodies):
        deliver(r, channel, tag, body)
        r.settle(channel)
    deliver(r, channel, 10, bodies[2], redelivered=True)  # remembered
    deliver(r, channel, 11, bodies[0], redelivered=True)  # forgotten: routed again, as a hint
    r.settle(channel)
    assert [j.key for j in sink.jobs] == ["0.mp4", "1.mp4", "2.mp4", "0.mp4"]
    assert channel.acked == [0, 1, 2, 10, 11]


def test_a_broker_close_is_described_by_its_reply_not_just_its_type() -> None:
    closed = pika.exceptions.ConnectionClosedByBroker(320, "CONNECTION_FORCED - shutdown")
    assert describe(closed) == "ConnectionClosedByBroker 320: CONNECTION_FORCED - shutdown"
    channel_closed = pika.exceptions.ChannelClosedByBroker(404, "NOT_FOUND - no queue 'vidx.bucket-events'")
    assert describe(channel_closed) == "ChannelClosedByBroker 404: NOT_FOUND - no queue 'vidx.bucket-events'"
    assert describe(pika.exceptions.AMQPConnectionError("amqp://guest:secret@host")) == "AMQPConnectionError"


# -- the sink the router submits through (pipeline/jobs/taskqueue.py) -----------------------------------------


class RaisingAdapter:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def publish(self, task_name: str, args: list[Any]) -> str:
        raise self.exc


@pytest.mark.parametrize(
    "exc",
    [
        amqp.exceptions.MessageNacked(),
        TimeoutError("timed out"),  # socket.timeout
        kombu.exceptions.OperationalError("[Errno 111] amqp://vidx:s3cret@broker:5672//"),
        amqp.exceptions.RecoverableConnectionError("amqp://vidx:s3cret@broker:5672//"),
        amqp.exceptions.NotFound("NOT_FOUND - no exchange"),
        ConnectionResetError(104, "reset by amqp://vidx:s3cret@broker"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_every_broker_error_on_submit_is_transient_and_never_quotes_the_url(
    exc: BaseException, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.jobs import taskqueue
    from pipeline.settings import Settings

    monkeypatch.setattr(taskqueue, "instantiate_adapter_from_config", lambda config: RaisingAdapter(exc))
    sink = taskqueue.CeleryJobSink(Settings(state_dir=tmp_path))
    with pytest.raises(TransientError) as caught:
        sink.submit(IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.EVENT))
    assert caught.value.__cause__ is exc
    assert "s3cret" not in str(caught.value) and "amqp://" not in str(caught.value)


def test_a_bug_on_submit_is_not_mistaken_for_a_broker_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.jobs import taskqueue
    from pipeline.settings import Settings

    monkeypatch.setattr(taskqueue, "instantiate_adapter_from_config", lambda config: RaisingAdapter(KeyError("x")))
    sink = taskqueue.CeleryJobSink(Settings(state_dir=tmp_path))
    with pytest.raises(KeyError):
        sink.submit(IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.EVENT))


class SentOnly:
    """What Celery's ``send_task`` returns, where any read of the result backend fails the test."""

    id = "task-1"

    @property
    def status(self) -> str:
        raise AssertionError("the submit read the task's status from the result backend")

    @property
    def result(self) -> Any:
        raise AssertionError("the submit read the task's result from the result backend")


def test_a_submit_reads_nothing_back_from_the_result_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.jobs import taskqueue
    from pipeline.settings import Settings

    settings = Settings(state_dir=tmp_path)
    sink = taskqueue.CeleryJobSink(settings)
    sent: list[dict[str, Any]] = []

    def send_task(name: str, **options: Any) -> SentOnly:
        sent.append({"name": name, **options})
        return SentOnly()

    monkeypatch.setattr(sink._adapter._app, "send_task", send_task)
    job = IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.API)
    assert sink.submit(job) == "task-1"
    assert [(s["name"], s["queue"], s["ignore_result"]) for s in sent] == [
        (taskqueue.INDEX_TASK, settings.serve.index_queue, True)
    ]
    assert sent[0]["args"] == [job.model_dump(mode="json")]


def test_a_copy_arriving_while_the_first_is_submitted_is_counted_as_a_copy() -> None:
    sink, executor, channel = ListSink(), ManualExecutor(), RecordingChannel()
    r = consumer(sink, executor)
    body = body_for("a.mp4")
    deliver(r, channel, 1, body)
    deliver(r, channel, 2, body)  # the other copy, not a redelivery, while the submit runs
    executor.run_all()
    r.settle(channel)
    assert len(sink.jobs) == 1 and sorted(channel.acked) == [1, 2]
    assert r.stats["copies"] == 1 and r.stats["redelivered_in_progress"] == 0


def test_digests_within_the_copy_window_outlive_the_redelivery_memory() -> None:
    """Faster than ``redelivery_memory`` events per ``copy_window_s``: the later copy of the oldest is
    still known; once the window has passed the memory shrinks back to its bound."""
    sink, channel, clock = ListSink(), RecordingChannel(), FakeClock()
    r = consumer(sink, clock=clock, redelivery_memory=10, copy_window_s=30)
    for i in range(25):
        deliver(r, channel, i + 1, body_for(f"v{i}.mp4"))
        r.settle(channel)
    clock.now += 3.0
    deliver(r, channel, 100, body_for("v0.mp4"))  # the store's copy of the first
    r.settle(channel)
    assert len(sink.jobs) == 25 and r.stats["copies"] == 1
    clock.now += 30.0
    deliver(r, channel, 101, body_for("new.mp4"))
    r.settle(channel)
    deliver(r, channel, 102, body_for("v1.mp4"))  # long forgotten: routed again (a replay)
    r.settle(channel)
    assert len(sink.jobs) == 27
