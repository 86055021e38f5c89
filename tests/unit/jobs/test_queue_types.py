"""Every queue vidx declares has the configured type: classic on one broker node, quorum on a cluster
(the index queue also with its delivery limit and dead-letter target) — in the event topology, the
held queues and the task queues Celery declares through Ray's adapter."""

from __future__ import annotations

from typing import Any

import pytest

from events.config import UNLIMITED_DELIVERIES, AmqpSettings
from events.parked import ParkedQueue
from events.subscribe import declare_event_topology
from pipeline.jobs.taskqueue import dead_letter_queue, task_processor_config
from pipeline.settings import Settings
from storage.errors import TransientError
from tests.unit.events.test_parked import FakeChannel, patch_broker

QUORUM = {"x-queue-type": "quorum", "x-delivery-limit": UNLIMITED_DELIVERIES}


class RecordingChannel:
    def __init__(self) -> None:
        self.declared: dict[str, dict[str, Any]] = {}

    def exchange_declare(self, **_: Any) -> None:
        pass

    def queue_bind(self, **_: Any) -> None:
        pass

    def queue_declare(self, queue: str, durable: bool = False, arguments: dict[str, Any] | None = None) -> None:
        assert durable
        self.declared[queue] = dict(arguments or {})


def quorum_settings() -> Settings:
    return Settings(amqp=AmqpSettings(queue_type="quorum", delivery_limit=7))


def celery_queues(settings: Settings) -> dict[str, dict[str, Any]]:
    from ray.serve.task_consumer import instantiate_adapter_from_config

    adapter: Any = instantiate_adapter_from_config(task_processor_config(settings))
    return {q.name: dict(q.queue_arguments or {}) for q in adapter._app.amqp.queues.values()}


def test_the_event_queues_are_classic_by_default_and_quorum_when_configured() -> None:
    for amqp, want in [(AmqpSettings(), {}), (AmqpSettings(queue_type="quorum"), QUORUM)]:
        channel = RecordingChannel()
        declare_event_topology(channel, amqp)
        assert channel.declared == {amqp.events_queue: want, amqp.parked_queue: want}


def test_quorum_task_queues_are_declared_by_celery_with_the_delivery_limit_dead_lettering_to_the_failed_queue() -> None:
    settings = quorum_settings()
    serve = settings.serve
    assert celery_queues(settings) == {
        serve.index_queue: QUORUM
        | {"x-delivery-limit": 7, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": serve.failed_queue},
        serve.failed_queue: QUORUM,
        serve.unprocessable_queue: QUORUM,
    }


def test_classic_task_queues_are_declared_as_rays_adapter_declares_them() -> None:
    serve = Settings().serve
    assert celery_queues(Settings()) == {serve.index_queue: {}, serve.failed_queue: {}, serve.unprocessable_queue: {}}


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_the_dead_letter_queue_is_declared_like_the_failed_queue_celery_declares(queue_type: str) -> None:
    settings = Settings(amqp=AmqpSettings(queue_type=queue_type))
    assert dead_letter_queue(settings).arguments == celery_queues(settings)[settings.serve.failed_queue]


def test_the_held_queues_list_and_replay_a_quorum_cluster_s_queues_without_a_refused_redeclaration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The stand-in broker refuses a redeclaration with other arguments, as RabbitMQ does.
    broker = patch_broker(monkeypatch)
    settings = quorum_settings()
    declare_event_topology(FakeChannel(broker), settings.amqp)
    FakeChannel(broker).queue_declare(settings.serve.failed_queue, durable=True, arguments=QUORUM)  # as Celery
    assert ParkedQueue(settings.amqp).list() == []
    assert ParkedQueue(settings.amqp).replay().replayed == []
    assert dead_letter_queue(settings).list() == []
    with pytest.raises(TransientError):  # what the fix avoids: a classic declaration of a quorum queue
        ParkedQueue(AmqpSettings(parked_queue=settings.amqp.parked_queue)).list()
