"""The CatalogWriter deployment: one replica holding the cluster's ``SharedCatalogWriter``."""

from __future__ import annotations

from ray import serve

from pipeline.jobs.catalog_writes import SharedCatalogWriter
from pipeline.metrics import Metrics, RayBackend
from pipeline.serve.logs import route_logs_to_replica
from pipeline.settings import Settings
from storage.catalog import VideoRecord

#: Room for ``close`` (``storage.commits.catalog.CLOSE_TIMEOUT_S``) when the replica stops.
SHUTDOWN_TIMEOUT_S = 45.0


#: Serve asks the replica's ``check_health`` this often and replaces it when an answer takes longer
#: than the timeout (a frozen or wedged replica; one whose writer thread died or stopped moving fails
#: the check at once).
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 8.0


@serve.deployment(
    name="CatalogWriter",
    num_replicas=1,
    max_ongoing_requests=4096,
    graceful_shutdown_timeout_s=SHUTDOWN_TIMEOUT_S,
    health_check_period_s=HEALTH_CHECK_PERIOD_S,
    health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
)
class CatalogWriter:
    """Forwards every consumer's compare-and-set catalog writes to the one grouped writer."""

    def __init__(self, settings: Settings) -> None:
        route_logs_to_replica()
        self._writer = SharedCatalogWriter(settings)
        self._metrics = Metrics(RayBackend())
        self._commits_seen = 0

    async def write(self, record: VideoRecord, expected_rev: int) -> VideoRecord | None:
        """Raises:
        TransientError: the commit failed or gave no outcome in time.
        """
        return await self._writer.write(record, expected_rev)

    def check_health(self) -> None:
        """Raises:
        RuntimeError: the writer thread died or stopped moving: Serve replaces this replica.

        Healthy: records its liveness and the commits since the last check for ``/metrics``.
        """
        self._writer.check_health()
        commits = self._writer.stats()["commits"]
        self._metrics.catalog_commits(commits - self._commits_seen)
        self._commits_seen = commits
        self._metrics.service_ok("catalog-writer")

    def stats(self) -> dict[str, int]:
        return self._writer.stats()

    def __del__(self) -> None:
        writer = getattr(self, "_writer", None)  # absent when __init__ failed
        if writer is not None:
            writer.close()
