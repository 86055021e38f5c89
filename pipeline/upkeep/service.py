"""The app's background upkeep in one process, each service under its own name: the model preflight,
then index maintenance, the backfill coordinator, the text backfill (while a text source is on) and the
scheduled check (the Upkeep deployment
holds one ``UpkeepServices``; it has a single replica, and the leases each service takes in the index
database cover the overlap while Serve replaces it)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from pipeline.metrics import Metrics
from pipeline.reindex.lifecycle import DimOf
from pipeline.settings import Settings
from pipeline.upkeep.scheduled import ScheduledCheck

log = logging.getLogger(__name__)

#: The services' names, as logged and reported by ``running``.
MAINTENANCE = "maintenance"
BACKFILL = "backfill"
TEXT_BACKFILL = "text-backfill"
SCHEDULED_CHECK = "scheduled-check"


class BackgroundService(Protocol):
    def start(self) -> tuple[threading.Thread, threading.Event]: ...

    @property
    def last_ok(self) -> float | None: ...


class UpkeepServices:
    """Runs ``preflight`` and then starts each of ``services`` on its own thread; ``check`` answers
    ``check_state`` (also when it is not among the services: the scheduled check turned off)."""

    def __init__(
        self,
        preflight: Callable[[], object],
        services: Mapping[str, BackgroundService],
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
        from pipeline.jobs.taskqueue import CeleryJobSink, queueing_sink
        from pipeline.reindex.lifecycle import LiveModels, ModelLifecycle
        from pipeline.upkeep.backfill import BackfillCoordinator
        from pipeline.upkeep.check import build_checker
        from pipeline.upkeep.maintenance import IndexMaintainer
        from pipeline.upkeep.text_backfill import TextBackfill
        from storage.tables import IndexStore

        store = IndexStore(settings.s3)
        live = LiveModels(store.models, settings.reindex.live_refresh_s)
        r, c = settings.reindex, settings.check
        backfill = BackfillCoordinator(
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
        check = ScheduledCheck(
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
        services: dict[str, BackgroundService] = {
            MAINTENANCE: IndexMaintainer(
                store,
                settings.index,
                tables=lambda: [t.table for t in live.live()],
                text_tables=lambda: [t.table for t in (live.text(),) if t is not None and settings.text.on],
            ),
            BACKFILL: backfill,
        }
        if settings.text.on:  # the words of videos indexed before a text source was on
            services[TEXT_BACKFILL] = TextBackfill(
                store,
                CeleryJobSink(settings, settings.serve.text_queue),
                interval_s=r.interval_s,
                max_outstanding=r.max_outstanding,
                resubmit_after_s=r.resubmit_after_s,
                lease_ttl_s=r.lease_ttl_s,
            )
        if c.interval_s > 0:
            services[SCHEDULED_CHECK] = check
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
