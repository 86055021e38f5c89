"""The index task queue: Ray Serve's Celery task-processor adapter over RabbitMQ (producer side)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import amqp.exceptions
import kombu.exceptions
from ray.serve.schema import CeleryAdapterConfig, TaskProcessorConfig
from ray.serve.task_consumer import instantiate_adapter_from_config
from ray.serve.task_processor import CeleryTaskProcessorAdapter

from events.deadletters import DeadLetterQueue
from events.jobs import INDEX_TASK, IndexJob
from pipeline.jobs.videostate import QueueingSink, VideoStates
from pipeline.settings import Settings
from storage.commits.catalog import CatalogWrites
from storage.errors import PermanentError, TransientError
from storage.tables import IndexStore

log = logging.getLogger(__name__)

#: The key of ``app_custom_config`` that carries each queue's declaration arguments to the adapter.
QUEUE_ARGUMENTS = "vidx_queue_arguments"


class QueueArgumentsAdapter(CeleryTaskProcessorAdapter):
    """Ray's Celery adapter, declaring its queues (index, failed, unprocessable) with the arguments vidx
    chose — the queue type, the index queue's delivery limit and dead-letter target — which Ray's own
    adapter has no setting for. With quorum queues Celery itself switches to per-consumer QoS
    (``worker_detect_quorum_queues``); a retry's countdown is still held by the consumer (Ray's adapter
    binds direct exchanges, which Celery's native delayed delivery does not serve), and with a static
    prefetch it occupies one of the replica's slots until it runs (docs/operations.md)."""

    def __init__(self, config: TaskProcessorConfig, *args: Any, **kwargs: Any) -> None:
        config = config.model_copy(deep=True)
        custom = config.adapter_config.app_custom_config or {}
        self._queue_arguments: dict[str, dict[str, Any]] = custom.pop(QUEUE_ARGUMENTS, None) or {}
        super().__init__(config, *args, **kwargs)

    def initialize(self, *args: Any, **kwargs: Any) -> None:
        super().initialize(*args, **kwargs)
        queues = {name: dict(options) for name, options in self._app.conf.task_queues.items()}
        for name, arguments in self._queue_arguments.items():
            if arguments and name in queues:
                queues[name]["queue_arguments"] = dict(arguments)
        self._app.conf.update(task_queues=queues)

    def publish(self, task_name: str, args: list[Any]) -> str:
        """Send one task and return its id once the broker confirmed it (``confirm_publish``), reading
        nothing back: Ray's ``enqueue_task_sync`` asks the result backend for the new task's status and
        result after each send (two backend reads per request, for a result vidx never stores)."""
        return str(self._app.send_task(task_name, args=args, queue=self._config.queue_name, ignore_result=True).id)


def task_processor_config(settings: Settings, queue: str | None = None) -> TaskProcessorConfig:
    """One definition of the queue, shared by producers (router, API) and the consumer. ``queue``:
    another task queue of the same shape (``serve.text_queue``); default: the index queue."""
    backend_url = settings.celery_backend_url
    if backend_url.startswith("file://"):
        Path(urlparse(backend_url).path).mkdir(parents=True, exist_ok=True)
    return TaskProcessorConfig(
        queue_name=queue or settings.serve.index_queue,
        adapter=f"{__name__}.{QueueArgumentsAdapter.__name__}",
        adapter_config=CeleryAdapterConfig(
            broker_url=settings.amqp.url.get_secret_value(),
            backend_url=backend_url,
            # A job counts as submitted only once the broker confirmed it.
            broker_transport_options={"confirm_publish": True},
            app_custom_config={
                "broker_connection_retry_on_startup": True,
                # One unacked task per worker thread: a task waiting behind long jobs must not outlive
                # RabbitMQ's consumer_timeout while it sits prefetched.
                "worker_prefetch_multiplier": 1,
                # A retry is a new publish; if it fails Celery rejects the task without requeueing it
                # (lost). Keep trying through a broker restart (~15 s here), bounded: 40 tries, ≤ 2 s apart.
                "task_publish_retry": True,
                "task_publish_retry_policy": {
                    "max_retries": 40,
                    "interval_start": 0.5,
                    "interval_step": 0.5,
                    "interval_max": 2.0,
                },
                # Notice a dead broker connection in seconds, not minutes (the default is 120 s).
                "broker_heartbeat": 10,
                QUEUE_ARGUMENTS: index_queue_arguments(settings, queue),
            },
            task_custom_config={
                # Permanent errors (corrupt file, over a limit) fail at once; the rest retry with backoff.
                "dont_autoretry_for": (PermanentError,),
                "retry_backoff": settings.serve.retry_backoff_s,
                # Outcomes live in the videos table; stored task results would only pile up.
                "ignore_result": True,
            },
        ),
        max_retries=settings.serve.max_retries,
        failed_task_queue_name=settings.serve.failed_queue,
        unprocessable_task_queue_name=settings.serve.unprocessable_queue,
    )


