"""Parked bucket events: messages the router gave up on, kept with their raw body and the reason.

The router parks a message (``park``) on ``amqp.parked_queue`` when its body can't be decoded, when
routing it failed unexpectedly, or when the task queue refused its jobs ``amqp.max_attempts`` times.
``ParkedQueue`` lists them without consuming and replays them: each chosen body is republished to the
events exchange, and its parked copy acknowledged only once the broker confirmed the republish.

``browse`` is the take-then-hand-back session that this listing and the dead-letter queue share.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pika
import pika.exceptions

from events.config import AmqpSettings
from events.records import EventDecodeError, decode_message
from events.subscribe import declare_event_topology
from storage.errors import TransientError

log = logging.getLogger(__name__)

#: Headers a parked message carries: why, after how many tries, and when (ISO 8601, UTC).
REASON_HEADER = "x-vidx-reason"
ATTEMPTS_HEADER = "x-vidx-attempts"
PARKED_AT_HEADER = "x-vidx-parked-at"
#: Longest reason kept in the header.
MAX_REASON_CHARS = 500


# -- browsing a queue: take messages unacknowledged, hand back every one not acknowledged ------------


@dataclass(frozen=True, slots=True)
class Taken:
    """One message taken off a queue and not yet acknowledged."""

    tag: int
    headers: dict[str, Any]
    body: bytes


@dataclass(slots=True)
class Browse:
    """An open session over one queue: what it held (``waiting``) and what was taken."""

    channel: Any
    waiting: int
    taken: list[Taken] = field(default_factory=list)

    def ack(self, tag: int) -> None:
        self.channel.basic_ack(delivery_tag=tag)


def connect(params: pika.ConnectionParameters, what: str) -> pika.BlockingConnection:
    """Raises:
    TransientError: the broker is unreachable (never with the connection parameters in the text).
    """
    try:
        return pika.BlockingConnection(params)
    except pika.exceptions.AMQPError as exc:
        raise TransientError(f"{what} unreachable: {type(exc).__name__}") from exc


def close_quietly(connection: pika.BlockingConnection) -> None:
    try:
        if connection.is_open:
            connection.close()
    except pika.exceptions.AMQPError:
        log.debug("broker connection already gone")


def take(channel: Any, queue: str, limit: int) -> list[Taken]:
    """Up to ``limit`` messages of ``queue``, oldest first, none acknowledged."""
    taken: list[Taken] = []
    while len(taken) < limit:
        method, properties, body = channel.basic_get(queue=queue, auto_ack=False)
        if method is None:
            break
        taken.append(Taken(method.delivery_tag, dict(properties.headers or {}), body))
    return taken


@contextlib.contextmanager
def browse(params: pika.ConnectionParameters, queue: str, limit: int, what: str) -> Iterator[Browse]:
    """Declare ``queue`` (durable), take up to ``limit`` of its messages without acknowledging them,
    and on leaving hand back (nack, requeue) every one the caller did not ``ack``: the queue keeps
    what it had, in its order. If the block raises, closing the connection hands them back.

    Raises:
        TransientError: the broker is unreachable or the queue unreadable.
    """
    connection = connect(params, what)
    try:
        channel = connection.channel()
        waiting = int(channel.queue_declare(queue=queue, durable=True).method.message_count)
        session = Browse(channel, waiting, take(channel, queue, limit))
        yield session
        channel.basic_nack(delivery_tag=0, multiple=True, requeue=True)
    except pika.exceptions.AMQPError as exc:
        raise TransientError(f"{what} unreadable: {type(exc).__name__}") from exc
    finally:
        close_quietly(connection)


# -- the parked queue ----------------------------------------------------------------------------------


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


@dataclass(frozen=True, slots=True)
class ParkedReplayReport:
    replayed: list[ParkedEvent]
    #: Messages left on the parked queue after the replay (as far as this call saw).
    remaining: int


class ParkedQueue:
    """List and replay parked events. Each call opens its own short connection."""

    def __init__(self, amqp: AmqpSettings, max_list: int = 10_000, timeout_s: float = 10.0) -> None:
        self._amqp = amqp
        self._params = pika.URLParameters(amqp.url.get_secret_value())
        self._params.socket_timeout = timeout_s
        self._params.blocked_connection_timeout = timeout_s
        self._max_list = max_list

    @property
    def queue(self) -> str:
        return self._amqp.parked_queue

    def list(self, limit: int | None = None) -> list[ParkedEvent]:
        """The parked events, oldest first, one per id. The queue is left as it was.

        Raises:
            TransientError: the broker is unreachable.
        """
        with browse(self._params, self.queue, min(limit or self._max_list, self._max_list), "parked queue") as session:
            events = [decode_parked(m.body, m.headers) for m in session.taken]
        by_id: dict[str, ParkedEvent] = {}
        for event in events:
            by_id.pop(event.id, None)
            by_id[event.id] = event
        return list(by_id.values())

    def replay(self, ids: Collection[str] | None = None) -> ParkedReplayReport:
        """Republish the chosen parked bodies (``None``: all) to the events exchange the router
        consumes, and remove them from the parked queue: each parked copy is acknowledged only after
        the broker confirmed its republish, so a failure loses nothing (it may leave one event both
        replayed and parked; events are hints, a second replay is harmless).

        Raises:
            TransientError: the broker is unreachable or refused a republish.
        """
        wanted = set(ids) if ids is not None else None
        replayed: dict[str, ParkedEvent] = {}
        with browse(self._params, self.queue, self._max_list, "parked queue") as session:
            declare_event_topology(session.channel, self._amqp)
            session.channel.confirm_delivery()
            acked = 0
            for message in session.taken:
                event = decode_parked(message.body, message.headers)
                if wanted is not None and event.id not in wanted:
                    continue
                if event.id not in replayed:
                    session.channel.basic_publish(
                        exchange=self._amqp.exchange,
                        routing_key=self._amqp.routing_key,
                        body=event.body,
                        properties=pika.BasicProperties(
                            content_type="application/json", delivery_mode=pika.DeliveryMode.Persistent
                        ),
                        mandatory=True,
                    )
                    replayed[event.id] = event
                session.ack(message.tag)
                acked += 1
            remaining = max(0, session.waiting - acked)
        log.info("replayed %d parked events, %d remain", len(replayed), remaining)
        return ParkedReplayReport(replayed=list(replayed.values()), remaining=remaining)
