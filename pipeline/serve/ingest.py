"""Bucket events in: the ``EventRouter``'s consumer loop on its own thread (``EventIntake``), started
only once the configured model has passed the preflight, and the EventRouter deployment that holds it
(one replica; Serve restarts the replica if its router thread dies)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ray import serve

from events.jobs import IndexJob, JobOp, JobSink
from events.router import EventRouter
from pipeline.metrics import Metrics, RayBackend
from pipeline.reindex.lifecycle import DimOf
from pipeline.serve.logs import route_logs_to_replica
from pipeline.settings import Settings


class DeleteMarkingSink:
    """The router's sink: an upload's job goes straight to the task queue (its row says ``indexing``
    once a consumer takes it); a delete's job goes through ``marking``, which marks the row ``queued``
    off the routing path (``pipeline.jobs.queued_marks``). So from moments after a delete event is
    routed until its job settled the row ``deleted``, the row is in flight: ``vidx check`` and the
    scheduled check count it as such instead of reporting "indexed, object gone" for a delete whose
    job waits in a backlog (and a repairing round doesn't resubmit it). A row that is absent or
    ``deleted`` already is not marked, and while no catalog version is to hand (at start, or while
    its lookups fail) the job goes unmarked: a mark never holds up routing."""

    def __init__(self, direct: JobSink, marking: JobSink) -> None:
        self._direct = direct
        self._marking = marking

    def submit(self, job: IndexJob) -> str:
        return (self._marking if job.op is JobOp.DELETE else self._direct).submit(job)


class EventIntake:
    """Runs ``preflight`` and then ``router`` on a thread named ``event-router`` until ``stop``."""

    def __init__(self, router: EventRouter, preflight: Callable[[], object]) -> None:
        self._router = router
        self._preflight = preflight
        self._stop = threading.Event()
        self._thread = threading.Thread(target=router.run, args=(self._stop,), name="event-router", daemon=True)

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics, dim_of: DimOf) -> EventIntake:
        """The router of the app configured by ``settings``: its buckets' events become jobs on the
        index queue; ``dim_of(model_id)``: a model's vector size. The preflight is the one the Upkeep
        deployment runs too (``ModelLifecycle``'s compare-and-set writes make a second run a read):
        no event is taken before it passed."""
        from pipeline.jobs.catalog_writes import grouped_writer
        from pipeline.jobs.taskqueue import CeleryJobSink, queueing_sink
        from pipeline.reindex.lifecycle import ModelLifecycle
        from storage.tables import IndexStore

        store = IndexStore(settings.s3)
        marks = grouped_writer(store.catalog, settings)
        marking = queueing_sink(settings, store, marks, deferred=True, read_first=False)
        router = EventRouter(
            settings.amqp,
            settings.videos,
            DeleteMarkingSink(CeleryJobSink(settings), marking),
            buckets=settings.s3.buckets,
            on_count=metrics.bucket_event,
        )
        return cls(router, ModelLifecycle(store, settings, dim_of).preflight)

    def start(self) -> None:
        """The preflight, then the consumer loop.

        Raises:
            ModelConfigError: the configured model and the index disagree (no event is taken).
            TransientError: the index can't be read or written.
        """
        self._preflight()
        self._thread.start()

    def stats(self) -> dict[str, int]:
        """The router's counters and ``connected`` (1 while it holds a broker connection)."""
        return {**self._router.stats, "connected": int(self._router.connected)}

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()


@serve.deployment(name="EventRouter", num_replicas=1)
class EventRouterDeployment:
    """Routes bucket events: starts the intake (after the model preflight) and reports its counters."""

    def __init__(self, settings: Settings) -> None:
        from pipeline.embedding.config import model_dim

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
