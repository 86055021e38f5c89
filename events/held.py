"""Held messages: what vidx set aside on a durable queue (dead letters, parked events) for an operator
to list and replay. ``HeldQueue`` is the one list/replay path both queues share; each says only how
to read a message and how to send one back.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import pika

from events.browse import Taken, browse

log = logging.getLogger(__name__)


class Held(Protocol):
    """One held message as an operator sees it."""

    @property
    def id(self) -> str: ...

    def summary(self) -> dict[str, Any]: ...


H = TypeVar("H", bound=Held)


@dataclass(frozen=True, slots=True)
class ReplayReport(Generic[H]):
    replayed: list[H]
    #: Messages left on the queue after the replay (as far as this call saw).
    remaining: int


class HeldQueue(abc.ABC, Generic[H]):
    """List and replay the messages held on one queue. Each call opens its own short connection
    (pika's blocking connections aren't thread-safe, and these calls are rare)."""

    #: The queue as errors and logs name it, and what it holds (plural).
    what: ClassVar[str]
    holds: ClassVar[str]

    def __init__(
        self, amqp_url: str, queue: str, max_list: int, timeout_s: float, arguments: Mapping[str, Any] | None = None
    ) -> None:
        self._params = pika.URLParameters(amqp_url)
        self._params.socket_timeout = timeout_s
        self._params.blocked_connection_timeout = timeout_s
        self._queue = queue
        self._max_list = max_list
        #: The queue's declaration arguments (its type): every declaration must repeat them.
        self._arguments = dict(arguments or {})

    @property
    def queue(self) -> str:
        return self._queue

    @property
    def params(self) -> pika.ConnectionParameters:
        return self._params

    @property
    def arguments(self) -> dict[str, Any]:
        return self._arguments

    @abc.abstractmethod
    def read(self, message: Taken) -> H:
        """``message`` as the operator sees it; never raises (an unreadable one says so itself)."""

    def replayable(self, item: H) -> bool:
        """Whether ``item`` can be sent back at all (one that can't stays held)."""
        return True

    def prepare_replay(self, channel: Any) -> None:
        """Set up ``channel`` before the first message is sent back."""

    def list(self, limit: int | None = None) -> list[H]:
        """The held messages, oldest first, one per id (held twice, e.g. after a crash between
        publishing and acknowledging, shows once, where it was last). The queue is left as it was.

        Raises:
            TransientError: the broker is unreachable.
        """
        limit = min(limit or self._max_list, self._max_list)
        with browse(self._params, self._queue, limit, self.what, self._arguments) as session:
            items = [self.read(message) for message in session.taken]
        by_id: dict[str, H] = {}
        for item in items:
            by_id.pop(item.id, None)
            by_id[item.id] = item
        return list(by_id.values())

    def resend(self, ids: Collection[str] | None, send: Callable[[Any, H], None]) -> ReplayReport[H]:
        """``send`` (over the session's channel) each chosen held message (``None``: all) once per
        id, and remove it: a message is acknowledged only after ``send`` returned, so a failure
        loses nothing (what was not yet sent stays held).

        Raises:
            TransientError: the broker is unreachable or refused a send; whatever ``send`` raises.
        """
        wanted = set(ids) if ids is not None else None
        replayed: dict[str, H] = {}
        with browse(self._params, self._queue, self._max_list, self.what, self._arguments) as session:
            self.prepare_replay(session.channel)
            acked = 0
            for message in session.taken:
                item = self.read(message)
                if (wanted is not None and item.id not in wanted) or not self.replayable(item):
                    continue
                if item.id not in replayed:
                    send(session.channel, item)
                    replayed[item.id] = item
                session.ack(message.tag)
                acked += 1
            remaining = max(0, session.waiting - acked)
        log.info("replayed %d %s, %d remain", len(replayed), self.holds, remaining)
        return ReplayReport(replayed=list(replayed.values()), remaining=remaining)
