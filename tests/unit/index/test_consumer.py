"""The consumer's decision per task: done, retry, or dead letter (with the catalog saying why)."""

from __future__ import annotations

import threading

import pytest

from events.deadletters import DeadLetter, FailureKind
from events.jobs import IndexJob, JobOp, JobSource
from pipeline.index.consumer import IndexTaskHandler, TaskContext
from pipeline.index.result import ConsumerKilled, JobResult, Outcome
from storage.errors import CorruptVideo, TransientError

JOB = IndexJob(op=JobOp.INDEX, bucket="videos", key="a/b.mp4", source=JobSource.EVENT)


class Runner:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.failures: list[str] = []
        self.runs = 0
        self.task_ids: list[str | None] = []
        self.record_error: Exception | None = None

    def run(
        self, job: IndexJob, task_id: str | None = None, attempt: int = 0, *, redelivered: bool = False
    ) -> JobResult:
        self.runs += 1
        self.task_ids.append(task_id)
        if self.error is not None:
            raise self.error
        return JobResult(job.video_id, Outcome.INDEXED, frames=7)

    def record_failure(self, job: IndexJob, reason: str, version: str | None = None) -> None:
        if self.record_error is not None:
            raise self.record_error
        self.failures.append(reason)


class Letters:
    def __init__(self) -> None:
        self.letters: list[DeadLetter] = []

    def publish(self, letter: DeadLetter) -> None:
        self.letters.append(letter)


def handler(runner: Runner, letters: Letters) -> IndexTaskHandler:
    return IndexTaskHandler(runner, letters, max_retries=3)


def test_a_good_job_is_done_without_a_dead_letter() -> None:
    runner, letters = Runner(), Letters()
    out = handler(runner, letters).handle(JOB.model_dump(mode="json"), TaskContext("t1", 0))
    assert out == {"video_id": JOB.video_id, "outcome": "indexed", "frames": 7, "stages": {}}
    assert letters.letters == []


def test_a_permanent_error_is_dead_lettered_at_once_and_not_retried() -> None:
    runner, letters = Runner(CorruptVideo("moov atom not found")), Letters()
    out = handler(runner, letters).handle(JOB.model_dump(mode="json"), TaskContext("t1", 0))
    assert out["outcome"] == "failed" and out["reason"] == "decode error: moov atom not found"
    [letter] = letters.letters
    assert (letter.id, letter.kind, letter.attempts, letter.uri) == ("t1", FailureKind.PERMANENT, 1, JOB.uri)
    assert letter.reason == "decode error: moov atom not found"
    assert runner.runs == 1 and runner.failures == ["decode error: moov atom not found"]


@pytest.mark.parametrize("retries", [0, 1, 2])
def test_a_transient_error_is_raised_for_retry_while_the_budget_lasts(retries: int) -> None:
    runner, letters = Runner(TransientError("HEAD: object store answered 503")), Letters()
    with pytest.raises(TransientError):
        handler(runner, letters).handle(JOB.model_dump(mode="json"), TaskContext("t1", retries))
    assert letters.letters == [] and runner.failures == []


def test_the_last_attempt_records_the_failure_and_dead_letters_it() -> None:
    runner, letters = Runner(TransientError("HEAD: object store answered 503")), Letters()
    out = handler(runner, letters).handle(JOB.model_dump(mode="json"), TaskContext("t1", 3))
    reason = "gave up after 4 attempts: HEAD: object store answered 503"
    assert out["reason"] == reason and runner.failures == [reason]
    [letter] = letters.letters
    assert (letter.kind, letter.attempts, letter.job) == (FailureKind.EXHAUSTED, 4, JOB)


def test_an_unexpected_error_is_named_by_type_only() -> None:
    runner, letters = Runner(KeyError("secret-looking detail")), Letters()
    handler(runner, letters).handle(JOB.model_dump(mode="json"), TaskContext("t1", 3))
    assert runner.failures == ["gave up after 4 attempts: internal error (KeyError)"]


