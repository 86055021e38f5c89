"""Ray Serve deployments: thin shells that each hold one plain object, and the app graph.

Api (FastAPI ingress) ──► Encoder (SigLIP, @serve.batch for images and texts)
EventRouter (pika consumer thread) ──► index queue (RabbitMQ, Celery adapter)
IndexConsumer (@task_consumer) ──► Encoder, LanceDB on S3
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.task_consumer import task_consumer, task_handler

from events.jobs import INDEX_TASK
from pipeline.settings import ModelSettings, Settings
from pipeline.taskqueue import CeleryJobSink, queueing_sink, task_processor_config
from storage.errors import EncoderUnavailable

log = logging.getLogger(__name__)


#: vidx's own loggers: their INFO lines (one per job, with outcome and stage times) belong in the logs.
PACKAGE_LOGGERS = ("pipeline", "events", "storage")


def route_logs_to_replica(level: int = logging.INFO) -> None:
    """Send vidx's log lines to the replica's log file: Ray Serve configures only the ``ray.serve``
    logger in a replica, so without this INFO lines of other loggers are dropped."""
    serve_logger = logging.getLogger("ray.serve")
    for name in PACKAGE_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        for handler in serve_logger.handlers:
            if handler not in logger.handlers:
                logger.addHandler(handler)
        logger.propagate = not serve_logger.handlers


@serve.deployment(name="Encoder", max_ongoing_requests=256)
class Encoder:
    """SigLIP image and text towers; concurrent calls are gathered into batches."""

    def __init__(self, model: ModelSettings) -> None:
        from pipeline.embed import SiglipEncoder  # torch is imported only where the model runs

        route_logs_to_replica()

        self._encoder = SiglipEncoder(model)
        self.embed_image.set_max_batch_size(model.max_batch_size)  # type: ignore[attr-defined]
        self.embed_image.set_batch_wait_timeout_s(model.batch_wait_timeout_s)  # type: ignore[attr-defined]
        self.embed_text.set_max_batch_size(model.max_batch_size)  # type: ignore[attr-defined]
        self.embed_text.set_batch_wait_timeout_s(model.batch_wait_timeout_s)  # type: ignore[attr-defined]

    def info(self) -> dict[str, Any]:
        return {"model_id": self._encoder.model_id, "dim": self._encoder.dim}

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.02)
    async def embed_image(self, images: list[NDArray[np.uint8]]) -> list[NDArray[np.float32]]:
        vectors = await asyncio.to_thread(self._encoder.embed_images, images)
        return list(vectors)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.02)
    async def embed_text(self, texts: list[str]) -> list[NDArray[np.float32]]:
        vectors = await asyncio.to_thread(self._encoder.embed_texts, texts)
        return list(vectors)


class HandleEmbedder:
    """``FrameEmbedder`` over the Encoder deployment, for synchronous callers (Celery threads): one
    call per frame, all in flight together, so the encoder batches them with other videos' frames.
    One deadline covers the whole chunk: the wait for each frame is what is left of it."""

    def __init__(self, encoder: DeploymentHandle, model_id: str, timeout_s: float = 300.0) -> None:
        self._encoder = encoder
        self._model_id = model_id
        self._timeout_s = timeout_s

    @property
    def model_id(self) -> str:
        return self._model_id

    def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]:
        deadline = time.monotonic() + self._timeout_s
        responses = [self._encoder.embed_image.remote(image) for image in images]
        try:
            return np.stack([r.result(timeout_s=max(0.0, deadline - time.monotonic())) for r in responses])
        except Exception as exc:  # Ray raises actor/timeout errors of many types here
            for response in responses:
                response.cancel()
            raise EncoderUnavailable(
                f"encoder call failed: {type(exc).__name__} ({len(images)} frames, deadline {self._timeout_s:g}s)"
            ) from exc


class HandleQueryEncoder:
    """``QueryEncoder`` over the Encoder deployment, for the async API; each call bounded in time."""

    def __init__(self, encoder: DeploymentHandle, timeout_s: float) -> None:
        self._encoder = encoder
        self._timeout_s = timeout_s

    async def _call(self, response: Any) -> NDArray[np.float32]:
        try:
            vector: NDArray[np.float32] = await asyncio.wait_for(response, self._timeout_s)
        except Exception as exc:  # timeouts and Ray's actor/replica errors alike: the encoder is not serving
            raise EncoderUnavailable(f"encoder did not answer: {type(exc).__name__}") from exc
        return vector

    async def embed_text(self, text: str) -> NDArray[np.float32]:
        return await self._call(self._encoder.embed_text.remote(text))

    async def embed_image(self, rgb: NDArray[np.uint8]) -> NDArray[np.float32]:
        return await self._call(self._encoder.embed_image.remote(rgb))


def consumer_deployment(settings: Settings) -> Any:
    """The IndexConsumer class, decorated with the task-processor config built from ``settings``."""

    @serve.deployment(
        name="IndexConsumer",
        num_replicas=settings.serve.consumer_replicas,
        max_ongoing_requests=settings.serve.consumer_concurrency,
        ray_actor_options={"num_cpus": settings.serve.consumer_num_cpus},
    )
    @task_consumer(task_processor_config=task_processor_config(settings))
    class IndexConsumer:
        def __init__(self, settings: Settings, encoder: DeploymentHandle) -> None:
            from pipeline.consumer import IndexTaskHandler
            from pipeline.deadletters import DeadLetterQueue
            from pipeline.holders import holder_alive, process_holder
            from pipeline.indexer import Indexer
            from storage.tables import IndexStore
            from storage.writer import GroupedFrameWriter

            route_logs_to_replica()
            store = IndexStore(settings.s3)
            # The Celery threads of this replica share frame commits; each task is acked only after
            # the commit holding its rows.
            w = settings.writer
            writer = GroupedFrameWriter(
                store.frames,
                max_videos=w.group_max_videos,
                max_rows=w.group_max_rows,
                wait_s=w.group_wait_s,
                commit_timeout_s=w.commit_timeout_s,
            )
            embedder = HandleEmbedder(encoder, settings.model.id, settings.model.embed_timeout_s)
            indexer = Indexer(
                settings, embedder, store, writer=writer, holder=process_holder(), holder_alive=holder_alive
            )
            dead_letters = DeadLetterQueue(settings.amqp.url.get_secret_value(), settings.serve.failed_queue)
            self._handler = IndexTaskHandler(indexer, dead_letters, settings.serve.max_retries)

        @task_handler(name=INDEX_TASK)
        def index_video(self, job: dict[str, Any]) -> dict[str, Any]:
            from celery import current_task

            from pipeline.consumer import TaskContext

            request = current_task.request
            delivery = getattr(request, "delivery_info", None) or {}
            context = TaskContext(
                task_id=str(request.id),
                retries=int(getattr(request, "retries", 0) or 0),
                redelivered=bool(delivery.get("redelivered", False)),
            )
            return self._handler.handle(job, context)

    return IndexConsumer


@serve.deployment(name="EventRouter", num_replicas=1)
class EventRouterDeployment:
    """Runs the EventRouter's pika loop in a thread; Serve restarts the replica if it dies."""

    def __init__(self, settings: Settings) -> None:
        from events.router import EventRouter
        from storage.tables import IndexStore

        route_logs_to_replica()
        self._router = EventRouter(settings.amqp, settings.videos, CeleryJobSink(settings), buckets=settings.s3.buckets)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._router.run, args=(self._stop,), name="event-router", daemon=True)
        self._thread.start()
        # The one place index maintenance and the scheduled check run (this deployment has a single
        # replica); the leases they take in the index database cover the overlap while Serve replaces it.
        from pipeline.check import build_checker
        from pipeline.scheduled_check import ScheduledCheck
        from storage.maintenance import IndexMaintainer

        store = IndexStore(settings.s3)
        _, self._maintenance_stop = IndexMaintainer(store, settings.index).start()
        c = settings.check
        self._check = ScheduledCheck(
            build_checker(settings, store, queueing_sink(settings, store)),
            store.leases,
            settings.s3.buckets,
            interval_s=c.interval_s,
            objects_per_round=c.objects_per_round,
            lease_ttl_s=c.lease_ttl_s,
            repair=c.repair,
        )
        self._check_stop = threading.Event()
        if c.interval_s > 0:
            _, self._check_stop = self._check.start()

    def stats(self) -> dict[str, int]:
        return {**self._router.stats, "connected": int(self._router.connected)}

    def check_state(self) -> dict[str, Any]:
        """The scheduled check's last round (``vidx status``, ``/metrics``)."""
        return self._check.state.as_json()

    def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("event router thread stopped")

    def __del__(self) -> None:
        self._stop.set()
        self._maintenance_stop.set()
        self._check_stop.set()


