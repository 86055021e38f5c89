"""The Upkeep deployment: one replica holding ``UpkeepServices`` (the model preflight, index
maintenance, the backfill coordinator, the text backfill and the scheduled check), apart from the event
router so each shows under its own name in Serve's status, the metrics and the logs."""

from __future__ import annotations

from typing import Any

from ray import serve

from pipeline.metrics import Metrics, RayBackend
from pipeline.serve.logs import route_logs_to_replica
from pipeline.settings import Settings


@serve.deployment(name="Upkeep", num_replicas=1)
class Upkeep:
    """Starts the upkeep services and answers the scheduled check's state."""

    def __init__(self, settings: Settings) -> None:
        from pipeline.embedding.config import model_dim
        from pipeline.upkeep.service import UpkeepServices

        route_logs_to_replica()
        self._services = UpkeepServices.from_settings(settings, Metrics(RayBackend()), model_dim)
        self._services.start()

    def check_state(self) -> dict[str, Any]:
        """The scheduled check's last round, and each service's liveness under ``services``
        (``vidx status``, ``/v1/status``, ``/metrics``)."""
        return {**self._services.check_state(), "services": self._services.services_state()}

    def running(self) -> dict[str, bool]:
        """Each service's name and whether its thread is alive."""
        return self._services.running()

    def check_health(self) -> None:
        """Serve replaces the replica when a service's thread has ended (their loops survive failing
        rounds, so only a bug ends one)."""
        self._services.services_state()  # records each service's last success for /metrics
        stopped = [name for name, alive in self._services.running().items() if not alive]
        if stopped:
            raise RuntimeError(f"upkeep services stopped: {', '.join(stopped)}")

    def __del__(self) -> None:
        services = getattr(self, "_services", None)  # absent when __init__ failed
        if services is not None:
            services.stop()
