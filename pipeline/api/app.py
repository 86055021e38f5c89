"""The HTTP contract (v1): the FastAPI app over plain services, its guards (``pipeline.api.guards``),
its error handlers (``pipeline.api.errors``) and one router per resource (``pipeline.api.routes``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI
from prometheus_client.metrics_core import Metric

from pipeline.api.errors import install_error_handlers
from pipeline.api.guards import install_guards
from pipeline.api.routes.index import JobSubmitter, index_router
from pipeline.api.routes.search import search_router
from pipeline.api.routes.status import status_router
from pipeline.api.routes.uploads import uploads_router
from pipeline.api.routes.videos import videos_router
from pipeline.api.routes.web import web_router
from pipeline.query.links import S3Links, media_signer
from pipeline.query.search import SearchService
from pipeline.settings import Settings
from storage.tables import IndexStore


def create_app(
    settings: Settings,
    search: SearchService,
    store: IndexStore,
    jobs: JobSubmitter,
    stats: Callable[[], Awaitable[dict[str, Any]]],
    admin: APIRouter | None = None,
    check_state: Callable[[], Awaitable[dict[str, Any]]] | None = None,
    replicas: Callable[[], Awaitable[dict[str, dict[str, int]]]] | None = None,
    queues: Callable[[], Awaitable[dict[str, int]]] | None = None,
    recorded: Callable[[], Awaitable[list[Metric]]] | None = None,
    links: S3Links | None = None,
    active_table: Callable[[], str] | None = None,
) -> FastAPI:
    """Build the API over its services (plain objects: testable without Ray). ``admin``: the
    ``/v1/admin`` routes (``pipeline.api.routes.admin``), guarded by the admin key; ``check_state``: the
    scheduled check's last round (``/v1/status``, ``/metrics``); ``replicas``: replicas by
    deployment and state, ``queues``: messages per queue role, ``recorded``: the metrics every
    replica recorded (all three ``/metrics``); ``links``: the presigned-link signer for uploads
    (the search's, to share one client); ``active_table``: the active model's frames table, where
    thumbnails are read (by default ``frames``)."""
    app = FastAPI(title="vidx", version="1", docs_url="/docs", redoc_url=None)
    install_guards(app, settings, media_signer(settings))
    install_error_handlers(app, settings.serve.retry_after_s)
    app.include_router(status_router(store, stats, check_state, replicas, queues, recorded))
    app.include_router(index_router(settings.s3.buckets, jobs))
    app.include_router(videos_router(settings.s3.buckets, store))
    app.include_router(search_router(settings, search, store, active_table))
    app.include_router(web_router(settings))
    app.include_router(uploads_router(settings, links or S3Links(settings.s3), store))
    if admin is not None:
        app.include_router(admin)
    return app
