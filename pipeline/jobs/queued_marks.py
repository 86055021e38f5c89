"""``queued`` marks off the request path: ``POST /v1/index`` answers once the broker has the job, and
the mark is made afterwards, on a thread, from the row as the catalog held it *before* the submit.

Why that row and not a fresh read: the submitted job writes the row (``IndexJob.settle``) until it sees
the row moved past its first read (``pipeline.index.settle.Fence``), so a mark that compare-and-sets on a
row from before the submit lands before the job's write (which then loses and settles the row again) or
not at all — it can never outlive the job's outcome. A read made
after the submit could already see the job's outcome and mark it ``queued`` again. Instead of reading
before the submit (a manifest check and a query, tens of milliseconds the client would wait), the
request takes a catalog version ``VersionClock`` looked up earlier — any version from before the
submit will do — and the thread reads the row at that version. A row changed between that version
and the submit only makes the mark lose (the video is then shown as it was, not ``queued``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass

from events.jobs import IndexJob
from pipeline.jobs.videostate import VideoStates
from storage.catalog import Catalog
from storage.errors import TransientError

log = logging.getLogger(__name__)

#: Marks read together at most (one query per catalog version among them).
MARK_BATCH = 256


#: A version looked up longer ago than this many intervals is not handed out (the lookups are
#: failing): the submit then reads the row itself, as without deferred marks.
STALE_INTERVALS = 10


class VersionClock:
    """The catalog's version, looked up every ``interval_s`` on a thread: whatever ``version()`` returns
    was the table's version at some moment before the call (None until the first lookup, and once
    the last good lookup is ``STALE_INTERVALS`` intervals old)."""

    def __init__(self, catalog: Catalog, interval_s: float) -> None:
        self._catalog = catalog
        self._interval_s = interval_s
        self._version: int | None = None
        self._seen_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="catalog-version", daemon=True)

    def start(self) -> VersionClock:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def version(self) -> int | None:
        if time.monotonic() - self._seen_at > STALE_INTERVALS * self._interval_s:
            return None
        return self._version

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._version = self._catalog.version()
                self._seen_at = time.monotonic()
            except Exception as exc:  # a store hiccup: keep the older version (still from before)
                log.warning("catalog version lookup failed: %s", type(exc).__name__)
            self._stop.wait(self._interval_s)


@dataclass(frozen=True, slots=True)
class _Mark:
    job: IndexJob
    version: int


class DeferredMarks:
    """``QueueingSink``'s deferred queueing: versions from ``clock``; marks videos ``queued`` on a
    thread of its own, each from its row at the version it was given
    (see the module docstring). At most ``max_pending`` wait; past that a mark is dropped (logged):
    marks are a courtesy, the jobs are in the queue."""

    def __init__(self, states: VideoStates, clock: VersionClock, max_pending: int = 10_000) -> None:
        self._states = states
        self._clock = clock
        self._pending: queue.Queue[_Mark | None] = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._run, name="queued-marks", daemon=True)

    def start(self) -> DeferredMarks:
        self._clock.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._clock.stop()
        with contextlib.suppress(queue.Full):
            self._pending.put_nowait(None)

    def version(self) -> int | None:
        return self._clock.version()

    def mark(self, job: IndexJob, version: int) -> None:
        """Mark ``job``'s video queued from its row at catalog ``version`` (taken before the submit)."""
        try:
            self._pending.put_nowait(_Mark(job, version))
        except queue.Full:
            log.warning("%s: too many queued marks waiting, this one is dropped", job.uri)

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every mark handed in so far was made (or given up) within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._pending.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._pending.get()
            batch = [first] if first is not None else []
            stopping = first is None
            while not stopping and len(batch) < MARK_BATCH:
                try:
                    more = self._pending.get_nowait()
                except queue.Empty:
                    break
                stopping = more is None
                if more is not None:
                    batch.append(more)
            try:
                self._apply([m for m in batch if m is not None])
            except Exception:  # never let the thread die: later marks still deserve a try
                log.exception("queued marks failed")
            finally:
                for _ in range(len(batch) + (1 if stopping else 0)):
                    self._pending.task_done()

    def _apply(self, batch: list[_Mark]) -> None:
        by_version: dict[int, list[_Mark]] = {}
        for m in batch:
            by_version.setdefault(m.version, []).append(m)
        for version, marks in by_version.items():
            try:
                rows = self._states.catalog.get_many_at([m.job.video_id for m in marks], version)
            except TransientError as exc:
                log.warning("%d queued marks not made: catalog version %d unreadable (%s)", len(marks), version, exc)
                continue
            done: set[str] = set()
            for m in marks:
                if m.job.video_id in done:  # twice in one batch: the second would lose anyway
                    continue
                done.add(m.job.video_id)
                try:
                    self._states.queue_async(m.job, rows.get(m.job.video_id))
                except TransientError as exc:
                    log.warning("%s: not marked queued (%s)", m.job.uri, exc)
