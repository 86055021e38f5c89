"""Index maintenance: builds the ANN index on ``frames.vector`` once the table is big enough and runs
``optimize`` (compaction, new rows folded into the index, old versions pruned) on both tables.

It runs from one worker at a time. Several are harmless but wasteful (compactions conflict with each
other and with writers, and are retried), so a round first takes the ``maintenance`` lease in the
index database: another process's loop waits until the holder stops renewing it.
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from storage.config import IndexSettings
from storage.tables import IndexStore

log = logging.getLogger(__name__)

LEASE = "maintenance"


class Action(enum.StrEnum):
    SKIPPED_NOT_LEADER = "skipped_not_leader"
    NO_TABLE = "no_table"
    FLAT = "flat"  # below the row threshold: exact scans, no index
    INDEX_CREATED = "index_created"
    INDEX_REBUILT = "index_rebuilt"  # the table outgrew the partitions it was trained for
    OPTIMIZED = "optimized"
    UP_TO_DATE = "up_to_date"


@dataclass(frozen=True, slots=True)
class RoundResult:
    action: Action
    rows: int = 0
    unindexed_rows: int = 0
    took_s: float = 0.0


class IndexMaintainer:
    """One maintenance round per call to ``run_once``; ``run`` repeats it every ``optimize_interval_s``."""

    def __init__(
        self,
        store: IndexStore,
        settings: IndexSettings,
        *,
        holder: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._settings = settings
        self._holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._clock = clock
        #: Rows the current index was built on (after a restart: the rows it covered when first seen).
        self._built_rows: int | None = None

    @property
    def holder(self) -> str:
        return self._holder

    def run_once(self) -> RoundResult:
        """Create the index past ``ann_min_rows`` (rebuild it when the table has grown ``rebuild_growth``
        times), else fold new rows in and compact (both tables).

        Library errors propagate (``run`` logs them and tries again next round)."""
        started = time.monotonic()
        s = self._settings
        if not self._store.acquire_lease(LEASE, self._holder, s.lease_ttl_s, self._clock()):
            return RoundResult(Action.SKIPPED_NOT_LEADER)
        state = self._store.vector_index_state()
        if state is None:
            return RoundResult(Action.NO_TABLE)
        if not state.has_index:
            if state.rows < s.ann_min_rows:
                # Still compact: one small fragment per video write slows scans as much as missing the index.
                self._store.optimize(s.keep_versions_s)
                return RoundResult(Action.FLAT, state.rows, state.unindexed_rows, time.monotonic() - started)
            return self._build(state.rows, Action.INDEX_CREATED, started)
        if self._built_rows is None:
            self._built_rows = state.indexed_rows
        if state.rows >= s.rebuild_growth * max(1, self._built_rows):
            return self._build(state.rows, Action.INDEX_REBUILT, started)
        if state.unindexed_rows < max(1, s.optimize_min_unindexed_rows):
            # No new frames, but the catalog keeps committing status changes (deletes, duplicates).
            self._store.optimize_catalog(s.keep_versions_s)
            return RoundResult(Action.UP_TO_DATE, state.rows, state.unindexed_rows)
        self._store.optimize(s.keep_versions_s)
        took = time.monotonic() - started
        log.info("optimized: %d unindexed of %d rows folded in %.1fs", state.unindexed_rows, state.rows, took)
        return RoundResult(Action.OPTIMIZED, state.rows, state.unindexed_rows, took)

    def _build(self, rows: int, action: Action, started: float) -> RoundResult:
        self._store.create_vector_index(self._settings)
        self._built_rows = rows
        took = time.monotonic() - started
        log.info("vector index %s: %s over %d rows in %.1fs", action.value, self._settings.index_type, rows, took)
        return RoundResult(action, rows, 0, took)

    def run(self, stop: threading.Event) -> None:
        """Rounds until ``stop`` is set; a failed round is logged and the next one tries again."""
        while not stop.is_set():
            try:
                self.run_once()
            except Exception:  # a transient store error must not end the loop
                log.warning("index maintenance round failed", exc_info=True)
            stop.wait(self._settings.optimize_interval_s)

    def start(self) -> tuple[threading.Thread, threading.Event]:
        """``run`` in a daemon thread; set the returned event to stop it."""
        stop = threading.Event()
        thread = threading.Thread(target=self.run, args=(stop,), name="index-maintenance", daemon=True)
        thread.start()
        return thread, stop
