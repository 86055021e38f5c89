"""The scheduled check: a round of ``Checker`` every ``check.interval_s`` inside the app, so drift
heals without anyone typing a command.

One worker in the fleet runs it at a time (the ``check`` lease in the index database). Rounds are
incremental: each lists at most ``check.objects_per_round`` objects and the next resumes after the
last key, wrapping around at the end of the buckets. The last round's report is kept for
``vidx status`` and ``/metrics``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pipeline.metrics import Metrics
from pipeline.upkeep.check import Checker, CheckReport
from pipeline.upkeep.leased_loop import LeasedLoop, LeasedService
from storage.catalog import VideoRecord
from storage.errors import PermanentError, TransientError
from storage.leases import Leases

log = logging.getLogger(__name__)

LEASE = "check"


@dataclass(frozen=True, slots=True)
class CheckState:
    """What the scheduled check last did: visible in ``vidx status`` and ``/metrics``."""

    rounds: int
    last: CheckReport | None
    last_error: str | None
    leader: bool

    def as_json(self) -> dict[str, Any]:
        last = self.last
        return {
            "rounds": self.rounds,
            "leader": self.leader,
            "last_error": self.last_error,
            "last": None
            if last is None
            else {
                "started_at": last.started_at.isoformat(),
                "took_s": round(last.took_s, 3),
                "inconsistencies": last.inconsistencies,
                "counts": {k.value: n for k, n in last.counts.items()},
                "in_flight": last.in_flight,
                "submitted": last.submitted,
                "listed": last.listed,
                "summary": last.summary(),
            },
        }


class ScheduledCheck:
    """Runs ``checker`` rounds under a lease (see the module docstring)."""

    def __init__(
        self,
        checker: Checker,
        leases: Leases,
        buckets: list[str],
        *,
        interval_s: float,
        objects_per_round: int,
        lease_ttl_s: float,
        repair: bool,
        stuck_per_round: int = 1000,
        resubmit_after_s: float = 14_400.0,
        clock: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
    ) -> None:
        """``stuck_per_round``: stuck rows resubmitted per round at most; ``resubmit_after_s``: a row
        resubmitted and not changed since is not resubmitted again before this (its job may wait in a
        backlog: resubmitting every round would multiply it)."""
        self._checker = checker
        self._stuck_per_round = stuck_per_round
        self._resubmit_after_s = resubmit_after_s
        self._clock = clock
        #: The stamps: video id -> (the row's revision when resubmitted, when). Kept by the leader.
        self._resubmits: dict[str, tuple[int, float]] = {}
        self._buckets = buckets
        self._objects = objects_per_round
        self._repair = repair
        self._metrics = metrics or Metrics()
        self._resume: tuple[str, str] | None = None
        self._lock = threading.Lock()
        self._state = CheckState(rounds=0, last=None, last_error=None, leader=False)
        #: Rounds every ``interval_s`` (the first after one interval) while this worker holds the ``check``
        #: lease; a failed round is logged, kept as the state's ``last_error`` and the next one tries again.
        self.service = LeasedService(
            LeasedLoop("scheduled-check", leases, LEASE, every_s=interval_s, ttl_s=lease_ttl_s, clock=clock),
            self._round,
            idle=self._not_leader,
            on_error=self._failed,
        )

    @property
    def state(self) -> CheckState:
        with self._lock:
            return self._state

    def run_once(self) -> CheckReport | None:
        """One round if this worker holds the lease (None otherwise).

        Raises:
            TransientError: a store or the queue failed; the next round tries again from the same point.
        """
        return self.service.run_once()

    def _not_leader(self) -> None:
        with self._lock:
            self._state = replace(self._state, leader=False)

    def _round(self) -> CheckReport:
        """Stuck-row repair, then a slice of the walk: two steps, each going on when the other fails
        (and a failing bucket doesn't stop the walk of the others); what failed is in ``errors``.

        Raises:
            TransientError: both steps failed (nothing was checked).
        """
        stuck = self._stuck_step()
        try:
            report = self._walk_step()
        except (TransientError, PermanentError) as exc:
            if "stuck rows" in stuck.errors:
                raise TransientError(f"{stuck.errors['stuck rows']}; walk: {exc}") from exc
            report = CheckReport(repair=self._repair)
            report.errors["walk"] = str(exc)[:300]
        walked = {i.video_id for i in report.found}
        for item in stuck.found:
            if item.video_id not in walked:
                report.add(item)
        report.submitted += stuck.submitted
        report.in_flight += stuck.in_flight
        report.errors.update(stuck.errors)
        error = "; ".join(f"{k}: {v}" for k, v in report.errors.items()) or None
        with self._lock:
            self._state = CheckState(self._state.rounds + 1, report, error[:300] if error else None, leader=True)
        checked = [b for b in report.buckets if b not in report.errors]
        if "stuck rows" in report.errors or (report.buckets and not checked):
            # Kept as the last round, but not a success: the service's last success stays where it was.
            raise TransientError(f"the round checked too little: {error}")
        self._metrics.reconcile_round({k.value: n for k, n in report.counts.items()}, report.submitted)
        if report.inconsistencies:
            log.warning("scheduled check: %s", report.summary())
        return report

    def _stamped(self, record: VideoRecord) -> bool:
        stamp = self._resubmits.get(record.video_id)
        return stamp is not None and stamp[0] == record.rev

    def _stamp(self, record: VideoRecord) -> None:
        self._resubmits[record.video_id] = (record.rev, self._clock())

    def _stuck_step(self) -> CheckReport:
        """Rows queued or indexing past the grace, resubmitted unless stamped (see ``__init__``)."""
        now = self._clock()
        self._resubmits = {v: s for v, s in self._resubmits.items() if now - s[1] < self._resubmit_after_s}
        try:
            return self._checker.stuck(
                repair=self._repair, skip=self._stamped, resubmitted=self._stamp, limit=self._stuck_per_round
            )
        except (TransientError, PermanentError) as exc:
            log.warning("scheduled check: the stuck-row step failed: %s", exc)
            report = CheckReport(repair=self._repair)
            report.errors["stuck rows"] = str(exc)[:300]
            return report

    def _walk_step(self) -> CheckReport:
        report = self._walk(self._resume)
        if report.listed == 0 and self._resume is not None and not report.errors:
            # The last round ended exactly at the end of the buckets: start over now, not next round.
            report = self._walk(None)
        self._resume = report.resume_after  # None: the next round starts from the first bucket again
        return report

    def _walk(self, resume_after: tuple[str, str] | None) -> CheckReport:
        return self._checker.run(
            self._buckets,
            repair=self._repair,
            max_objects=self._objects,
            resume_after=resume_after,
            keep_going=True,
            skip=self._stamped,
            resubmitted=self._stamp,
        )

    def _failed(self, why: str) -> None:
        with self._lock:
            self._state = replace(self._state, last_error=why[:300])
