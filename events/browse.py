"""Browsing a durable RabbitMQ queue: take messages without acknowledging them, and hand back (nack,
requeue) every one not acknowledged, so the queue keeps what it had, in its order. The dead-letter
queue and the parked queue list and replay through it (``events.held``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.exceptions

from storage.errors import TransientError

log = logging.getLogger(__name__)


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
def browse(
    params: pika.ConnectionParameters, queue: str, limit: int, what: str, arguments: Mapping[str, Any] | None = None
) -> Iterator[Browse]:
    """Declare ``queue`` (durable, with ``arguments``: its type), take up to ``limit`` of its messages
    without acknowledging them, and on leaving hand back (nack, requeue) every one the caller did not
    ``ack``: the queue keeps what it had, in its order. If the block raises, closing the connection hands them back.

    Raises:
        TransientError: the broker is unreachable or the queue unreadable.
    """
    connection = connect(params, what)
    try:
        channel = connection.channel()
        declared = channel.queue_declare(queue=queue, durable=True, arguments=dict(arguments or {}))
        waiting = int(declared.method.message_count)
        session = Browse(channel, waiting, take(channel, queue, limit))
        yield session
        channel.basic_nack(delivery_tag=0, multiple=True, requeue=True)
    except pika.exceptions.AMQPError as exc:
        raise TransientError(f"{what} unreadable: {type(exc).__name__}") from exc
    finally:
        close_quietly(connection)
