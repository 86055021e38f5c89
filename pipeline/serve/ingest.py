"""The EventRouter deployment: one replica holding the ``EventIntake`` (bucket events to index jobs);
Serve restarts the replica if its router thread dies."""

from __future__ import annotations

from ray import serve

from pipeline.metrics import Metrics, RayBackend
from pipeline.serve.logs import route_logs_to_replica
from pipeline.settings import Settings


@serve.deployment(name="EventRouter", num_replicas=1)
class EventRouterDeployment:
    """Routes bucket events: starts the intake (after the model preflight) and reports its counters."""

    def __init__(self, settings: Settings) -> None:
        from pipeline.embedding.config import model_dim
        from pipeline.index.intake import EventIntake

        route_logs_to_replica()
        self._metrics = Metrics(RayBackend())
        self._intake = EventIntake.from_settings(settings, self._metrics, model_dim)
        self._intake.start()

    def stats(self) -> dict[str, int]:
        return self._intake.stats()

    def check_health(self) -> None:
        """Raises RuntimeError when the router thread stopped (Serve replaces the replica); while it
        runs connected to the broker, records the router's liveness for ``/metrics``."""
        if not self._intake.alive:
            raise RuntimeError("event router thread stopped")
        if self._intake.stats().get("connected"):
            self._metrics.service_ok("router")

    def __del__(self) -> None:
        intake = getattr(self, "_intake", None)  # absent when __init__ failed
        if intake is not None:
            intake.stop()
