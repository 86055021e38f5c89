"""The dead-letter queue: every job that failed for good, with its reason, listable and replayable.

Dead letters live on a durable RabbitMQ queue (``serve.failed_queue``, the same queue Ray Serve's
task adapter moves a task to when its handler raises after its last retry), so the operator sees them
in the broker's UI too. The consumer publishes a typed ``DeadLetter`` (JSON) with publisher confirms;
a message Ray's adapter moved there (a Celery task message) is read as well.

Listing and replaying go the way of every held queue (``events.held``): a listing leaves the queue as
it was; a replay resubmits the chosen jobs and acknowledges only those.
"""

from __future__ import annotations

import ast
import enum
import json
from collections.abc import Collection, Mapping
from datetime import UTC, datetime
from typing import Any

import pika
import pika.exceptions
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from events.browse import Taken, close_quietly, connect
from events.held import HeldQueue, ReplayReport
from events.jobs import IndexJob, JobSink, JobSource
from storage.errors import TransientError


class FailureKind(enum.StrEnum):
    #: The input can't be indexed (not a video, corrupt, over a limit): retrying won't help.
    PERMANENT = "permanent"
    #: A transient error that outlasted the retry budget.
    EXHAUSTED = "exhausted"
    #: The job itself could not be read.
    MALFORMED = "malformed"
    #: Its consumer died while indexing it ``serve.max_crashes`` times (killed, out of memory).
    CRASH_LOOP = "crash_loop"
    #: The broker dead-lettered it: delivered ``amqp.delivery_limit`` times (a quorum queue's backstop).
    DELIVERY_LIMIT = "delivery_limit"


class DeadLetter(BaseModel):
    """One failed job. ``id`` is the task id, stable across retries and redeliveries."""

    model_config = ConfigDict(frozen=True)

    id: str
    kind: FailureKind
    reason: str
    attempts: int | None = None
    failed_at: datetime | None = Field(default_factory=lambda: datetime.now(UTC))
    job: IndexJob | None = None
    #: The job as received, when it could not be parsed (kept so nothing is lost).
    raw_job: str | None = None

    @property
    def uri(self) -> str | None:
        return self.job.uri if self.job else None

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "uri": self.uri,
            "kind": self.kind.value,
            "reason": self.reason,
            "attempts": self.attempts,
            "failed_at": self.failed_at.isoformat() if self.failed_at else None,
        }


def _from_celery(body: bytes, headers: dict[str, Any]) -> DeadLetter:
    """A task Ray's adapter moved here: args are (task id, exception text, repr(args), repr(kwargs), traceback)."""
    payload = json.loads(body)
    args = payload[0] if isinstance(payload, list) else payload.get("args", [])
    task_id, exc_text, job_args = str(args[0]), str(args[1]), str(args[2])
    job: IndexJob | None = None
    raw: str | None = None
    try:
        parsed = ast.literal_eval(job_args)
        job = IndexJob.model_validate(parsed[0] if isinstance(parsed, list | tuple) else parsed)
    except (ValueError, SyntaxError, IndexError, TypeError, ValidationError):
        raw = job_args[:2000]
    retries = headers.get("retries")
    return DeadLetter(
        id=task_id,
        kind=FailureKind.EXHAUSTED if job else FailureKind.MALFORMED,
        reason=exc_text or "failed",
        attempts=int(retries) + 1 if isinstance(retries, int) else None,
        failed_at=None,
        job=job,
        raw_job=raw,
    )


