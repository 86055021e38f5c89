"""The Api deployment: the HTTP ingress over one ``ApiService``; what only Ray can answer (other
deployments' state, replica counts) is read here, each bounded and never failing a scrape."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from pipeline.metrics import Metrics, RayBackend
from pipeline.serve.logs import route_logs_to_replica
from pipeline.settings import Settings

log = logging.getLogger(__name__)


@serve.deployment(name="Api")
@serve.ingress()
class Api:
    """The HTTP ingress. Routes live in ``pipeline.api.routes`` (one router per resource, included by
    ``pipeline.api.app.create_app``), wiring in ``pipeline.api.service``."""

    def __init__(
        self,
        settings: Settings,
        encoder: DeploymentHandle,
        router: DeploymentHandle,
        upkeep: DeploymentHandle,
        consumer: DeploymentHandle,
        text_consumer: DeploymentHandle | None = None,
    ) -> None:
        from pipeline.api.service import ApiService
        from pipeline.embedding.config import model_dim
        from pipeline.embedding.encoders import HandleQueryEncoder
        from pipeline.serve.autoscale import management_queue_depth

        route_logs_to_replica()
        self._settings = settings
        a = settings.amqp
        queue_depth = functools.partial(
            management_queue_depth, a.url.get_secret_value(), a.management_url, timeout_s=settings.serve.stats_timeout_s
        )
        queries = HandleQueryEncoder(encoder, settings.model.query_timeout_s)
        self._service = ApiService(settings, queries, queue_depth, Metrics(RayBackend()), model_dim)
        self._router = router
        self._upkeep = upkeep
        # Held so the consumer is part of the app graph (it takes work from the queue, not from here).
        self._consumer = consumer
        self._text_consumer = text_consumer

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
                self._upkeep.check_state.remote(), self._settings.serve.stats_timeout_s
            )
        except Exception:  # the upkeep replica restarting must not take /metrics down
            log.warning("scheduled check state unavailable", exc_info=True)
            return {"rounds": 0, "leader": False, "last": None, "last_error": "the upkeep deployment did not answer"}
        return state

    def __serve_build_asgi_app__(self) -> Any:
        return self._service.app(self._stats, self._check_state, self._replicas)
