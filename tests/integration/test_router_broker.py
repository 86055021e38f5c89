"""The EventRouter against a real RabbitMQ: slow submits keep the connection (heartbeats are answered
while a worker submits), a connection dropped mid-submit costs no second submit, refused submits are
retried with backoff while other events flow, and an event that is always refused is parked after its
attempts, listed with its reason by ``vidx parked list`` and put back by ``vidx parked replay``.

The sink is a stand-in that records each submit (and sleeps or refuses on cue); everything else is real.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import pika
import pytest
from typer.testing import CliRunner

from events.config import AmqpSettings, VideoFilterSettings
from events.jobs import IndexJob
from events.router import CONNECTION_NAME, EventRouter
from events.subscribe import declare_event_topology
from infra.harness.services import Services, eventually, unique_prefix
from pipeline.cli.admin import parked_app
from pipeline.settings import Settings
from storage.errors import TransientError
from tests.unit.events.test_records import minio_body, minio_record

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

BUCKET = "videos"
#: Longest wait for anything the router does here.
WAIT_S = 30.0


@dataclass(frozen=True)
class Call:
    key: str
    at: float
    taken: bool


@dataclass
class CueSink:
    """Records every submit. ``sleep_s`` delays each, a ``release`` event holds each until it is set
    (at most ``WAIT_S``); keys in ``refuse`` are refused that many more times (``always`` keys every
    time until ``heal`` is set)."""

    sleep_s: float = 0.0
    release: threading.Event | None = None
    refuse: dict[str, int] = field(default_factory=dict)
    always: set[str] = field(default_factory=set)
    heal: threading.Event = field(default_factory=threading.Event)
    started: threading.Event = field(default_factory=threading.Event)
    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def submit(self, job: IndexJob) -> str:
        self.started.set()
        time.sleep(self.sleep_s)
        if self.release is not None and not self.release.wait(WAIT_S):
            raise RuntimeError("the test never released the submit")
        with self.lock:
            refused = (job.key in self.always and not self.heal.is_set()) or self.refuse.get(job.key, 0) > 0
            if job.key in self.refuse and refused:
                self.refuse[job.key] -= 1
            self.calls.append(Call(job.key, time.monotonic(), not refused))
        if refused:
            raise TransientError("task queue refused the job (broker nack)")
        return f"task-{len(self.calls)}"

    def tries(self, key: str) -> list[Call]:
        with self.lock:
            return [c for c in self.calls if c.key == key]

    def taken(self) -> list[str]:
        with self.lock:
            return [c.key for c in self.calls if c.taken]


def amqp_for(services: Services, **overrides: object) -> AmqpSettings:
    """Queues and an exchange of their own, so no other test's events reach this router."""
    prefix = unique_prefix()
    fields: dict[str, object] = {
        "url": services.amqp_url,
        "exchange": f"{prefix}.events",
        "events_queue": f"{prefix}.bucket-events",
        "parked_queue": f"{prefix}.bucket-events.parked",
        "reconnect_delay_s": 0.2,
        "poll_s": 0.2,
        **overrides,
    }
    return AmqpSettings.model_validate(fields)


def publish(amqp: AmqpSettings, *keys: str) -> None:
    """One MinIO-shaped created event per key, published with confirms as MinIO does."""
    connection = pika.BlockingConnection(pika.URLParameters(amqp.url.get_secret_value()))
    try:
        channel = connection.channel()
        declare_event_topology(channel, amqp)
        channel.confirm_delivery()
        for key in keys:
            channel.basic_publish(
                exchange=amqp.exchange,
                routing_key=amqp.routing_key,
                body=minio_body(minio_record("s3:ObjectCreated:Put", key, bucket=BUCKET)),
                properties=pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent),
                mandatory=True,
            )
    finally:
        connection.close()


def ready(amqp: AmqpSettings, queue: str) -> int:
    """Messages ready on ``queue`` (unacknowledged ones go back to ready when their consumer leaves)."""
    connection = pika.BlockingConnection(pika.URLParameters(amqp.url.get_secret_value()))
    try:
        return int(connection.channel().queue_declare(queue=queue, durable=True).method.message_count)
    finally:
        connection.close()


@contextmanager
def running(amqp: AmqpSettings, sink: CueSink) -> Iterator[EventRouter]:
    router = EventRouter(amqp, VideoFilterSettings(), sink, buckets=[BUCKET])
    stop = threading.Event()
    thread = threading.Thread(target=router.run, args=(stop,), name="event-router", daemon=True)
    thread.start()
    try:
        eventually(lambda: router.connected, "the router to connect", WAIT_S)
        yield router
    finally:
        stop.set()
        thread.join(timeout=amqp.drain_timeout_s + 10)
        assert not thread.is_alive()


def router_connections(services: Services) -> list[dict[str, object]]:
    """The router's connections as the broker's management API lists them ([] while it can't answer)."""
    try:
        resp = httpx.get(f"{services.management_url}/api/connections", auth=("guest", "guest"), timeout=5)
    except httpx.HTTPError:
        return []
    if resp.status_code != 200:
        return []
    return [c for c in resp.json() if (c.get("client_properties") or {}).get("connection_name") == CONNECTION_NAME]


def short_heartbeat(services: Services) -> list[str]:
    """Names of the router connections running with a 1 s heartbeat (this test's router)."""
    return [str(c["name"]) for c in router_connections(services) if c.get("timeout") == 1]


