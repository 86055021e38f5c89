"""The scheduled check: a round of ``Checker`` every ``check.interval_s`` inside the app, so drift
heals without anyone typing a command.

One worker in the fleet runs it at a time (the ``check`` lease in the index database). Rounds are
incremental: each lists at most ``check.objects_per_round`` objects and the next resumes after the
last key, wrapping around at the end of the buckets. The last round's report is kept for
``vidx status`` and ``/metrics``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.metrics import Metrics
from pipeline.upkeep.check import Checker, CheckReport
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
        self._leases = leases
        self._buckets = buckets
        self._interval_s = interval_s
        self._objects = objects_per_round
        self._ttl_s = lease_ttl_s
        self._repair = repair
        self._clock = clock
        self._metrics = metrics or Metrics()
        self._holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
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
        if not self._leases.acquire(LEASE, self._holder, self._ttl_s, self._clock()):
            with self._lock:
                self._state = CheckState(self._state.rounds, self._state.last, self._state.last_error, leader=False)
            return None
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

    def run(self, stop: threading.Event) -> None:
        """Rounds every ``interval_s`` until ``stop`` is set; a failed round is logged and retried next time."""
        while not stop.wait(self._interval_s):
            try:
                self.run_once()
            except Exception as exc:  # a store blip must not end the loop
                log.warning("scheduled check round failed: %s", type(exc).__name__, exc_info=True)
                with self._lock:
                    s = self._state
                    self._state = CheckState(s.rounds, s.last, f"{type(exc).__name__}: {exc}"[:300], s.leader)

    def start(self) -> tuple[threading.Thread, threading.Event]:
        """``run`` in a daemon thread; set the returned event to stop it."""
        stop = threading.Event()
        thread = threading.Thread(target=self.run, args=(stop,), name="scheduled-check", daemon=True)
        thread.start()
        return thread, stop
