"""Settings of the event layer: the broker, the bucket-event queue and which objects are videos."""

from __future__ import annotations

import posixpath
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, model_validator

#: How MinIO publishes bucket events (``AmqpSettings.event_delivery``).
EventDelivery = Literal["dual", "queue_dir"]

#: The delivery limit of the quorum queues that must never drop a message for being delivered often:
#: the event queue (redelivered after each router reconnect) and the held queues (every listing hands
#: its messages back, which counts as a delivery). Set explicitly because RabbitMQ 4 gives every quorum
#: queue a default limit of 20; 3.x has none.
UNLIMITED_DELIVERIES = 1_000_000


def _amqp_target_arn(target_id: str) -> str:
    """The ARN of MinIO's AMQP notification target ``target_id``."""
    return f"arn:minio:sqs::{target_id}:amqp"


class AmqpSettings(BaseModel):
    """RabbitMQ as MinIO's notification target and as the task queue's broker."""

    url: SecretStr = SecretStr("amqp://guest:guest@127.0.0.1:5672/%2F")
    management_url: str = "http://127.0.0.1:15672"
    #: Durable exchange MinIO publishes bucket events to.
    exchange: str = "vidx.bucket-events"
    routing_key: str = "bucket-events"
    #: Durable queue the EventRouter consumes, bound to the exchange before the first upload.
    events_queue: str = "vidx.bucket-events"
    #: Where messages the router gives up on are parked, with their raw body and the reason (header
    #: ``x-vidx-reason``): undecodable bodies, bodies routing failed on, messages out of attempts.
    parked_queue: str = "vidx.bucket-events.parked"
    #: MinIO notification target id: the ARN is arn:minio:sqs::<id>:amqp.
    minio_target_id: str = "VIDX"
    #: How MinIO publishes bucket events (docs/design/events.md). ``dual``: each event at once from memory
    #: through a second target (``minio_fast_target_id``, no store) *and* through the durable target's
    #: on-disk store, replayed on MinIO's 3 s tick: the fast copy gives freshness, the store's copy the
    #: guarantee through a broker outage; the router drops the later copy (``copy_window_s``).
    #: ``queue_dir``: the durable target alone (events wait for the tick: 0–3 s).
    event_delivery: EventDelivery = "dual"
    minio_fast_target_id: str = "VIDXFAST"
    #: A message whose body equals one the router routed this recently (and not a redelivery) is the
    #: other copy of one event (``dual``): acknowledged without submitting its jobs again. Above MinIO's
    #: 3 s replay tick plus a slow publish; a body routed longer ago is routed again (a replay).
    copy_window_s: float = Field(default=30.0, ge=0, le=3600)
    #: Events MinIO keeps in its queue_dir while the broker is unreachable.
    minio_queue_limit: int = Field(default=100_000, gt=0)
    prefetch: int = Field(default=32, ge=1, le=1000)
    #: ``classic`` (one broker node) or ``quorum`` (a cluster: every queue vidx declares — events,
    #: parked, index, failed, unprocessable — is replicated on a majority of the nodes and survives the
    #: loss of a minority). A queue's arguments (its type, delivery limit, dead-letter target) are fixed
    #: at its first declaration and every later one must repeat them: changing this, ``delivery_limit``
    #: or ``serve.failed_queue`` on a running broker means new queue names (or the queues drained and
    #: deleted first); otherwise every declaration is refused.
    queue_type: Literal["classic", "quorum"] = "classic"
    #: Quorum index queue only: deliveries of one task message (first delivery plus redeliveries after a
    #: lost consumer, connection or broker node) before the broker dead-letters it to the failed queue.
    #: A backstop far above ``serve.max_crashes``: the crash accounting decides first and records why;
    #: this only catches a message that kills its consumer before that accounting runs.
    delivery_limit: int = Field(default=50, ge=2, le=1000)
    reconnect_delay_s: float = Field(default=2.0, gt=0)
    #: Heartbeat the router asks for (0: none); its pika thread keeps answering while a submit runs.
    heartbeat_s: int = Field(default=30, ge=0)
    #: How long a connection the broker blocks (resource alarm) may stay blocked before pika drops it.
    blocked_connection_timeout_s: float = Field(default=60.0, gt=0)
    #: Longest the router's pika thread waits for broker I/O before it settles finished messages.
    poll_s: float = Field(default=0.5, gt=0, le=5)
    #: Tries of one message whose submit the task queue refused (transient), before it is parked.
    max_attempts: int = Field(default=8, ge=1, le=100)
    #: Pause before the second try of a refused message, doubled for each further try, at most the max.
    #: The message stays unacknowledged meanwhile and the router goes on with other messages.
    retry_delay_s: float = Field(default=1.0, gt=0)
    max_retry_delay_s: float = Field(default=30.0, gt=0)
    #: Settled messages remembered (by body digest), so a redelivery after a reconnect whose ack was
    #: lost is acknowledged without submitting its jobs again.
    redelivery_memory: int = Field(default=1000, ge=1, le=1_000_000)
    #: On stop, longest wait for submits in progress to finish and be acknowledged.
    drain_timeout_s: float = Field(default=10.0, ge=0)

    @model_validator(mode="after")
    def _two_targets(self) -> AmqpSettings:
        if self.event_delivery == "dual" and self.minio_fast_target_id == self.minio_target_id:
            raise ValueError("amqp.minio_fast_target_id must differ from amqp.minio_target_id")
        return self

    @property
    def queue_arguments(self) -> dict[str, Any]:
        """Arguments of every queue vidx declares, beyond ``durable`` (a redeclaration must repeat them:
        RabbitMQ refuses a declaration whose queue type differs from the existing queue's)."""
        if self.queue_type == "quorum":
            return {"x-queue-type": "quorum", "x-delivery-limit": UNLIMITED_DELIVERIES}
        return {}

    @property
    def queue_arn(self) -> str:
        """The durable target's ARN."""
        return _amqp_target_arn(self.minio_target_id)

    @property
    def queue_arns(self) -> list[str]:
        """Every ARN a watched bucket publishes to: the durable target's, then the fast one's (``dual``)."""
        if self.event_delivery == "dual":
            return [self.queue_arn, _amqp_target_arn(self.minio_fast_target_id)]
        return [self.queue_arn]


class VideoFilterSettings(BaseModel):
    """Which created objects count as videos: a known extension or a video/* content type."""

    extensions: list[str] = Field(
        default_factory=lambda: [
            ".mp4",
            ".m4v",
            ".mov",
            ".mkv",
            ".webm",
            ".avi",
            ".mpg",
            ".mpeg",
            ".ts",
            ".m2ts",
            ".flv",
            ".wmv",
            ".3gp",
            ".ogv",
        ]
    )
    content_type_prefixes: list[str] = Field(default_factory=lambda: ["video/"])

    def matches(self, key: str, content_type: str | None) -> bool:
        """Whether an object with this key and content type counts as a video."""
        suffix = posixpath.splitext(key)[1].lower()
        if suffix in {e.lower() for e in self.extensions}:
            return True
        return any((content_type or "").lower().startswith(p) for p in self.content_type_prefixes)