def test_a_submit_longer_than_three_heartbeats_keeps_the_connection_and_submits_each_event_once(
    services: Services,
) -> None:
    amqp = amqp_for(services, heartbeat_s=1)
    sink = CueSink(sleep_s=3.5)  # > 3 heartbeat intervals: the broker drops a connection after 2 missed
    with running(amqp, sink) as router:
        # The broker agreed to a 1 s heartbeat on this very connection (its name holds the client port).
        eventually(lambda: len(short_heartbeat(services)) == 1, "the router's 1 s heartbeat connection", WAIT_S)
        (connection,) = short_heartbeat(services)
        publish(amqp, "slow-1.mp4", "slow-2.mp4")
        deadline = time.monotonic() + WAIT_S
        while router.stats["messages"] < 2 and time.monotonic() < deadline:
            assert router.connected, "the router lost its connection during a slow submit"
            time.sleep(0.2)
        assert router.stats["messages"] == 2
        assert short_heartbeat(services) == [connection]  # the same connection, still open
    assert sink.taken() == ["slow-1.mp4", "slow-2.mp4"] and len(sink.calls) == 2
    assert router.stats["reconnects"] == 0
    assert ready(amqp, amqp.events_queue) == 0  # both acked: nothing came back when the router left


def test_a_connection_dropped_mid_submit_is_redelivered_but_submitted_once(services: Services) -> None:
    amqp = amqp_for(services)
    sink = CueSink(release=threading.Event())
    with running(amqp, sink) as router:
        publish(amqp, "dropped.mp4")
        assert sink.started.wait(WAIT_S)  # the submit is in progress, and held there
        result = services.rabbit.exec(["rabbitmqctl", "close_all_connections", "test: drop mid-submit"])
        assert result.exit_code == 0, result.output
        eventually(lambda: router.stats["reconnects"] == 1 and router.connected, "the router to reconnect", WAIT_S)
        # The broker hands the unacked message to the new connection while the first submit runs.
        eventually(lambda: router.stats["redelivered_in_progress"] == 1, "the redelivery", WAIT_S)
        assert sink.release is not None
        sink.release.set()
        eventually(lambda: router.stats["messages"] == 1, "the message to be acked", WAIT_S)
    assert [c.key for c in sink.calls] == ["dropped.mp4"]
    assert router.stats["reconnects"] == 1
    assert ready(amqp, amqp.events_queue) == 0  # acked on the new connection: nothing came back


def test_a_refused_submit_is_retried_with_backoff_while_other_events_flow(services: Services) -> None:
    amqp = amqp_for(services, max_attempts=5, retry_delay_s=1.5)
    sink = CueSink(refuse={"flaky.mp4": 2})
    with running(amqp, sink) as router:
        publish(amqp, "flaky.mp4")
        eventually(lambda: len(sink.tries("flaky.mp4")) == 1, "the first refusal", WAIT_S)
        publish(amqp, "steady-1.mp4", "steady-2.mp4", "steady-3.mp4")
        eventually(lambda: len(sink.taken()) == 4, "every event to be submitted", WAIT_S)
        eventually(lambda: router.stats["messages"] == 4, "every message to be acked", WAIT_S)
    flaky = sink.tries("flaky.mp4")
    assert [c.taken for c in flaky] == [False, False, True]
    assert flaky[2].at - flaky[0].at >= 4.4  # backed off 1.5 s, then 3 s
    steady = [c for c in sink.calls if c.key.startswith("steady")]
    assert [c.key for c in steady] == ["steady-1.mp4", "steady-2.mp4", "steady-3.mp4"]
    assert all(flaky[0].at < c.at < flaky[2].at for c in steady)  # flowed while flaky waited
    assert sink.taken().count("flaky.mp4") == 1
    assert router.stats["retried"] == 2 and router.stats["parked"] == 0
    assert ready(amqp, amqp.events_queue) == 0 and ready(amqp, amqp.parked_queue) == 0


def test_an_always_refused_event_is_parked_after_its_attempts_then_listed_and_replayed(services: Services) -> None:
    amqp = amqp_for(services, max_attempts=3, retry_delay_s=0.2)
    sink = CueSink(always={"doomed.mp4"})
    cli = CliRunner()
    settings = Settings(amqp=amqp)
    with running(amqp, sink) as router:
        publish(amqp, "doomed.mp4")
        eventually(lambda: router.stats["parked"] == 1, "the event to be parked", WAIT_S)
        assert len(sink.tries("doomed.mp4")) == 3 and sink.taken() == []

        listed = cli.invoke(parked_app, ["list", "--json"], obj=settings)
        assert listed.exit_code == 0, listed.output
        (event,) = json.loads(listed.stdout)
        assert event["reason"] == "gave up after 3 attempts: task queue refused the job (broker nack)"
        assert (event["attempts"], event["uris"]) == (3, [f"s3://{BUCKET}/doomed.mp4"])
        assert json.loads(cli.invoke(parked_app, ["list", "--json"], obj=settings).stdout) == [event]  # unconsumed

        sink.heal.set()
        replayed = cli.invoke(parked_app, ["replay", event["id"]], obj=settings)
        assert replayed.exit_code == 0, replayed.output
        assert replayed.stdout.strip().splitlines()[-1] == "1 replayed, 0 left in the parked queue"
        eventually(lambda: sink.taken() == ["doomed.mp4"], "the replayed event to be submitted", WAIT_S)
        eventually(lambda: router.stats["messages"] == 1, "the replayed message to be acked", WAIT_S)
        assert json.loads(cli.invoke(parked_app, ["list", "--json"], obj=settings).stdout) == []
    assert ready(amqp, amqp.events_queue) == 0 and ready(amqp, amqp.parked_queue) == 0
