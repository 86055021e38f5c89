"""What the app says of itself: ``GET /healthz`` (it can serve; no key), ``GET /v1/status`` (the
scheduled check, the background services, the videos by status) and ``GET /metrics``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from prometheus_client.metrics_core import Metric

from pipeline.api.guards import METRICS_PATH
from pipeline.api.prometheus import exposition
from storage.errors import TransientError
from storage.tables import IndexStore


def status_router(
    store: IndexStore,
    stats: Callable[[], Awaitable[dict[str, Any]]],
    check_state: Callable[[], Awaitable[dict[str, Any]]] | None = None,
    replicas: Callable[[], Awaitable[dict[str, dict[str, int]]]] | None = None,
    queues: Callable[[], Awaitable[dict[str, int]]] | None = None,
    recorded: Callable[[], Awaitable[list[Metric]]] | None = None,
) -> APIRouter:
    """The app's own routes over its readings (``pipeline.api.app.create_app`` names them): ``stats``
    the event router's counters, ``check_state`` the scheduled check's last round; ``replicas``,
    ``queues`` and ``recorded`` only for ``/metrics``."""
    router = APIRouter()

    @router.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get(METRICS_PATH)
    async def metrics() -> PlainTextResponse:
        text = await exposition(stats, check_state, replicas, queues, recorded)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @router.get("/v1/status")
    async def status() -> dict[str, Any]:
        """What the app knows of itself: the scheduled check's last round, each background service's
        liveness (alive, last success in epoch seconds) and the videos by status."""
        try:
            counts: dict[str, int] | None = await asyncio.to_thread(store.catalog.counts)
        except TransientError:  # the catalog blips: the rest of the status matters more now
            counts = None
        check = dict(await check_state()) if check_state is not None else None
        services = dict(check.pop("services", None) or {}) if check is not None else {}
        # The router's work is holding its broker connection: ok as of this answer while connected.
        connected = bool((await stats()).get("connected"))
        services["router"] = {"alive": connected, "last_ok": time.time() if connected else None}
        return {"check": check, "services": services, "videos": counts}

    return router
