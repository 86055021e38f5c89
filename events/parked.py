"""Parked bucket events: messages the router gave up on, kept with their raw body and the reason.

The router parks a message (``park``) on ``amqp.parked_queue`` when its body can't be decoded, when
routing it failed unexpectedly, or when the task queue refused its jobs ``amqp.max_attempts`` times.
``ParkedQueue`` lists them without consuming and replays them: each chosen body is republished to the
events exchange, and its parked copy acknowledged only once the broker confirmed the republish.

Listing and replaying go the way of every held queue (``events.held``).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pika

from events.browse import Taken
from events.config import AmqpSettings
from events.held import HeldQueue, ReplayReport
from events.records import EventDecodeError, decode_message
from events.subscribe import declare_event_topology

#: Headers a parked message carries: why, after how many tries, and when (ISO 8601, UTC).
REASON_HEADER = "x-vidx-reason"
ATTEMPTS_HEADER = "x-vidx-attempts"
PARKED_AT_HEADER = "x-vidx-parked-at"
#: Longest reason kept in the header.
MAX_REASON_CHARS = 500


def parked_id(body: bytes) -> str:
    """A parked message's id: its body's digest, so the same event parked twice shows once."""
    return hashlib.sha256(body).hexdigest()[:16]


def park(channel: Any, queue: str, body: bytes, reason: str, attempts: int) -> None:
    """Publish ``body`` to the parked ``queue`` with why, after how many tries and when. On a channel
    in confirm mode it returns once the broker has the message.

    Raises:
        pika.exceptions.AMQPError: the broker refused it or the channel is gone (the caller must not
            acknowledge the original).
    """
    headers = {
        REASON_HEADER: reason[:MAX_REASON_CHARS],
        ATTEMPTS_HEADER: attempts,
        PARKED_AT_HEADER: datetime.now(UTC).isoformat(),
    }
    channel.basic_publish(
        exchange="",
        routing_key=queue,
        body=body,
        properties=pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent, headers=headers),
        mandatory=True,
    )


@dataclass(frozen=True, slots=True)
class ParkedEvent:
    """One parked message as the operator sees it; ``body`` is what a replay republishes."""

    id: str
    reason: str
    attempts: int | None
    parked_at: datetime | None
    body: bytes
    #: The objects its records name, when the body decodes.
    uris: tuple[str, ...] = ()

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "uris": list(self.uris),
            "reason": self.reason,
            "attempts": self.attempts,
            "parked_at": self.parked_at.isoformat() if self.parked_at else None,
            "size_bytes": len(self.body),
        }


def decode_parked(body: bytes, headers: dict[str, Any]) -> ParkedEvent:
    """Read one parked message; headers that are missing or of the wrong type read as unknown."""
    reason = headers.get(REASON_HEADER)
    attempts = headers.get(ATTEMPTS_HEADER)
    parked_at: datetime | None = None
    stamp = headers.get(PARKED_AT_HEADER)
    if isinstance(stamp, str):
        with contextlib.suppress(ValueError):
            parked_at = datetime.fromisoformat(stamp)
    try:
        uris = tuple(event.uri for event in decode_message(body))
    except EventDecodeError:
        uris = ()
    return ParkedEvent(
        id=parked_id(body),
        reason=reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason or "unknown"),
        attempts=attempts if isinstance(attempts, int) and not isinstance(attempts, bool) else None,
        parked_at=parked_at,
        body=body,
        uris=uris,
    )


class ParkedQueue(HeldQueue[ParkedEvent]):
    """List and replay parked events. Each call opens its own short connection."""

    what = "parked queue"
    holds = "parked events"

    def __init__(self, amqp: AmqpSettings, max_list: int = 10_000, timeout_s: float = 10.0) -> None:
        super().__init__(amqp.url.get_secret_value(), amqp.parked_queue, max_list, timeout_s, amqp.queue_arguments)
        self._amqp = amqp

    def read(self, message: Taken) -> ParkedEvent:
        return decode_parked(message.body, message.headers)

    def prepare_replay(self, channel: Any) -> None:
        declare_event_topology(channel, self._amqp)
        channel.confirm_delivery()

    def replay(self, ids: Collection[str] | None = None) -> ReplayReport[ParkedEvent]:
        """Republish the chosen parked bodies (``None``: all) to the events exchange the router
        consumes, and remove them from the parked queue: each parked copy is acknowledged only after
        the broker confirmed its republish, so a failure loses nothing (it may leave one event both
        replayed and parked; events are hints, a second replay is harmless).

        Raises:
            TransientError: the broker is unreachable or refused a republish.
        """
        return self.resend(ids, self._republish)

    def _republish(self, channel: Any, event: ParkedEvent) -> None:
        channel.basic_publish(
            exchange=self._amqp.exchange,
            routing_key=self._amqp.routing_key,
            body=event.body,
            properties=pika.BasicProperties(
                content_type="application/json", delivery_mode=pika.DeliveryMode.Persistent
            ),
            mandatory=True,
        )
