"""The app's background upkeep in one process, each service under its own name: the model preflight,
then index maintenance, the backfill coordinator, the text backfill (while a text source is on) and the
scheduled check, each run by its ``LeasedService`` (the Upkeep deployment holds one ``UpkeepServices``;
it has a single replica, and the leases each service takes in the index database cover the overlap
while Serve replaces it). The functions below build each service from the settings."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pipeline.metrics import Metrics
from pipeline.reindex.lifecycle import DimOf
from pipeline.settings import Settings
from pipeline.upkeep.leased_loop import LeasedService
from pipeline.upkeep.scheduled import ScheduledCheck

if TYPE_CHECKING:
    from pipeline.upkeep.backfill import BackfillCoordinator
    from pipeline.upkeep.maintenance import IndexMaintainer
    from pipeline.upkeep.text_backfill import TextBackfill
    from storage.tables import IndexStore

log = logging.getLogger(__name__)

#: The services' names, as logged and reported by ``running``.
MAINTENANCE = "maintenance"
BACKFILL = "backfill"
TEXT_BACKFILL = "text-backfill"
SCHEDULED_CHECK = "scheduled-check"


class UpkeepServices:
    """Runs ``preflight`` and then starts each of ``services`` on its own thread; ``check`` answers
    ``check_state`` (also when it is not among the services: the scheduled check turned off)."""

    def __init__(
        self,
        preflight: Callable[[], object],
        services: Mapping[str, LeasedService[Any]],
        check: ScheduledCheck,
        metrics: Metrics | None = None,
    ) -> None:
        self._metrics = metrics or Metrics()
        self._preflight = preflight
        self._services = dict(services)
        self._check = check
        self._threads: dict[str, threading.Thread] = {}
        self._stops: list[threading.Event] = []

    @classmethod
    def from_settings(cls, settings: Settings, metrics: Metrics, dim_of: DimOf) -> UpkeepServices:
        """The services of the app configured by ``settings``, over its index and task queue;
        ``dim_of(model_id)``: a model's vector size (``pipeline.embedding.config.model_dim``)."""
        from pipeline.reindex.lifecycle import ModelLifecycle
        from storage.tables import IndexStore

        store = IndexStore(settings.s3)
        check = scheduled_check(settings, store, metrics)
        services: dict[str, LeasedService[Any]] = {
            MAINTENANCE: index_maintainer(settings, store).service,
            BACKFILL: model_backfill(settings, store).service,
        }
        if settings.text.on:  # the words of videos indexed before a text source was on
            services[TEXT_BACKFILL] = text_backfill(settings, store).service
        if settings.check.interval_s > 0:
            services[SCHEDULED_CHECK] = check.service
        return cls(ModelLifecycle(store, settings, dim_of).preflight, services, check, metrics)

    def start(self) -> None:
        """The preflight, then every service.

        Raises:
            ModelConfigError: the configured model and the index disagree (nothing is started).
            TransientError: the index can't be read or written.
        """
        self._preflight()
        for name, service in self._services.items():
            thread, stop = service.start()
            self._threads[name] = thread
            self._stops.append(stop)
        log.info("upkeep: model preflight passed; started %s", ", ".join(self._services) or "nothing")

    def running(self) -> dict[str, bool]:
        """Each started service's name and whether its thread is alive."""
        return {name: thread.is_alive() for name, thread in self._threads.items()}

    def services_state(self) -> dict[str, dict[str, Any]]:
        """Each started service: whether its thread is alive and when its last round succeeded (epoch
        seconds; None before the first). Recorded as ``vidx_service_ok_timestamp_seconds`` too."""
        state = {}
        for name, service in self._services.items():
            thread = self._threads.get(name)
            last_ok = service.last_ok
            state[name] = {"alive": thread is not None and thread.is_alive(), "last_ok": last_ok}
            if last_ok is not None:
                self._metrics.service_ok(name, last_ok)
        return state

    def check_state(self) -> dict[str, Any]:
        """The scheduled check's last round (``vidx status``, ``/metrics``)."""
        return self._check.state.as_json()

    def stop(self) -> None:
        """Ask every started service to stop (their threads end at their next wait)."""
        for stop in self._stops:
            stop.set()


def index_maintainer(settings: Settings, store: IndexStore) -> IndexMaintainer:
    """Index maintenance over the live models' tables (active first) and the live text table."""
    from pipeline.reindex.lifecycle import LiveModels
    from pipeline.upkeep.maintenance import IndexMaintainer

    live = LiveModels(store.models, settings.reindex.live_refresh_s)
    return IndexMaintainer(
        store,
        settings.index,
        tables=lambda: [t.table for t in live.live()],
        text_tables=lambda: [t.table for t in (live.text(),) if t is not None and settings.text.on],
    )


def model_backfill(settings: Settings, store: IndexStore) -> BackfillCoordinator:
    """The backfill coordinator, submitting to the task queue."""
    from pipeline.jobs.taskqueue import CeleryJobSink
    from pipeline.upkeep.backfill import BackfillCoordinator

    r = settings.reindex
    return BackfillCoordinator(
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


def text_backfill(settings: Settings, store: IndexStore) -> TextBackfill:
    """The text backfill, submitting to the text queue with the model backfill's window and pace."""
    from pipeline.jobs.taskqueue import CeleryJobSink
    from pipeline.upkeep.text_backfill import TextBackfill

    r = settings.reindex
    return TextBackfill(
        store,
        CeleryJobSink(settings, settings.serve.text_queue),
        interval_s=r.interval_s,
        max_outstanding=r.max_outstanding,
        resubmit_after_s=r.resubmit_after_s,
        lease_ttl_s=r.lease_ttl_s,
    )


def scheduled_check(settings: Settings, store: IndexStore, metrics: Metrics) -> ScheduledCheck:
    """The scheduled check, repairing through the queueing sink (also built when its rounds are off:
    it answers ``check_state``)."""
    from pipeline.jobs.taskqueue import queueing_sink
    from pipeline.upkeep.check import build_checker

    c = settings.check
    return ScheduledCheck(
        build_checker(settings, store, queueing_sink(settings, store)),
        store.leases,
        settings.s3.buckets,
        interval_s=c.interval_s,
        objects_per_round=c.objects_per_round,
        lease_ttl_s=c.lease_ttl_s,
        repair=c.repair,
        stuck_per_round=c.stuck_per_round,
        resubmit_after_s=c.resubmit_after_s,
        metrics=metrics,
    )
