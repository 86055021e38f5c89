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

from events.jobs import INDEX_TASK, IndexJob
from pipeline.index.videostate import QueueingSink, VideoStates
from pipeline.settings import Settings
from storage.catalog_writer import CatalogWrites
from storage.errors import PermanentError, TransientError
from storage.tables import IndexStore

log = logging.getLogger(__name__)


def task_processor_config(settings: Settings) -> TaskProcessorConfig:
    """One definition of the queue, shared by producers (router, API) and the consumer."""
    backend_url = settings.celery_backend_url
    if backend_url.startswith("file://"):
        Path(urlparse(backend_url).path).mkdir(parents=True, exist_ok=True)
    return TaskProcessorConfig(
        queue_name=settings.serve.index_queue,
        adapter="ray.serve.task_processor.CeleryTaskProcessorAdapter",
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
    the marks are made on a thread (``pipeline.index.queued_marks``)."""
    states = VideoStates(store.catalog, writes)
    marks = None
    if deferred:
        from pipeline.index.queued_marks import DeferredMarks, VersionClock

        marks = DeferredMarks(states, VersionClock(store.catalog, settings.serve.api_version_refresh_s)).start()
    return QueueingSink(CeleryJobSink(settings), states, marks, read_first=read_first)


class CeleryJobSink:
    """Submits jobs to the index queue; ``submit`` returns the task id once the broker has it."""

    def __init__(self, settings: Settings) -> None:
        self._adapter: Any = instantiate_adapter_from_config(task_processor_config(settings))

    def submit(self, job: IndexJob) -> str:
        """Raises:
        TransientError: the broker didn't confirm the job.
        """
        # Never str(exc): connection errors may carry the broker URL, credentials included.
        try:
            result = self._adapter.enqueue_task_sync(INDEX_TASK, args=[job.model_dump(mode="json")])
        except amqp.exceptions.MessageNacked as exc:  # confirm_publish: the broker refused the job
            raise TransientError("task queue refused the job (broker nack)") from exc
        except TimeoutError as exc:  # socket.timeout: no confirm in time
            raise TransientError(f"task queue did not confirm the job in time: {type(exc).__name__}") from exc
        except (kombu.exceptions.KombuError, amqp.exceptions.AMQPError, OSError) as exc:
            raise TransientError(f"task queue unavailable: {type(exc).__name__}") from exc
        return str(result.id)

    def status(self, task_id: str) -> dict[str, Any]:
        result = self._adapter.get_task_status_sync(task_id)
        return {"task_id": result.id, "state": result.status}
