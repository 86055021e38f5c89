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
from storage.leased_loop import LeasedLoop
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
        clock: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
    ) -> None:
        self._checker = checker
        self._buckets = buckets
        self._objects = objects_per_round
        self._repair = repair
        self._metrics = metrics or Metrics()
        self._loop = LeasedLoop("scheduled-check", leases, LEASE, every_s=interval_s, ttl_s=lease_ttl_s, clock=clock)
        self._resume: tuple[str, str] | None = None
        self._lock = threading.Lock()
        self._state = CheckState(rounds=0, last=None, last_error=None, leader=False)

    @property
    def state(self) -> CheckState:
        with self._lock:
            return self._state

    def run_once(self) -> CheckReport | None:
        """One round if this worker holds the lease (None otherwise).

        Raises:
            TransientError: a store or the queue failed; the next round tries again from the same point.
        """
        report = self._loop.once(self._round)
        if report is None:
            with self._lock:
                self._state = replace(self._state, leader=False)
        return report

    def _round(self) -> CheckReport:
        report = self._checker.run(
            self._buckets, repair=self._repair, max_objects=self._objects, resume_after=self._resume
        )
        if report.listed == 0 and self._resume is not None:
            # The last round ended exactly at the end of the buckets: start over now, not next round.
            report = self._checker.run(self._buckets, repair=self._repair, max_objects=self._objects)
        self._resume = report.resume_after  # None: the next round starts from the first bucket again
        stuck = self._checker.stuck(repair=self._repair)
        walked = {i.video_id for i in report.found}
        for item in stuck.found:
            if item.video_id not in walked:
                report.add(item)
        report.submitted += stuck.submitted
        with self._lock:
            self._state = CheckState(self._state.rounds + 1, report, None, leader=True)
        self._metrics.reconcile_round({k.value: n for k, n in report.counts.items()}, report.submitted)
        if report.inconsistencies:
            log.warning("scheduled check: %s", report.summary())
        return report

    def start(self) -> tuple[threading.Thread, threading.Event]:
        """Rounds on a daemon thread every ``interval_s`` (the first after one interval); a failed
        round is logged, kept as ``last_error`` and the next one tries again. Set the returned event
        to stop it."""
        return self._loop.start(self.run_once, self._failed)

    def _failed(self, why: str) -> None:
        with self._lock:
            self._state = replace(self._state, last_error=why[:300])
