"""Bucket events in: the ``EventRouter``'s consumer loop on its own thread, started only once the
configured model has passed the preflight (what the EventRouter deployment holds)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from events.router import EventRouter
from pipeline.metrics import Metrics
from pipeline.reindex.lifecycle import DimOf
from pipeline.settings import Settings


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
        from pipeline.index.taskqueue import CeleryJobSink
        from pipeline.reindex.lifecycle import ModelLifecycle
        from storage.tables import IndexStore

        router = EventRouter(
            settings.amqp,
            settings.videos,
            CeleryJobSink(settings),
            buckets=settings.s3.buckets,
            on_count=metrics.bucket_event,
        )
        return cls(router, ModelLifecycle(IndexStore(settings.s3), settings, dim_of).preflight)

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