@serve.deployment(name="Api")
@serve.ingress()
class Api:
    """The HTTP ingress. Routes live in ``pipeline.api.create_app``."""

    def __init__(
        self, settings: Settings, encoder: DeploymentHandle, router: DeploymentHandle, consumer: DeploymentHandle
    ) -> None:
        from pipeline.search import SearchService
        from storage.tables import IndexStore

        route_logs_to_replica()
        self._settings = settings
        self._store = IndexStore(settings.s3)
        self._search = SearchService(settings, self._store, HandleQueryEncoder(encoder, settings.model.query_timeout_s))
        self._sink = queueing_sink(settings, self._store)
        self._router = router
        # Held so the consumer is part of the app graph (it takes work from the queue, not from here).
        self._consumer = consumer

    async def _stats(self) -> dict[str, Any]:
        try:
            stats: dict[str, Any] = await asyncio.wait_for(
                self._router.stats.remote(), self._settings.serve.stats_timeout_s
            )
        except Exception:  # the router restarting must not take /metrics down
            log.warning("event router counters unavailable", exc_info=True)
            return {"connected": 0}
        return stats

    async def _check_state(self) -> dict[str, Any]:
        try:
            state: dict[str, Any] = await asyncio.wait_for(
                self._router.check_state.remote(), self._settings.serve.stats_timeout_s
            )
        except Exception:  # the router restarting must not take /metrics down
            log.warning("scheduled check state unavailable", exc_info=True)
            return {"rounds": 0, "leader": False, "last": None, "last_error": "the event router did not answer"}
        return state

    def __serve_build_asgi_app__(self) -> Any:
        from events.parked import ParkedQueue
        from pipeline.api import create_app
        from pipeline.api_admin import admin_router
        from pipeline.check import build_checker
        from pipeline.deadletters import DeadLetterQueue

        settings, store = self._settings, self._store
        checker = build_checker(settings, store, self._sink)
        admin = admin_router(
            settings.s3.buckets,
            DeadLetterQueue(settings.amqp.url.get_secret_value(), settings.serve.failed_queue),
            ParkedQueue(settings.amqp),
            self._sink,
            lambda bucket, prefix, dry_run: checker.run([bucket], prefix=prefix, repair=not dry_run),
        )
        return create_app(settings, self._search, store, self._sink, self._stats, admin, self._check_state)


def _cluster_gpus() -> float:
    """One GPU for the Encoder when the Ray cluster has any (Ray schedules it onto a GPU node)."""
    import ray

    return 1.0 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1 else 0.0


def build_app(settings: Settings) -> Any:
    """The vidx application graph, ready for ``serve.run``."""
    s = settings.serve
    num_gpus = s.encoder_num_gpus if s.encoder_num_gpus is not None else _cluster_gpus()
    # serve.deployment returns a Deployment; its decorators are untyped, hence the ignores.
    encoder = Encoder.options(  # type: ignore[attr-defined]
        num_replicas=s.encoder_replicas,
        ray_actor_options={"num_cpus": s.encoder_num_cpus, "num_gpus": num_gpus},
    ).bind(settings.model)
    consumer = consumer_deployment(settings).bind(settings, encoder)
    router = EventRouterDeployment.options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": s.router_num_cpus}
    ).bind(settings)
    api = Api.options(ray_actor_options={"num_cpus": s.api_num_cpus})  # type: ignore[attr-defined]
    return api.bind(settings, encoder, router, consumer)
