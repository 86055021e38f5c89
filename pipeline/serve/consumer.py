"""The IndexConsumer deployment: Ray Serve's task consumer on the index queue, forwarding each task
to its replica's ``IndexTaskHandler`` (``pipeline.index.replica``); and the TextConsumer, the same on
the text queue with its own replicas and CPUs (it exists only while a text source is on)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.task_consumer import task_consumer, task_handler

from events.jobs import INDEX_TASK
from pipeline.jobs.taskqueue import task_processor_config
from pipeline.serve.autoscale import replica_options
from pipeline.serve.logs import logging_config, route_logs_to_replica
from pipeline.serve.resources import SHUTDOWN_MARGIN_S, niced_while_starting
from pipeline.settings import Settings

if TYPE_CHECKING:
    from pipeline.index.consumer import TaskContext

log = logging.getLogger(__name__)

#: The deployments' names in Serve's status, the metrics and the replicas' log files.
NAME = "IndexConsumer"
TEXT_NAME = "TextConsumer"


def consumer_deployment(settings: Settings, num_gpus: float = 0.0, *, text: bool = False) -> Any:
    """The IndexConsumer class (``text``: the TextConsumer), decorated with the task-processor config
    built from ``settings``."""
    s = settings.serve
    if text:
        name, queue, concurrency, cpus = TEXT_NAME, s.text_queue, s.text_consumer_concurrency, s.text_consumer_num_cpus
    else:
        name, queue, concurrency, cpus = NAME, s.index_queue, s.consumer_concurrency, s.consumer_num_cpus
    replicas = replica_options(settings, name)

    @serve.deployment(
        name=name,
        max_ongoing_requests=concurrency,
        # Room for __del__ to drain the running tasks (Celery's warm shutdown stops new ones first).
        graceful_shutdown_timeout_s=s.drain_timeout_s + SHUTDOWN_MARGIN_S,
        ray_actor_options={"num_cpus": cpus, "num_gpus": num_gpus},
        logging_config=logging_config(s.log_encoding, s.access_log),
        **replicas,
    )
    @task_consumer(task_processor_config=task_processor_config(settings, queue))
    class IndexConsumer:
        def __init__(
            self, settings: Settings, encoder: DeploymentHandle, catalog_writer: DeploymentHandle | None = None
        ) -> None:
            with niced_while_starting(settings.serve.consumer_start_nice):  # the imports and set-up below
                from pipeline.index.replica import consumer_handler, start_decoders
                from pipeline.metrics import Metrics, RayBackend

                route_logs_to_replica()
                self._handler = consumer_handler(settings, encoder, catalog_writer, Metrics(RayBackend()))
            start_decoders(settings, text=text)  # at the replica's own niceness: see its docstring
            self._drain_timeout_s = settings.serve.drain_timeout_s

        def __del__(self) -> None:
            # Runs after the task consumer's own __del__ asked Celery for a warm shutdown.
            handler = getattr(self, "_handler", None)  # absent when __init__ failed
            if handler is None:
                return
            left = handler.drain(self._drain_timeout_s)
            if left:
                log.warning("consumer stopping with %d tasks still running (they will be redelivered)", left)

        def check_health(self) -> None:
            """Raises:
            RuntimeError: a frame writer of this replica died or stopped moving: Serve replaces it.
            """
            self._handler.check_health()

        @task_handler(name=INDEX_TASK)
        def index_video(self, job: dict[str, Any]) -> dict[str, Any]:
            return self._handler.handle(job, _current_task_context())

    return IndexConsumer


def _current_task_context() -> TaskContext:
    """What Celery knows of the task being run: its id, its retries, whether the broker redelivered it."""
    from celery import current_task

    from pipeline.index.consumer import TaskContext

    request = current_task.request
    delivery = getattr(request, "delivery_info", None) or {}
    return TaskContext(
        task_id=str(request.id),
        retries=int(getattr(request, "retries", 0) or 0),
        redelivered=bool(delivery.get("redelivered", False)),
    )
