"""The Api deployment's plain objects over one index, wired from the settings, and the FastAPI app
they serve (``create_app``); the Serve shell passes in what only Ray can answer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI

from events.parked import ParkedQueue
from pipeline.api.app import create_app
from pipeline.api.node_metrics import NodeMetrics, QueueDepths, ray_node_endpoints
from pipeline.api.routes.admin import admin_router
from pipeline.jobs.catalog_writes import grouped_writer
from pipeline.jobs.taskqueue import dead_letter_queue, queueing_sink
from pipeline.metrics import Metrics
from pipeline.query.search import QueryEncoder, SearchService
from pipeline.reindex.lifecycle import DimOf, LiveModels, ModelLifecycle
from pipeline.settings import Settings
from pipeline.upkeep.check import build_checker
from storage.tables import IndexStore

#: An async answer the Api reads from another deployment or from Serve.
Answer = Callable[[], Awaitable[dict[str, Any]]]


class ApiService:
    """Search, job submission, queue depths and node metrics for the HTTP API. ``encoder`` embeds the
    queries; ``queue_depth(name)`` reads that queue's depth (ready + unacked); ``dim_of(model_id)``
    is a model's vector size (for the admin's model lifecycle)."""

    def __init__(
        self,
        settings: Settings,
        encoder: QueryEncoder,
        queue_depth: Callable[[str], Callable[[], int]],
        metrics: Metrics,
        dim_of: DimOf,
    ) -> None:
        self._settings = settings
        self._dim_of = dim_of
        self._store = IndexStore(settings.s3)
        self._live = LiveModels(self._store.models, settings.reindex.live_refresh_s)
        self._search = SearchService(
            settings,
            self._store,
            encoder,
            metrics=metrics,
            models=self._live,
        )
        # POST /v1/index answers once the broker has the job: its `queued` mark is made on a thread
        # and shares commits with the others.
        marks = grouped_writer(self._store.catalog, settings)
        self._sink = queueing_sink(settings, self._store, marks, deferred=True)
        # Repairs and replays submit in bulk: each reads its row first, no mark is dropped.
        self._bulk_sink = queueing_sink(settings, self._store, marks)
        a, s = settings.amqp, settings.serve
        queues = {"events": a.events_queue, "index": s.index_queue, "failed": s.failed_queue, "parked": a.parked_queue}
        if settings.text.on:  # the text jobs' backlog, while a text source is on
            queues["text"] = s.text_queue
        self._queues = QueueDepths({role: queue_depth(name) for role, name in queues.items()}, s.stats_timeout_s)
        self._node_metrics = NodeMetrics(ray_node_endpoints, s.metrics_node_timeout_s)

    def app(
        self,
        router_stats: Answer,
        check_state: Answer,
        replicas: Callable[[], Awaitable[dict[str, dict[str, int]]]],
    ) -> FastAPI:
        """The HTTP app: ``router_stats`` the EventRouter's counters, ``check_state`` the scheduled
        check's last round, ``replicas`` each deployment's replicas by state."""
        settings, store = self._settings, self._store
        checker = build_checker(settings, store, self._bulk_sink)
        admin = admin_router(
            settings.s3.buckets,
            dead_letter_queue(settings),
            ParkedQueue(settings.amqp),
            self._bulk_sink,
            lambda bucket, prefix, dry_run: checker.run([bucket], prefix=prefix, repair=not dry_run),
            lifecycle=ModelLifecycle(store, settings, self._dim_of),
        )
        return create_app(
            settings,
            self._search,
            store,
            self._sink,
            router_stats,
            admin,
            check_state,
            replicas=replicas,
            queues=self._queues,
            recorded=self._node_metrics.families if settings.serve.metrics_from_nodes else None,
            links=self._search.links,
            active_table=lambda: self._live.active().table,
        )