def _from_broker(body: bytes, headers: dict[str, Any]) -> DeadLetter:
    """An index task the broker itself dead-lettered (``x-death``), as it was published, args ``[job]``.
    At the quorum index queue's delivery limit: replayable, with its job. Rejected by a consumer instead
    (Celery rejects a task it can't run — unknown or invalid — and Ray's adapter has already copied it
    to the unprocessable queue): listed with its raw args, never replayed."""
    payload = json.loads(body)
    args = payload[0] if isinstance(payload, list) else payload.get("args", [])
    death = headers["x-death"][0]
    reason = _text(death.get("reason", ""))
    died = death.get("time")  # pika reads an AMQP timestamp as a naive UTC datetime
    job: IndexJob | None = None
    raw: str | None = None
    try:
        if reason != "delivery_limit":
            raise ValueError(reason)
        job = IndexJob.model_validate(args[0])
    except (ValueError, IndexError, TypeError):  # ValidationError is a ValueError
        raw = json.dumps(args)[:2000]
    why = "" if reason == "delivery_limit" else "; also in the unprocessable queue, not replayed"
    return DeadLetter(
        id=str(headers.get("id") or ""),
        kind=FailureKind.DELIVERY_LIMIT if reason == "delivery_limit" else FailureKind.MALFORMED,
        reason=f"dead-lettered by the broker ({reason}) from {_text(death.get('queue'))}{why}",
        attempts=headers.get("x-delivery-count") if isinstance(headers.get("x-delivery-count"), int) else None,
        failed_at=died.replace(tzinfo=died.tzinfo or UTC) if isinstance(died, datetime) else None,
        job=job,
        raw_job=raw,
    )


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def decode_dead_letter(body: bytes, headers: dict[str, Any] | None) -> DeadLetter:
    """Read one message of the dead-letter queue, whichever way it got there.

    Raises:
        ValueError: the message is neither a DeadLetter nor a Celery task message.
    """
    headers = headers or {}
    if "task" in headers:
        try:
            if headers.get("x-death"):
                return _from_broker(body, headers)
            return _from_celery(body, headers)
        except (ValueError, IndexError, KeyError, TypeError) as exc:
            raise ValueError(f"unreadable task message: {type(exc).__name__}") from exc
    try:
        return DeadLetter.model_validate_json(body)
    except ValidationError as exc:
        raise ValueError(f"unreadable dead letter ({exc.error_count()} invalid fields)") from exc


class DeadLetterQueue(HeldQueue[DeadLetter]):
    """Publish, list and replay dead letters. Each call opens its own short connection."""

    what = "dead-letter queue"
    holds = "dead letters"

    def __init__(
        self,
        amqp_url: str,
        queue: str,
        max_list: int = 10_000,
        timeout_s: float = 10.0,
        arguments: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(amqp_url, queue, max_list, timeout_s, arguments)

    def publish(self, letter: DeadLetter) -> None:
        """Store ``letter`` durably; returns once the broker confirmed it.

        Raises:
            TransientError: the broker did not take it.
        """
        connection = connect(self.params, self.what)
        try:
            channel = connection.channel()
            # Declared as the task queue's adapter declares it: durable, of the configured queue type.
            channel.queue_declare(queue=self.queue, durable=True, arguments=self.arguments)
            channel.confirm_delivery()
            channel.basic_publish(
                exchange="",
                routing_key=self.queue,
                body=letter.model_dump_json().encode(),
                properties=pika.BasicProperties(
                    content_type="application/json", delivery_mode=pika.DeliveryMode.Persistent
                ),
                mandatory=True,
            )
        except pika.exceptions.AMQPError as exc:
            raise TransientError(f"dead letter not stored: {type(exc).__name__}") from exc
        finally:
            close_quietly(connection)

    def read(self, message: Taken) -> DeadLetter:
        """A taken message as a letter; an unreadable one comes back as a MALFORMED letter."""
        try:
            return decode_dead_letter(message.body, message.headers)
        except ValueError as exc:
            return DeadLetter(
                id=f"raw-{message.tag}",
                kind=FailureKind.MALFORMED,
                reason=str(exc),
                failed_at=None,
                raw_job=message.body[:2000].decode("utf-8", "replace"),
            )

    def replayable(self, item: DeadLetter) -> bool:
        return item.job is not None

    def replay(self, sink: JobSink, ids: Collection[str] | None = None) -> ReplayReport[DeadLetter]:
        """Resubmit the jobs of the chosen dead letters (``None``: all) and remove those letters.

        A letter is acknowledged only after its job is confirmed on the task queue; if submitting
        fails, the rest stay on the dead-letter queue. Letters without a readable job stay too.

        Raises:
            TransientError: the broker is unreachable (nothing not yet resubmitted is lost).
        """

        def submit(_channel: Any, letter: DeadLetter) -> None:
            assert letter.job is not None  # replayable() let only letters with a job through
            sink.submit(letter.job.model_copy(update={"source": JobSource.REPLAY, "submitted_at": datetime.now(UTC)}))

        return self.resend(ids, submit)