def index_queue_arguments(settings: Settings, queue: str | None = None) -> dict[str, dict[str, Any]]:
    """Declaration arguments of the task queues, by name. Quorum: all three replicated; the index
    queue (or ``queue``, the text queue) dead-letters a task delivered ``amqp.delivery_limit`` times to
    the failed queue, where ``vidx dlq`` lists it (reason ``delivery_limit`` in its ``x-death`` header)
    and can replay it."""
    base = settings.amqp.queue_arguments
    index = dict(base)
    if settings.amqp.queue_type == "quorum":
        index |= {
            "x-delivery-limit": settings.amqp.delivery_limit,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": settings.serve.failed_queue,
        }
    serve = settings.serve
    return {queue or serve.index_queue: index, serve.failed_queue: dict(base), serve.unprocessable_queue: dict(base)}


def dead_letter_queue(settings: Settings) -> DeadLetterQueue:
    """The failed queue of the index tasks, declared as the task queue's adapter declares it."""
    return DeadLetterQueue(
        settings.amqp.url.get_secret_value(), settings.serve.failed_queue, arguments=settings.amqp.queue_arguments
    )


def queueing_sink(
    settings: Settings,
    store: IndexStore,
    writes: CatalogWrites | None = None,
    *,
    deferred: bool = False,
    read_first: bool = True,
) -> QueueingSink:
    """The sink the API, repairs and replays submit through: submits, then marks ``queued`` (through
    ``writes``: by default one commit per mark). ``deferred`` (the API): the submit reads nothing and
    the marks are made on a thread (``pipeline.jobs.queued_marks``)."""
    states = VideoStates(store.catalog, writes)
    marks = None
    if deferred:
        from pipeline.jobs.queued_marks import DeferredMarks, VersionClock

        marks = DeferredMarks(states, VersionClock(store.catalog, settings.serve.api_version_refresh_s)).start()
    return QueueingSink(CeleryJobSink(settings), states, marks, read_first=read_first)


class CeleryJobSink:
    """Submits jobs to the index queue (or ``queue``); ``submit`` returns the task id once the broker has it."""

    def __init__(self, settings: Settings, queue: str | None = None) -> None:
        self._adapter: QueueArgumentsAdapter = instantiate_adapter_from_config(  # type: ignore[assignment]
            task_processor_config(settings, queue)
        )

    def submit(self, job: IndexJob) -> str:
        """Raises:
        TransientError: the broker didn't confirm the job.
        """
        # Never str(exc): connection errors may carry the broker URL, credentials included.
        try:
            return self._adapter.publish(INDEX_TASK, [job.model_dump(mode="json")])
        except amqp.exceptions.MessageNacked as exc:  # confirm_publish: the broker refused the job
            raise TransientError("task queue refused the job (broker nack)") from exc
        except TimeoutError as exc:  # socket.timeout: no confirm in time
            raise TransientError(f"task queue did not confirm the job in time: {type(exc).__name__}") from exc
        except (kombu.exceptions.KombuError, amqp.exceptions.AMQPError, OSError) as exc:
            raise TransientError(f"task queue unavailable: {type(exc).__name__}") from exc

    def status(self, task_id: str) -> dict[str, Any]:
        result = self._adapter.get_task_status_sync(task_id)
        return {"task_id": result.id, "state": result.status}
