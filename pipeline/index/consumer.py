"""What the IndexConsumer does with one task, without Ray or Celery: run the job, and decide between
done, retry and dead letter.

    permanent error (not a video, corrupt, over a limit, malformed job)
        -> the catalog says ``failed`` with the reason, a dead letter is stored, the task completes
    transient error (S3, broker, encoder) or an unexpected one
        -> re-raised: Celery retries with exponential backoff (``serve.max_retries`` times, at most
           60 s apart); on the last attempt the catalog says ``failed`` and a dead letter is stored
    a redelivered task (a dropped connection, a broker restart, a consumer that died)
        -> just run again: a redelivery is not a failed attempt. Only a start whose consumer died
           while holding the video is charged (the started-marker in the catalog, see
           ``pipeline.index.plan.count_crashes``); after ``serve.max_crashes`` of those the video is failed and
           dead-lettered, so a video that kills its consumer every time does not loop.

A task is acknowledged only after this returns (acks_late), so a dead letter is stored before the
task leaves the queue; a crash in between stores it twice, and the list shows it once (same id).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import ValidationError

from events.deadletters import DeadLetter, FailureKind
from events.jobs import IndexJob, JobOp, JobSink, JobSource
from pipeline.failures import FailureReason, failure_reason
from pipeline.index.result import ConsumerKilled, JobResult
from pipeline.metrics import Metrics
from storage.errors import PermanentError, TransientError, VidxError

log = logging.getLogger(__name__)


class JobRunner(Protocol):
    def run(
        self, job: IndexJob, task_id: str | None = None, attempt: int = 0, *, redelivered: bool = False
    ) -> JobResult: ...

    def record_failure(self, job: IndexJob, reason: str, version: str | None = None) -> None: ...


class DeadLetterSink(Protocol):
    def publish(self, letter: DeadLetter) -> None: ...


@dataclass(frozen=True, slots=True)
class TaskContext:
    """What Celery knows about the running task."""

    task_id: str
    #: Retries so far (0 on the first attempt).
    retries: int
    #: The broker delivered this message before and it was never acknowledged (the job claims the
    #: video at once; whether a consumer died with it is for the started-marker to tell).
    redelivered: bool = False


class IndexTaskHandler:
    """Runs index tasks; ``max_retries`` is the task queue's retry budget; ``metrics`` counts each
    task's outcome, each failure's reason class and each dead letter."""

    def __init__(
        self,
        runner: JobRunner,
        dead_letters: DeadLetterSink,
        max_retries: int,
        metrics: Metrics | None = None,
        writers_health: Callable[[], str | None] = lambda: None,
        buckets: Collection[str] | None = None,
        text_jobs: JobSink | None = None,
    ) -> None:
        """``buckets``: the configured buckets; a job naming another is refused (None: any).
        ``text_jobs``: the text queue, where a text job goes once an index job settled a video whose
        words are due (``JobResult.text_due``); None: no text source is on."""
        self._runner = runner
        self._text_jobs = text_jobs
        self._buckets = frozenset(buckets) if buckets is not None else None
        self._writers_health = writers_health
        self._dead_letters = dead_letters
        self._max_retries = max_retries
        self._metrics = metrics or Metrics()
        self._running = 0
        self._idle = threading.Condition()

    def handle(self, payload: Any, task: TaskContext) -> dict[str, Any]:
        """Run one task.

        Raises:
            TransientError (or any unexpected error): retry it; the last attempt does not raise.
        """
        with self._idle:
            self._running += 1
        started = time.monotonic()
        outcome = "retry"  # what a raise means: Celery runs the task again
        try:
            answer = self._handle(payload, task)
            outcome = str(answer.get("outcome", "unknown"))
            return answer
        finally:
            self._metrics.job(outcome, time.monotonic() - started)
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def check_health(self) -> None:
        """Raises:
        RuntimeError: a frame writer of this process died or stopped moving (Serve replaces the replica;
            its tasks, unacknowledged, are redelivered).
        """
        if (problem := self._writers_health()) is not None:
            raise RuntimeError(problem)
        self._metrics.service_ok("frame-writer")

    def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the tasks running now to end (a replica being scaled down has
        stopped taking tasks: letting them finish spares their videos a redelivery that would count as
        a crash). Returns how many are still running."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._running and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)
            return self._running

    def _handle(self, payload: Any, task: TaskContext) -> dict[str, Any]:
        try:
            job = IndexJob.model_validate(payload)
        except ValidationError as exc:
            return self._malformed(payload, task, exc)
        if self._buckets is not None and job.bucket not in self._buckets:
            return self._unconfigured_bucket(job, task)
        if task.redelivered:
            log.info("task %s for %s redelivered: running it again", task.task_id, job.uri)
        run = job
        if task.retries > 0 or task.redelivered:
            # An earlier start's catalog write may still land (its caller gave up on a stalled writer):
            # this start writes the row even when it finds nothing to do (until it sees the row moved
            # past its first read: ``Fence``), so that write can't be the row's last word (its
            # compare-and-set loses, or lands first and this start sees it).
            run = job.model_copy(update={"settle": True})
        try:
            result = self._runner.run(run, task.task_id, task.retries, redelivered=task.redelivered)
        except PermanentError as exc:
            # Usually recorded already (decode, limits); not when the object store refused a HEAD.
            self._record_failure(job, exc.reason)
            killed = isinstance(exc, ConsumerKilled)
            kind = FailureKind.CRASH_LOOP if killed else FailureKind.PERMANENT
            self._dead_letter(job, task, kind, exc.reason)
            self._metrics.failed(FailureReason.CRASH_LOOP if killed else failure_reason(exc), kind.value)
            return {"video_id": job.video_id, "outcome": "failed", "reason": exc.reason}
        except Exception as exc:
            cause = str(exc) if isinstance(exc, VidxError) else f"internal error ({type(exc).__name__})"
            attempt = task.retries + 1
            if task.retries < self._max_retries:
                log.warning("job %s attempt %d failed, will retry: %s", job.uri, attempt, cause)
                raise
            reason = f"gave up after {attempt} attempts: {cause}"
            self._record_failure(job, reason)
            self._dead_letter(job, task, FailureKind.EXHAUSTED, reason)
            self._metrics.failed(failure_reason(exc), FailureKind.EXHAUSTED.value)
            return {"video_id": job.video_id, "outcome": "failed", "reason": reason}
        if result.text_due and self._text_jobs is not None:
            self._submit_text_job(job, task)
        return {
            "video_id": result.video_id,
            "outcome": result.outcome.value,
            "frames": result.frames,
            "stages": result.stages,
        }

    def _malformed(self, payload: Any, task: TaskContext, exc: ValidationError) -> dict[str, Any]:
        """A payload that is no job: dead-lettered as it came, nothing run."""
        reason = f"malformed job ({exc.error_count()} invalid fields)"
        self._dead_letters.publish(
            DeadLetter(
                id=task.task_id,
                kind=FailureKind.MALFORMED,
                reason=reason,
                attempts=task.retries + 1,
                raw_job=repr(payload)[:2000],
            )
        )
        self._metrics.failed(FailureReason.MALFORMED_JOB, FailureKind.MALFORMED.value)
        log.warning("task %s dead-lettered: %s", task.task_id, reason)
        return {"outcome": "failed", "reason": reason}

    def _unconfigured_bucket(self, job: IndexJob, task: TaskContext) -> dict[str, Any]:
        """A job naming a bucket that is not configured: dead-lettered, nothing run."""
        # Whoever can publish to the task queue must not make vidx read, thumbnail and link any
        # object it can reach: refused for good, no catalog row, the reason in the dead letter.
        reason = f"bucket {job.bucket!r} is not one of the configured buckets (VIDX_S3__BUCKETS)"
        self._dead_letter(job, task, FailureKind.PERMANENT, reason)
        self._metrics.failed(FailureReason.UNCONFIGURED_BUCKET, FailureKind.PERMANENT.value)
        log.warning("task %s refused: %s", task.task_id, reason)
        return {"video_id": job.video_id, "outcome": "failed", "reason": reason}

    def _submit_text_job(self, job: IndexJob, task: TaskContext) -> None:
        """The text job of a video whose frames are in. If the broker does not take it, the index task
        is retried (its retry finds the frames in, and submits again); on its last attempt the frames
        stand and the words wait for the next job of the video."""
        assert self._text_jobs is not None
        text = IndexJob(op=JobOp.INDEX, bucket=job.bucket, key=job.key, source=JobSource.TEXT)
        try:
            self._text_jobs.submit(text)
        except TransientError as exc:
            if task.retries < self._max_retries:
                log.warning("the text job of %s was not submitted (%s): retrying the task", job.uri, exc)
                raise
            log.warning("the text job of %s was not submitted (%s); its words wait for its next job", job.uri, exc)

    def _record_failure(self, job: IndexJob, reason: str) -> None:
        """Best effort: the store that failed the job is often the one that is down. The dead letter
        still goes out, and the scheduled check finds a row left ``indexing`` past its grace. A text
        job fails no video (its frames stand): its dead letter says why its words are missing."""
        if job.source is JobSource.TEXT:
            return
        try:
            self._runner.record_failure(job, reason)
        except TransientError as exc:
            log.warning("could not record the failure of %s (%s); the scheduled check will find it", job.uri, exc)

    def _dead_letter(self, job: IndexJob, task: TaskContext, kind: FailureKind, reason: str) -> None:
        self._dead_letters.publish(
            DeadLetter(id=task.task_id, kind=kind, reason=reason, attempts=task.retries + 1, job=job)
        )
        log.warning("job %s dead-lettered (%s): %s", job.uri, kind.value, reason)
