"""events/parked.py: parked events are listed without being consumed and replayed with confirms
(a stand-in broker with RabbitMQ's basic_get/ack/nack semantics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pika
import pika.exceptions
import pytest

from events.config import AmqpSettings
from events.parked import ParkedQueue, decode_parked, park, parked_id
from storage.errors import TransientError
from tests.unit.events.test_records import minio_body, minio_record

AMQP = AmqpSettings(url="amqp://vidx:s3cret@broker:5672/%2F")  # type: ignore[arg-type]


@dataclass
class Declared:
    message_count: int


@dataclass
class DeclareOk:
    method: Declared


@dataclass(frozen=True)
class Delivery:
    delivery_tag: int


@dataclass
class FakeBroker:
    """Queues of (headers, body); ``bindings`` route (exchange, routing key) to a queue. Messages taken
    with basic_get and not acked go back to the head of their queue, in order, on nack or on close."""

    queues: dict[str, list[tuple[dict[str, Any], bytes]]] = field(default_factory=dict)
    bindings: dict[tuple[str, str], str] = field(default_factory=dict)
    #: Each queue's declaration arguments: a redeclaration with others is refused, as RabbitMQ does.
    arguments: dict[str, dict[str, Any]] = field(default_factory=dict)
    refuse_publish: bool = False
    connections: int = 0

    def connection(self, params: Any) -> FakeConnection:
        self.connections += 1
        return FakeConnection(self)

    def bodies(self, queue: str) -> list[bytes]:
        return [body for _, body in self.queues.get(queue, [])]


class FakeConnection:
    def __init__(self, broker: FakeBroker) -> None:
        self.broker = broker
        self.is_open = True
        self._channel = FakeChannel(broker)

    def channel(self) -> FakeChannel:
        return self._channel

    def close(self) -> None:
        self._channel.requeue_unacked()
        self.is_open = False


class FakeChannel:
    def __init__(self, broker: FakeBroker) -> None:
        self.broker = broker
        self.unacked: dict[int, tuple[str, dict[str, Any], bytes]] = {}
        self.next_tag = 1
        self.confirming = False

    def queue_declare(self, queue: str, durable: bool = False, arguments: dict[str, Any] | None = None) -> DeclareOk:
        assert durable
        declared = self.broker.arguments.setdefault(queue, dict(arguments or {}))
        if declared != dict(arguments or {}):
            raise pika.exceptions.ChannelClosedByBroker(406, f"PRECONDITION_FAILED - inequivalent arg for {queue}")
        return DeclareOk(Declared(len(self.broker.queues.setdefault(queue, []))))

    def exchange_declare(self, exchange: str, exchange_type: str, durable: bool) -> None:
        assert durable

    def queue_bind(self, queue: str, exchange: str, routing_key: str) -> None:
        self.broker.bindings[(exchange, routing_key)] = queue

    def confirm_delivery(self) -> None:
        self.confirming = True

    def basic_get(self, queue: str, auto_ack: bool) -> tuple[Any, Any, Any]:
        assert not auto_ack
        messages = self.broker.queues.setdefault(queue, [])
        if not messages:
            return None, None, None
        headers, body = messages.pop(0)
        tag, self.next_tag = self.next_tag, self.next_tag + 1
        self.unacked[tag] = (queue, headers, body)
        return Delivery(tag), pika.BasicProperties(headers=headers), body

    def basic_ack(self, delivery_tag: int) -> None:
        del self.unacked[delivery_tag]

    def basic_nack(self, delivery_tag: int, multiple: bool = False, requeue: bool = True) -> None:
        assert delivery_tag == 0 and multiple and requeue
        self.requeue_unacked()

    def requeue_unacked(self) -> None:
        for tag in sorted(self.unacked, reverse=True):
            queue, headers, body = self.unacked.pop(tag)
            self.broker.queues[queue].insert(0, (headers, body))

    def basic_publish(
        self, exchange: str, routing_key: str, body: bytes, properties: Any, mandatory: bool = False
    ) -> None:
        if self.broker.refuse_publish:
            raise pika.exceptions.NackError([])
        queue = routing_key if exchange == "" else self.broker.bindings.get((exchange, routing_key))
        if queue is None:
            assert mandatory
            raise pika.exceptions.UnroutableError([])
        self.broker.queues.setdefault(queue, []).append((dict(properties.headers or {}), body))


def patch_broker(monkeypatch: pytest.MonkeyPatch) -> FakeBroker:
    """Make every ``pika.BlockingConnection`` a connection to a fresh stand-in broker."""
    fake = FakeBroker()
    monkeypatch.setattr(pika, "BlockingConnection", fake.connection)
    return fake


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch) -> FakeBroker:
    return patch_broker(monkeypatch)


UNDECODABLE = b"\xffnot json"
VIDEO = minio_body(minio_record("s3:ObjectCreated:Put", "clips/a+b.mp4"))


def park_two(broker: FakeBroker) -> None:
    channel = FakeChannel(broker)
    park(channel, AMQP.parked_queue, UNDECODABLE, "not JSON: Expecting value", 1)
    park(channel, AMQP.parked_queue, VIDEO, "gave up after 5 attempts: task queue unavailable", 5)


def test_listing_parked_events_leaves_the_queue_as_it_was(broker: FakeBroker) -> None:
    park_two(broker)
    events = ParkedQueue(AMQP).list()
    assert [e.summary()["reason"] for e in events] == [
        "not JSON: Expecting value",
        "gave up after 5 attempts: task queue unavailable",
    ]
    undecodable, video = events
    assert (undecodable.uris, undecodable.attempts) == ((), 1)
    assert (video.uris, video.attempts, video.id) == (("s3://videos/clips/a b.mp4",), 5, parked_id(VIDEO))
    assert video.parked_at is not None
    assert set(video.summary()) == {"id", "uris", "reason", "attempts", "parked_at", "size_bytes"}
    assert broker.bodies(AMQP.parked_queue) == [UNDECODABLE, VIDEO]  # same messages, same order


def test_the_same_event_parked_twice_is_listed_once(broker: FakeBroker) -> None:
    park_two(broker)
    park(FakeChannel(broker), AMQP.parked_queue, VIDEO, "again", 5)
    assert [e.reason for e in ParkedQueue(AMQP).list()] == ["not JSON: Expecting value", "again"]


def test_replay_republishes_the_chosen_body_to_the_events_exchange_and_removes_it(broker: FakeBroker) -> None:
    park_two(broker)
    report = ParkedQueue(AMQP).replay([parked_id(VIDEO), "nope"])
    assert [e.id for e in report.replayed] == [parked_id(VIDEO)] and report.remaining == 1
    assert broker.bindings[(AMQP.exchange, AMQP.routing_key)] == AMQP.events_queue
    assert broker.bodies(AMQP.events_queue) == [VIDEO]
    assert broker.bodies(AMQP.parked_queue) == [UNDECODABLE]


def test_replay_all_empties_the_parked_queue(broker: FakeBroker) -> None:
    park_two(broker)
    park(FakeChannel(broker), AMQP.parked_queue, VIDEO, "again", 5)
    report = ParkedQueue(AMQP).replay()
    assert len(report.replayed) == 2 and report.remaining == 0
    assert broker.bodies(AMQP.events_queue) == [UNDECODABLE, VIDEO]  # one copy per id
    assert broker.bodies(AMQP.parked_queue) == []


def test_a_refused_republish_keeps_the_parked_copy(broker: FakeBroker) -> None:
    park_two(broker)
    broker.refuse_publish = True
    with pytest.raises(TransientError, match="parked queue unreadable: NackError"):
        ParkedQueue(AMQP).replay()
    assert broker.bodies(AMQP.parked_queue) == [UNDECODABLE, VIDEO]
    assert broker.bodies(AMQP.events_queue) == []


def test_an_unreachable_broker_is_transient_and_never_quotes_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(params: Any) -> Any:
        raise pika.exceptions.AMQPConnectionError("amqp://vidx:s3cret@broker:5672/")

    monkeypatch.setattr(pika, "BlockingConnection", refuse)
    with pytest.raises(TransientError) as caught:
        ParkedQueue(AMQP).list()
    assert str(caught.value) == "parked queue unreachable: AMQPConnectionError"


def test_missing_or_mistyped_headers_read_as_unknown() -> None:
    event = decode_parked(b"{}", {"x-vidx-attempts": True, "x-vidx-parked-at": "yesterday"})
    assert (event.reason, event.attempts, event.parked_at, event.uris) == ("unknown", None, None, ())