def test_a_malformed_job_is_dead_lettered_with_its_raw_payload() -> None:
    runner, letters = Runner(), Letters()
    out = handler(runner, letters).handle({"op": "index", "bucket": 3}, TaskContext("t9", 0))
    assert out["outcome"] == "failed" and out["reason"].startswith("malformed job (")
    [letter] = letters.letters
    assert letter.kind is FailureKind.MALFORMED and letter.job is None and "bucket" in (letter.raw_job or "")
    assert runner.runs == 0


def test_when_the_dead_letter_cant_be_stored_the_task_is_retried() -> None:
    class Down(Letters):
        def publish(self, letter: DeadLetter) -> None:
            raise TransientError("dead letter not stored: AMQPConnectionError")

    with pytest.raises(TransientError):
        handler(Runner(CorruptVideo("bad")), Down()).handle(JOB.model_dump(mode="json"), TaskContext("t1", 0))


def test_a_redelivered_task_just_runs_again_uncharged() -> None:
    runner, letters = Runner(), Letters()
    out = handler(runner, letters).handle(JOB.model_dump(mode="json"), TaskContext("t1", 0, redelivered=True))
    assert out["outcome"] == "indexed" and runner.runs == 1 and runner.task_ids == ["t1"] and not letters.letters


def test_a_video_that_kills_its_consumer_every_time_ends_dead_lettered_as_a_crash_loop() -> None:
    runner, letters = Runner(ConsumerKilled("the consumer died 3 times while indexing this video")), Letters()
    out = handler(runner, letters).handle(JOB.model_dump(mode="json"), TaskContext("t1", 0, redelivered=True))
    assert out["outcome"] == "failed" and out["reason"].startswith("the consumer died 3 times")
    assert [d.kind for d in letters.letters] == [FailureKind.CRASH_LOOP] and runner.failures == [out["reason"]]


def test_a_failure_the_catalog_cant_record_is_still_dead_lettered() -> None:
    runner, letters = Runner(TransientError("S3 down")), Letters()
    runner.record_error = TransientError("S3 down")
    out = handler(runner, letters).handle(JOB.model_dump(mode="json"), TaskContext("t1", 3))
    assert out["outcome"] == "failed" and [d.kind for d in letters.letters] == [FailureKind.EXHAUSTED]


class HeldRunner(Runner):
    """A runner whose job runs until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self.release = threading.Event()

    def run(
        self, job: IndexJob, task_id: str | None = None, attempt: int = 0, *, redelivered: bool = False
    ) -> JobResult:
        self.started.set()
        assert self.release.wait(30)
        return super().run(job, task_id, attempt)


def test_drain_waits_for_the_running_task_while_it_runs_on_another_thread() -> None:
    runner, letters = HeldRunner(), Letters()
    h = handler(runner, letters)
    outcome: list[dict[str, object]] = []
    worker = threading.Thread(
        target=lambda: outcome.append(h.handle(JOB.model_dump(mode="json"), TaskContext("t1", 0)))
    )
    worker.start()
    assert runner.started.wait(30)
    assert h.drain(0.05) == 1  # still running: the drain gives up at its deadline
    threading.Timer(0.2, runner.release.set).start()
    assert h.drain(30) == 0  # ends as soon as the task does
    worker.join(30)
    assert outcome and outcome[0]["outcome"] == "indexed"
    assert h.drain(0) == 0


def test_a_job_for_a_bucket_that_is_not_configured_is_refused_with_its_reason_and_never_run() -> None:
    runner, letters = Runner(), Letters()
    guarded = IndexTaskHandler(runner, letters, max_retries=3, buckets=["videos"])
    foreign = IndexJob(op=JobOp.INDEX, bucket="payroll", key="2026/q3.mp4", source=JobSource.API)
    out = guarded.handle(foreign.model_dump(mode="json"), TaskContext("t9", 0))
    reason = "bucket 'payroll' is not one of the configured buckets (VIDX_S3__BUCKETS)"
    assert out == {"video_id": foreign.video_id, "outcome": "failed", "reason": reason}
    [letter] = letters.letters
    assert (letter.kind, letter.reason, letter.uri) == (FailureKind.PERMANENT, reason, foreign.uri)
    assert runner.runs == 0 and runner.failures == []  # nothing read, nothing written to the catalog
    assert guarded.handle(JOB.model_dump(mode="json"), TaskContext("t1", 0))["outcome"] == "indexed"
