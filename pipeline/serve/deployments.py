"""Ray Serve deployments: thin shells that each hold one plain object, and the app graph.

Api (FastAPI ingress) ──► Encoder (SigLIP, @serve.batch for images, texts and frame chunks)
EventRouter (pika consumer thread) ──► index queue (RabbitMQ, Celery adapter)
IndexConsumer (@task_consumer, scaled on queue depth) ──► Encoder (``split``) or its own model
(``fused``), LanceDB on S3
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.task_consumer import task_consumer, task_handler

from events.jobs import INDEX_TASK
from pipeline.embedding.encoders import Encoder, HandleEmbedders, HandleQueryEncoder
from pipeline.index.catalog_writes import CatalogWriter
from pipeline.index.taskqueue import CeleryJobSink, queueing_sink, task_processor_config
from pipeline.metrics import Metrics, RayBackend
from pipeline.serve.autoscale import replica_options
from pipeline.serve.logs import logging_config, route_logs_to_replica
from pipeline.settings import Settings

log = logging.getLogger(__name__)

#: GPU share of the Encoder and of each consumer replica in the ``fused`` layout when the cluster
#: has a GPU: the query Encoder and up to four consumers fit on one.
FUSED_GPU_SHARE = 0.2
#: Seconds a stopping consumer replica gets beyond its drain: Celery's warm shutdown (Ray's
#: ``stop_consumer`` waits 10 s for it) comes first.
SHUTDOWN_MARGIN_S = 15.0


def _cluster_has_gpu() -> bool:
    import ray

    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1


def gpu_shares(settings: Settings, cluster_has_gpu: bool) -> tuple[float, float]:
    """GPUs the Encoder and each consumer replica reserve: the settings when set, else by layout
    (``split``: the Encoder takes a GPU; ``fused``: all share one, ``FUSED_GPU_SHARE`` each)."""
    s = settings.serve
    fused = s.layout == "fused"
    default_encoder = (FUSED_GPU_SHARE if fused else 1.0) if cluster_has_gpu else 0.0
    default_consumer = FUSED_GPU_SHARE if fused and cluster_has_gpu else 0.0
    encoder = s.encoder_num_gpus if s.encoder_num_gpus is not None else default_encoder
    return encoder, s.consumer_num_gpus if s.consumer_num_gpus is not None else default_consumer


def consumer_deployment(settings: Settings, num_gpus: float = 0.0) -> Any:
    """The IndexConsumer class, decorated with the task-processor config built from ``settings``."""

    @serve.deployment(
        name="IndexConsumer",
        max_ongoing_requests=settings.serve.consumer_concurrency,
        # Room for __del__ to drain the running tasks (Celery's warm shutdown stops new ones first).
        graceful_shutdown_timeout_s=settings.serve.drain_timeout_s + SHUTDOWN_MARGIN_S,
        ray_actor_options={"num_cpus": settings.serve.consumer_num_cpus, "num_gpus": num_gpus},
        logging_config=logging_config(settings.serve.log_encoding),
        **replica_options(settings, "IndexConsumer"),
    )
    @task_consumer(task_processor_config=task_processor_config(settings))
    class IndexConsumer:
        def __init__(
            self, settings: Settings, encoder: DeploymentHandle, catalog_writer: DeploymentHandle | None = None
        ) -> None:
            from events.deadletters import DeadLetterQueue
            from pipeline.index.catalog_writes import HandleCatalogWrites
            from pipeline.index.consumer import IndexTaskHandler
            from pipeline.index.holders import holder_alive, process_holder
            from pipeline.index.indexer import Embedders, Indexer
            from pipeline.reindex.lifecycle import LiveModels
            from storage.tables import IndexStore
            from storage.writer import GroupedFrameWriter

            route_logs_to_replica()
            metrics = Metrics(RayBackend())
            store = IndexStore(settings.s3)
            live = LiveModels(store.models, settings.reindex.live_refresh_s)
            # The Celery threads of this replica share frame commits (one writer per model's table);
            # each task is acked only after the commit holding its rows.
            w = settings.writer
            writers: dict[str, GroupedFrameWriter] = {}
            writers_lock = threading.Lock()

            def writer_for(table: str) -> GroupedFrameWriter:
                with writers_lock:
                    if table not in writers:
                        writers[table] = GroupedFrameWriter(
                            store.frames_table(table),
                            max_videos=w.group_max_videos,
                            max_rows=w.group_max_rows,
                            wait_s=w.group_wait_s,
                            commit_timeout_s=w.commit_timeout_s,
                        )
                    return writers[table]

            embedders: Embedders
            if settings.serve.layout == "fused":
                from pipeline.embedding.encoders import PoolEmbedders
                from pipeline.embedding.pool import ModelPool

                embedders = PoolEmbedders(ModelPool(settings.model))
            else:
                embedders = HandleEmbedders(encoder, settings.model.embed_timeout_s)
            indexer = Indexer(
                settings,
                embedders.for_model(settings.model.id),
                store,
                # The cluster's one catalog writer groups every replica's status writes into few commits.
                catalog_writes=HandleCatalogWrites(catalog_writer) if catalog_writer is not None else None,
                holder=process_holder(),
                holder_alive=holder_alive,
                metrics=metrics,
                models=live.live,
                models_now=live.live_now,
                embedders=embedders,
                writer_for=writer_for,
            )
            dead_letters = DeadLetterQueue(settings.amqp.url.get_secret_value(), settings.serve.failed_queue)
            self._handler = IndexTaskHandler(indexer, dead_letters, settings.serve.max_retries, metrics)
            self._drain_timeout_s = settings.serve.drain_timeout_s

        def __del__(self) -> None:
            # Runs after the task consumer's own __del__ asked Celery for a warm shutdown.
            handler = getattr(self, "_handler", None)  # absent when __init__ failed
            if handler is None:
                return
            left = handler.drain(self._drain_timeout_s)
            if left:
                log.warning("consumer stopping with %d tasks still running (they will be redelivered)", left)

        @task_handler(name=INDEX_TASK)
        def index_video(self, job: dict[str, Any]) -> dict[str, Any]:
            from celery import current_task

            from pipeline.index.consumer import TaskContext

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
        from pipeline.embedding.config import model_dim
        from pipeline.reindex.lifecycle import ModelLifecycle
        from storage.tables import IndexStore

        route_logs_to_replica()
        store = IndexStore(settings.s3)
        # The configured model against the index's, before any event is taken (a disagreement fails
        # the deploy with what to do); an empty index gets its first model here.
        ModelLifecycle(store, settings, model_dim).preflight()
        metrics = Metrics(RayBackend())
        self._router = EventRouter(
            settings.amqp,
            settings.videos,
            CeleryJobSink(settings),
            buckets=settings.s3.buckets,
            on_count=metrics.bucket_event,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._router.run, args=(self._stop,), name="event-router", daemon=True)
        self._thread.start()
        # The one place index maintenance and the scheduled check run (this deployment has a single
        # replica); the leases they take in the index database cover the overlap while Serve replaces it.
        from pipeline.reindex.backfill import BackfillCoordinator
        from pipeline.reindex.lifecycle import LiveModels
        from pipeline.upkeep.check import build_checker
        from pipeline.upkeep.scheduled import ScheduledCheck
        from storage.maintenance import IndexMaintainer

        live = LiveModels(store.models, settings.reindex.live_refresh_s)
        maintainer = IndexMaintainer(store, settings.index, tables=lambda: [t.table for t in live.live()])
        _, self._maintenance_stop = maintainer.start()
        r = settings.reindex
        self._backfill = BackfillCoordinator(
            store,
            CeleryJobSink(settings),
            interval_s=r.interval_s,
            max_outstanding=r.max_outstanding,
            resubmit_after_s=r.resubmit_after_s,
            lease_ttl_s=r.lease_ttl_s,
            sweep_s=r.sweep_s,
            ann_min_rows=settings.index.ann_min_rows,
            index_wait_s=r.index_wait_s,
        )
        _, self._backfill_stop = self._backfill.start()
        c = settings.check
        self._check = ScheduledCheck(
            build_checker(settings, store, queueing_sink(settings, store)),
            store.leases,
            settings.s3.buckets,
            interval_s=c.interval_s,
            objects_per_round=c.objects_per_round,
            lease_ttl_s=c.lease_ttl_s,
            repair=c.repair,
            metrics=metrics,
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
        for stop in ("_maintenance_stop", "_check_stop", "_backfill_stop"):
            if hasattr(self, stop):
                getattr(self, stop).set()


@serve.deployment(name="Api")
@serve.ingress()
class Api:
    """The HTTP ingress. Routes live in ``pipeline.api.app.create_app``."""

    def __init__(
        self, settings: Settings, encoder: DeploymentHandle, router: DeploymentHandle, consumer: DeploymentHandle
    ) -> None:
        from pipeline.query.search import SearchService
        from storage.tables import IndexStore

        route_logs_to_replica()
        self._settings = settings
        self._store = IndexStore(settings.s3)
        from pipeline.reindex.lifecycle import LiveModels

        self._live = LiveModels(self._store.models, settings.reindex.live_refresh_s)
        self._search = SearchService(
            settings,
            self._store,
            HandleQueryEncoder(encoder, settings.model.query_timeout_s),
            metrics=Metrics(RayBackend()),
            models=self._live,
        )
        from storage.catalog_writer import GroupedCatalogWriter

        # POST /v1/index answers once the broker has the job: its `queued` mark is made on a thread
        # and shares commits with the others.
        w = settings.writer
        marks = GroupedCatalogWriter(
            self._store.catalog, min_interval_s=w.catalog_min_interval_s, max_writes=w.catalog_max_writes
        )
        self._sink = queueing_sink(settings, self._store, marks, deferred=True)
        # Repairs and replays submit in bulk: each reads its row first, no mark is dropped.
        self._bulk_sink = queueing_sink(settings, self._store, marks)
        self._router = router
        # Held so the consumer is part of the app graph (it takes work from the queue, not from here).
        self._consumer = consumer
        from pipeline.serve.autoscale import management_queue_depth

        a, s = settings.amqp, settings.serve
        queues = {"events": a.events_queue, "index": s.index_queue, "failed": s.failed_queue, "parked": a.parked_queue}
        readers = {
            role: management_queue_depth(a.url.get_secret_value(), a.management_url, name, s.stats_timeout_s)
            for role, name in queues.items()
        }
        from pipeline.api.node_metrics import NodeMetrics, QueueDepths, ray_node_endpoints

        self._queues = QueueDepths(readers, s.stats_timeout_s)

        self._node_metrics = NodeMetrics(ray_node_endpoints, s.metrics_node_timeout_s)

    async def _replicas(self) -> dict[str, dict[str, int]]:
        """Replicas of each deployment of this app by state (``serve.status()``); {} when unknown."""
        name = self._settings.serve.app_name
        try:
            status = await asyncio.wait_for(asyncio.to_thread(serve.status), self._settings.serve.stats_timeout_s)
            deployments = status.applications[name].deployments
        except Exception:  # the controller busy or restarting must not take /metrics down
            log.warning("replica counts unavailable", exc_info=True)
            return {}
        return {
            d: {str(getattr(k, "value", k)): n for k, n in o.replica_states.items()} for d, o in deployments.items()
        }

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
        from events.deadletters import DeadLetterQueue
        from events.parked import ParkedQueue
        from pipeline.api.admin import admin_router
        from pipeline.api.app import create_app
        from pipeline.embedding.config import model_dim
        from pipeline.reindex.lifecycle import ModelLifecycle
        from pipeline.upkeep.check import build_checker

        settings, store = self._settings, self._store
        checker = build_checker(settings, store, self._bulk_sink)
        admin = admin_router(
            settings.s3.buckets,
            DeadLetterQueue(settings.amqp.url.get_secret_value(), settings.serve.failed_queue),
            ParkedQueue(settings.amqp),
            self._bulk_sink,
            lambda bucket, prefix, dry_run: checker.run([bucket], prefix=prefix, repair=not dry_run),
            lifecycle=ModelLifecycle(store, settings, model_dim),
        )
        return create_app(
            settings,
            self._search,
            store,
            self._sink,
            self._stats,
            admin,
            self._check_state,
            replicas=self._replicas,
            queues=self._queues,
            recorded=self._node_metrics.families if settings.serve.metrics_from_nodes else None,
            links=self._search.links,
            active_table=lambda: self._live.active().table,
        )


def build_app(settings: Settings) -> Any:
    """The vidx application graph, ready for ``serve.run``."""
    from ray.serve.config import BackpressureConfig

    s = settings.serve
    logs = logging_config(s.log_encoding)
    encoder_gpus, consumer_gpus = gpu_shares(settings, _cluster_has_gpu())
    # serve.deployment returns a Deployment; its decorators are untyped, hence the ignores.
    encoder = Encoder.options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": s.encoder_num_cpus, "num_gpus": encoder_gpus},
        logging_config=logs,
        **replica_options(settings, "Encoder"),
    ).bind(settings.model, settings.s3)
    catalog_writer = (
        CatalogWriter.options(ray_actor_options={"num_cpus": s.router_num_cpus}, logging_config=logs).bind(settings)  # type: ignore[attr-defined]
        if settings.writer.catalog_grouped
        else None
    )
    consumer = consumer_deployment(settings, consumer_gpus).bind(settings, encoder, catalog_writer)
    router = EventRouterDeployment.options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": s.router_num_cpus}, logging_config=logs
    ).bind(settings)
    # Past max_queued_requests the proxy answers 503 itself; the app sheds earlier (api_max_in_flight).
    api = Api.options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": s.api_num_cpus},
        max_ongoing_requests=s.api_max_ongoing_requests,
        max_queued_requests=s.api_max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=s.retry_after_s),
        logging_config=logs,
    )
    return api.bind(settings, encoder, router, consumer)
