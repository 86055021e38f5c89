"""The cluster's catalog writes in one place: ``SharedCatalogWriter`` (what the one-replica
CatalogWriter deployment holds, over ``storage.commits.catalog.GroupedCatalogWriter``) and the handle
every consumer writes through.

One writer for the whole fleet keeps the catalog's commit rate fixed however many consumers run:
more consumers make each commit carry more videos, not more commits (docs/design/state-machine.md).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from pipeline.settings import Settings
from storage.catalog import Catalog, VideoRecord
from storage.commits.catalog import GroupedCatalogWriter
from storage.errors import TransientError
from storage.tables import IndexStore

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle


def grouped_writer(catalog: Catalog, settings: Settings, *, paced_by_load: bool = False) -> GroupedCatalogWriter:
    """A ``GroupedCatalogWriter`` on ``catalog`` paced by ``settings.writer``. ``paced_by_load`` only for
    the writer every claim and finish goes through (the CatalogWriter's): the Api's and the router's
    mark writers see no claims, so to them every moment would look quiet; they keep the token bucket alone."""
    w = settings.writer
    return GroupedCatalogWriter(
        catalog,
        min_interval_s=w.catalog_min_interval_s,
        burst_commits=w.catalog_burst_commits,
        quiet_videos=w.catalog_quiet_videos if paced_by_load else None,
        quiet_writes=w.catalog_quiet_writes,
        claim_memory_s=w.catalog_claim_memory_s,
        quiet_interval_s=w.catalog_quiet_interval_s,
        max_writes=w.catalog_max_writes,
        stall_after_s=w.stall_after_s,
    )


class SharedCatalogWriter:
    """Takes compare-and-set writes of catalog rows from every consumer and commits them in groups."""

    def __init__(self, settings: Settings) -> None:
        self._writer = grouped_writer(IndexStore(settings.s3).catalog, settings, paced_by_load=True)
        self._timeout_s = settings.writer.catalog_write_timeout_s

    async def write(self, record: VideoRecord, expected_rev: int) -> VideoRecord | None:
        """Raises:
        TransientError: the commit failed or gave no outcome within ``catalog_write_timeout_s``.
        """
        pending = self._writer.submit(record, expected_rev)
        outcome = asyncio.wrap_future(pending.future)
        try:
            # Shielded: the caller's deadline ends its wait, never the write (the writer thread hands
            # every taken write its outcome, landed or not; the caller tells which by reading back).
            return await asyncio.wait_for(asyncio.shield(outcome), self._timeout_s)
        except TimeoutError as exc:
            # Nobody waits for the late outcome any more: take its error, if any, so it isn't logged
            # as "never retrieved" (the caller already got a transient error and reads back).
            outcome.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise TransientError(f"no outcome of the catalog write of {record.video_id} in time") from exc

    def check_health(self) -> None:
        """Raises:
        RuntimeError: the writer thread died or its queue stopped moving (Serve replaces the replica).
        """
        if (problem := self._writer.health()) is not None:
            raise RuntimeError(f"the catalog writer is unhealthy: {problem}")

    def stats(self) -> dict[str, int]:
        s = self._writer.stats
        return {"commits": s.commits, "writes": s.writes, "lost": s.lost, "failed_commits": s.failed_commits}

    def close(self) -> None:
        """Commit what waits, then stop (bounded by ``storage.commits.catalog.CLOSE_TIMEOUT_S``)."""
        self._writer.close()


class _HandleWrite:
    def __init__(self, response: Any, video_id: str) -> None:
        self._response = response
        self._video_id = video_id

    def result(self, timeout_s: float) -> VideoRecord | None:
        """Raises:
        TransientError: the writer failed, died or did not answer within ``timeout_s`` (the write
            may still land: callers treat it like any failed write).
        """
        try:
            outcome: VideoRecord | None = self._response.result(timeout_s=timeout_s)
        except TransientError:  # the writer's own (Ray re-raises it as a subclass of the cause)
            raise
        except Exception as exc:  # Ray's actor, timeout and task errors alike
            self._response.cancel()
            raise TransientError(
                f"catalog write of {self._video_id} failed: {type(exc).__name__} (deadline {timeout_s:g}s)"
            ) from exc
        return outcome


class HandleCatalogWrites:
    """``CatalogWrites`` over the CatalogWriter deployment, for synchronous callers (Celery threads)."""

    def __init__(self, writer: DeploymentHandle) -> None:
        self._writer = writer

    def submit(self, record: VideoRecord, expected_rev: int) -> _HandleWrite:
        return _HandleWrite(self._writer.write.remote(record, expected_rev), record.video_id)
