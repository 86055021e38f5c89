"""Dead letters are read back whichever way they reached the queue; listing them changes nothing and
a replay removes only what it resubmitted."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from events.deadletters import DeadLetter, DeadLetterQueue, FailureKind, decode_dead_letter
from events.jobs import IndexJob, JobOp, JobSource
from storage.errors import TransientError
from tests.unit.events.test_parked import FakeBroker, patch_broker

JOB = IndexJob(op=JobOp.INDEX, bucket="videos", key="dir/clip 1.mp4", source=JobSource.EVENT, hint_version="e1")


def test_our_letters_round_trip() -> None:
    letter = DeadLetter(id="t1", kind=FailureKind.PERMANENT, reason="not a video: no video stream", attempts=1, job=JOB)
    back = decode_dead_letter(letter.model_dump_json().encode(), {})
    assert back == letter
    assert back.summary()["uri"] == "s3://videos/dir/clip 1.mp4"


def test_a_task_moved_by_rays_adapter_is_read_with_its_job() -> None:
    # What CeleryTaskProcessorAdapter._handle_task_failure sends: (task id, exception text,
    # str(args), str(kwargs), traceback) as the args of a task message.
    args = [JOB.model_dump(mode="json")]
    body = json.dumps([["t7", "boom", str(args), "{}", "Traceback ..."], {}, {}]).encode()
    letter = decode_dead_letter(body, {"task": "index_video", "id": "x", "retries": 0})
    assert (letter.id, letter.kind, letter.reason, letter.job) == ("t7", FailureKind.EXHAUSTED, "boom", JOB)


def test_a_task_with_an_unreadable_job_keeps_the_raw_text() -> None:
    body = json.dumps([["t8", "boom", "[<object at 0x1>]", "{}", ""], {}, {}]).encode()
    letter = decode_dead_letter(body, {"task": "index_video"})
    assert letter.kind is FailureKind.MALFORMED and letter.job is None and letter.raw_job == "[<object at 0x1>]"


def test_a_task_the_broker_dead_lettered_at_its_delivery_limit_is_read_with_its_job_and_why() -> None:
    # A quorum index queue's backstop: the task message as published, with the broker's x-death.
    body = json.dumps([[JOB.model_dump(mode="json")], {}, {}]).encode()
    died = datetime(2026, 12, 3, 12, 0, 0)  # as pika reads an AMQP timestamp: naive UTC
    headers = {
        "task": "index_video",
        "id": "t9",
        "x-delivery-count": 50,
        "x-death": [{"reason": b"delivery_limit", "queue": b"vidx.index", "count": 1, "time": died}],
    }
    letter = decode_dead_letter(body, headers)
    assert (letter.id, letter.kind, letter.job, letter.attempts) == ("t9", FailureKind.DELIVERY_LIMIT, JOB, 50)
    assert letter.reason == "dead-lettered by the broker (delivery_limit) from vidx.index"
    assert letter.failed_at == died.replace(tzinfo=UTC)


def test_a_task_a_consumer_rejected_is_listed_but_never_replayed() -> None:
    # Celery rejects an unknown or invalid task without requeueing it: the quorum index queue's
    # dead-letter target gets it too, while Ray's adapter already copied it to the unprocessable queue.
    body = json.dumps([[JOB.model_dump(mode="json")], {}, {}]).encode()
    headers = {"task": "index_video", "id": "t10", "x-death": [{"reason": b"rejected", "queue": b"vidx.index"}]}
    letter = decode_dead_letter(body, headers)
    assert (letter.kind, letter.job) == (FailureKind.MALFORMED, None) and letter.raw_job
    assert "(rejected)" in letter.reason and "not replayed" in letter.reason


@pytest.mark.parametrize("body", [b"not json", b'{"id": 3}', b"[]"])
def test_anything_else_is_an_error_naming_the_problem(body: bytes) -> None:
    with pytest.raises(ValueError):
        decode_dead_letter(body, {})


# -- the queue, over the browse helper it shares with the parked queue (stand-in broker) ------------------


class ListSink:
    def __init__(self, fail: bool = False) -> None:
        self.jobs: list[IndexJob] = []
        self.fail = fail

    def submit(self, job: IndexJob) -> str:
        if self.fail:
            raise TransientError("broker down")
        self.jobs.append(job)
        return f"task-{len(self.jobs)}"


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch) -> FakeBroker:
    return patch_broker(monkeypatch)


def put_letters(broker: FakeBroker, *letters: DeadLetter) -> None:
    for letter in letters:
        broker.queues.setdefault("failed", []).append(({}, letter.model_dump_json().encode()))


LETTERS = [
    DeadLetter(id="t1", kind=FailureKind.PERMANENT, reason="not a video", attempts=1, job=JOB),
    DeadLetter(id="t2", kind=FailureKind.EXHAUSTED, reason="gave up", attempts=4, job=JOB),
]


def test_listing_dead_letters_leaves_the_queue_as_it_was(broker: FakeBroker) -> None:
    put_letters(broker, *LETTERS)
    broker.queues["failed"].append(({}, b"garbage"))
    letters = DeadLetterQueue("amqp://guest:guest@broker/", "failed").list()
    assert [(d.id, d.kind) for d in letters] == [
        ("t1", FailureKind.PERMANENT),
        ("t2", FailureKind.EXHAUSTED),
        ("raw-3", FailureKind.MALFORMED),
    ]
    assert len(broker.queues["failed"]) == 3


def test_replay_acks_only_the_letters_whose_jobs_were_confirmed(broker: FakeBroker) -> None:
    put_letters(broker, *LETTERS)
    sink = ListSink()
    report = DeadLetterQueue("amqp://guest:guest@broker/", "failed").replay(sink, ["t2"])
    assert [d.id for d in report.replayed] == ["t2"] and report.remaining == 1
    assert [j.source for j in sink.jobs] == [JobSource.REPLAY]
    assert [DeadLetter.model_validate_json(b).id for b in broker.bodies("failed")] == ["t1"]


def test_replay_all_keeps_the_letters_without_a_readable_job(broker: FakeBroker) -> None:
    put_letters(broker, *LETTERS)
    broker.queues["failed"].append(({}, b"garbage"))
    sink = ListSink()
    report = DeadLetterQueue("amqp://guest:guest@broker/", "failed").replay(sink)
    assert [d.id for d in report.replayed] == ["t1", "t2"] and report.remaining == 1
    assert len(sink.jobs) == 2 and broker.bodies("failed") == [b"garbage"]


def test_a_refused_replay_keeps_every_letter(broker: FakeBroker) -> None:
    put_letters(broker, *LETTERS)
    with pytest.raises(TransientError):
        DeadLetterQueue("amqp://guest:guest@broker/", "failed").replay(ListSink(fail=True))
    assert len(broker.queues["failed"]) == 2
