"""The backfill coordinator: re-embeds every indexed video with the model being switched to, through
the task queue, and switches the active model once every video has it.

A round (every ``reindex.interval_s``, one worker in the fleet at a time: the ``backfill`` lease)
reads the lifecycle row and, during a backfill, walks the catalog:

- an indexed video whose entry for the target table isn't of its current version *needs* a job
  (so does a failed one still searchable with the active model at its version: its backfill job
  failed, and switching without it would lose it);
  at most ``reindex.max_outstanding`` are out at once, and one not done within
  ``reindex.resubmit_after_s`` is submitted again (jobs are idempotent: a duplicate finds the rows
  and does nothing);
- a video in flight whose last write is older than ``Backfill.live_from`` may be run by a job that
  read the lifecycle before the backfill began, so it *holds the switch back* until it settles;
  one claimed later was claimed by a job that writes the target too, and holds it back only while
  the active model finds it at its version without the target's rows (its backfill job is running:
  switching then would take it out of search until that job settles, and for good if it failed),
  for at most ``reindex.resubmit_after_s`` since its row was last written: then it needs a job.

When nothing needs a job and nothing holds the switch back, one compare-and-set of the lifecycle
row makes the target active and retires the old model's table. One more thing holds it back: a target
table past ``index.ann_min_rows`` rows without its ANN index yet (index maintenance keeps every live
table, the target's too, and builds it within a round), so searches don't fall back to exact scans
of the new table just after the switch; for at most ``reindex.index_wait_s``, then it switches anyway.
For ``sweep_s`` after the switch, rounds still give a job to any indexed video without the active
model's rows (one settling in the instant of the switch). Everything the coordinator knows is in the
catalog and that row, so a restart of the app carries on where it was (jobs still on the
queue stay there; what it had submitted and not seen done is submitted again, at most the window).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from events.jobs import JobSink, JobSource
from pipeline.upkeep.leased_loop import LeasedLoop, LeasedService
from pipeline.upkeep.maintenance import vector_index_state
from pipeline.upkeep.window import SubmissionWindow
from storage.catalog import IN_FLIGHT, VideoRecord, VideoStatus
from storage.errors import TransientError
from storage.ids import fingerprint
from storage.models import Backfill, ModelState, ModelTable
from storage.tables import IndexStore

log = logging.getLogger(__name__)

LEASE = "backfill"


@dataclass(slots=True)
class BackfillRound:
    """What one round found and did."""

    total: int = 0
    done: int = 0
    need: int = 0
    holding: int = 0
    failed: int = 0
    submitted: int = 0
    switched: bool = False
    #: Every video has the target, yet the switch waits: for what, and since when (kept in the row).
    waiting_for: str | None = None
    waiting_since: datetime | None = None
    #: Videos of ``need`` still waiting for a window slot.
    waiting: list[str] = field(default_factory=list)
    #: Videos of ``need`` whose backfill job ended failed: submitted again every
    #: ``resubmit_after_s``, without holding a slot of the window meanwhile.
    settled: set[str] = field(default_factory=set)


def has_model(record: VideoRecord, model: ModelTable) -> bool:
    """Whether the catalog says ``model``'s table holds this video's current version."""
    entry = record.index_in(model.table)
    return (
        entry is not None
        and record.version is not None
        and entry.fingerprint == fingerprint(record.version, model.model, entry.sampling)
    )


class BackfillCoordinator:
    """Runs backfill rounds under a lease (see the module docstring)."""

    def __init__(
        self,
        store: IndexStore,
        sink: JobSink,
        *,
        interval_s: float,
        max_outstanding: int,
        resubmit_after_s: float,
        lease_ttl_s: float,
        sweep_s: float = 600.0,
        ann_min_rows: int | None = None,
        index_wait_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``ann_min_rows``: rows past which a frames table gets its ANN index (``index.ann_min_rows``);
        a target table past it without one holds the switch for at most ``index_wait_s`` (None or 0:
        never)."""
        self._store = store
        self._resubmit_after_s = resubmit_after_s
        self._sweep_s = sweep_s
        self._ann_min_rows = ann_min_rows
        self._index_wait_s = index_wait_s
        #: The jobs this process submitted for the target table and not yet seen done.
        self._window = SubmissionWindow(
            sink,
            JobSource.REINDEX,
            max_outstanding=max_outstanding,
            resubmit_after_s=resubmit_after_s,
            clock=clock,
        )
        self._table: str | None = None
        self._resumed = False
        #: Its rounds under the ``backfill`` lease, the first after one ``interval_s``.
        self.service = LeasedService(
            LeasedLoop("backfill", store.leases, LEASE, every_s=interval_s, ttl_s=lease_ttl_s), self.round
        )

    def round(self) -> BackfillRound | None:
        """One round (None: no backfill is running, and no switch within ``sweep_s``).

        Raises:
            TransientError: the catalog, the lifecycle row or the task queue is unavailable.
        """
        state = self._store.models.read()
        target, backfill = state.target, state.backfill
        if target is None or backfill is None:
            since = (datetime.now(UTC) - state.switched_at).total_seconds() if state.switched_at else None
            if state.active is not None and since is not None and since < self._sweep_s:
                return self._sweep(state.active)
            self._forget(None)
            return None
        self._forget(target.table)
        found = BackfillRound()
        now = datetime.now(UTC)
        for record in self._store.catalog.scan_all():
            self._judge(record, state.active, target, backfill.live_from, found, now)
        self._submit(found)
        ready = not found.need and not found.holding and now >= backfill.live_from
        if not found.need and found.holding:
            found.waiting_for = f"{found.holding} video(s) whose index jobs are still running"
        # The wait for the target's ANN index counts from the first round it held the switch, even
        # if videos needed jobs again in between; it ends once the index is there (or the bound).
        found.waiting_since = backfill.waiting_since
        if ready:
            missing = self._index_missing(target, backfill, now)
            if missing is None:
                found.waiting_since = None
            else:
                found.waiting_for, found.waiting_since, ready = missing, backfill.waiting_since or now, False
        if ready and self._switch(state):
            found.switched = True
        else:
            self._progress(state, found, now)
        return found

    def _sweep(self, active: ModelTable) -> BackfillRound:
        """For ``sweep_s`` after a switch: an indexed video without the now active model's rows at
        its version (a job that settled in the instant of the switch without them, e.g. one that
        left out a target it could not embed) gets a job, within seconds rather than at the
        scheduled check's walk."""
        self._forget(f"sweep:{active.table}")
        found = BackfillRound()
        for record in self._store.catalog.scan_all():
            if record.status is VideoStatus.INDEXED:
                found.total += 1
                self._count(record, active, found)
        self._submit(found)
        return found

    def _judge(
        self,
        record: VideoRecord,
        active: ModelTable | None,
        target: ModelTable,
        live_from: datetime,
        found: BackfillRound,
        now: datetime,
    ) -> None:
        if record.status is VideoStatus.DELETED:
            self._window.done(record.video_id)
            return
        if record.status is VideoStatus.FAILED and not (active is not None and has_model(record, active)):
            found.failed += 1  # failed at its version, with nothing of it searchable: nothing to carry over
            self._window.done(record.video_id)
            return
        found.total += 1
        # A failed video still searchable at its version (its backfill job failed permanently) holds
        # the switch back too: switching would lose it.
        if record.status in (VideoStatus.INDEXED, VideoStatus.FAILED):
            if not self._count(record, target, found) and record.status is VideoStatus.FAILED:
                found.settled.add(record.video_id)  # its job ended: it takes no window slot
        elif record.status in IN_FLIGHT and record.updated_at < live_from:
            found.holding += 1
        elif record.status in IN_FLIGHT and self._carried(record, active, target):
            # Bounded: a row in flight for longer than a job is given (its job lost, its failure
            # never recorded) needs a job of its own, which claims it over the stale mark.
            if (now - record.updated_at).total_seconds() > self._resubmit_after_s:
                self._count(record, target, found)
            else:
                found.holding += 1

    @staticmethod
    def _carried(record: VideoRecord, active: ModelTable | None, target: ModelTable) -> bool:
        """Whether an in-flight video is searchable with the active model at its version and lacks
        the target's rows (a backfill job, or one of the same content, is running): switching now
        would take it out of search until that job settles, and for good if the job fails."""
        return active is not None and has_model(record, active) and not has_model(record, target)

    def _count(self, record: VideoRecord, model: ModelTable, found: BackfillRound) -> bool:
        """Count a settled video as done (it has ``model``'s rows; returns True) or as needing a job."""
        if has_model(record, model):
            found.done += 1
            self._window.done(record.video_id)
            return True
        found.need += 1
        found.waiting.append(record.uri)
        return False

    def _submit(self, found: BackfillRound) -> None:
        found.submitted += self._window.submit(found.waiting, unslotted=found.settled).submitted
        found.waiting = []

    def _index_missing(self, target: ModelTable, backfill: Backfill, now: datetime) -> str | None:
        """What the target's table lacks before it can answer as fast as an indexed table: its ANN
        index, once it is past ``ann_min_rows`` rows (None: nothing, or the wait is over). The wait
        counts from ``Backfill.waiting_since``, so a restart or another coordinator goes on with it; a
        table whose state can't be read waits too, within the same bound."""
        if not self._ann_min_rows or self._index_wait_s <= 0:
            return None
        try:
            index = vector_index_state(self._store, self._store.frames_table(target.table))
        except Exception as exc:  # the store or the table failing: wait, but not past the bound
            why = f"the new table's index state, which could not be read ({type(exc).__name__}: {exc})"[:300]
        else:
            if index is None or index.has_index or index.rows < self._ann_min_rows:
                return None
            why = f"the vector index of the new table ({index.rows} rows; index maintenance builds it)"
        waited = (now - (backfill.waiting_since or now)).total_seconds()
        if waited >= self._index_wait_s:
            log.warning(
                "switching to %s after waiting %.0fs for %s: searches scan its table until its index is built",
                target.model,
                waited,
                why,
            )
            return None
        log.info("the switch to %s waits for %s", target.model, why)
        return why

    def _switch(self, state: ModelState) -> bool:
        """The one write that makes the target active (False: the row changed; next round decides)."""
        assert state.target is not None and state.active is not None
        switched = state.evolve(
            active=state.target,
            target=None,
            backfill=None,
            retired=(state.active, *state.retired),
            switched_at=datetime.now(UTC),
        )
        if self._store.models.write(switched, state.rev) is None:
            return False
        log.info(
            "backfill complete: %s answers now; %s kept as %s",
            state.target.model,
            state.active.model,
            state.active.table,
        )
        self._forget(None)
        return True

    def _progress(self, state: ModelState, found: BackfillRound, now: datetime) -> None:
        """Record the round's counts in the lifecycle row (best effort: losing to another write is fine)."""
        b = state.backfill
        assert b is not None
        first = not self._resumed
        counts = (found.total, found.done, found.failed, found.waiting_for, found.waiting_since)
        if (b.total, b.done, b.failed, b.waiting_for, b.waiting_since) == counts and not first:
            return
        progressed = replace(
            b,
            total=found.total,
            done=found.done,
            failed=found.failed,
            waiting_for=found.waiting_for,
            waiting_since=found.waiting_since,
            progress_at=now,
        )
        if first:  # this coordinator's rate counts from here (a restart resumes, its rate starts anew)
            progressed = replace(progressed, done_at_resume=found.done, resumed_at=now)
        try:
            if self._store.models.write(state.evolve(backfill=progressed), state.rev) is not None:
                self._resumed = True
        except TransientError as exc:
            log.info("backfill progress not recorded: %s", exc)

    def _forget(self, table: str | None) -> None:
        """Start afresh when the backfill changed (another target, or none)."""
        if table != self._table:
            self._window.clear()
            self._table = table
            self._resumed = False
