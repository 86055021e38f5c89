"""Catalog writes as pending results, and a writer that gathers them into shared commits.

Every catalog commit is a manifest write (and its conflict check) on object storage; a video costs
two transitions (claim, finish), so one commit per transition caps the whole cluster at a few videos
per second. ``GroupedCatalogWriter`` commits whatever writes are waiting in one ``Catalog.write_many``
(each still a compare-and-set of its own), paced by load. A token bucket paces (one token per
``min_interval_s`` after a commit ended, up to ``burst_commits``): under load commits are
``min_interval_s`` apart and each carries every write that waited, so the commit rate stays fixed
however many videos arrive. Quiet (few claimed videos unfinished and few writes of late), a commit
waits ``quiet_interval_s`` after the last one at most, tokens or not: a lone video's claim and finish
wait for no pace. The writer counts claims (rows written ``indexing``) and finishes (any other
status) itself; a claim with no finish stops counting after ``claim_memory_s``, and a restarted
writer has seen none (until they come again, the count of recent writes alone tells load: under a
flood it stays high). docs/design/state-machine.md has the why, the measurements, and why the state
machine's argument holds unchanged.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from storage.catalog import Catalog, VideoRecord, VideoStatus
from storage.commits.grouped import CLOSE_TIMEOUT_S as CLOSE_TIMEOUT_S
from storage.commits.grouped import STALL_AFTER_S, GroupedCommits, GroupPolicy
from storage.errors import TransientError

log = logging.getLogger(__name__)


class PendingWrite(Protocol):
    """The outcome of one submitted write: the row as written, or None when another writer won."""

    def result(self, timeout_s: float) -> VideoRecord | None: ...


class CatalogWrites(Protocol):
    """Where compare-and-set writes of catalog rows go (``Catalog.write`` semantics)."""

    def submit(self, record: VideoRecord, expected_rev: int) -> PendingWrite: ...


class _Done:
    """A write that already has its outcome."""

    def __init__(self, value: VideoRecord | None = None, error: Exception | None = None) -> None:
        self._value = value
        self._error = error

    def result(self, timeout_s: float) -> VideoRecord | None:
        if self._error is not None:
            raise self._error
        return self._value


class DirectWrites:
    """One commit per write, made in the caller's thread (tests, the scheduled check, tools)."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog

    def submit(self, record: VideoRecord, expected_rev: int) -> PendingWrite:
        try:
            return _Done(self._catalog.write(record, expected_rev))
        except TransientError as exc:
            return _Done(error=exc)


class FutureWrite:
    """A ``PendingWrite`` over a ``concurrent.futures.Future`` (the grouped writer's own)."""

    def __init__(self, future: Future[VideoRecord | None], video_id: str) -> None:
        self.future = future
        self._video_id = video_id

    def result(self, timeout_s: float) -> VideoRecord | None:
        """Raises:
        TransientError: the commit failed, or its outcome did not come within ``timeout_s`` (the
            write may still land: callers treat it like any failed write).
        """
        try:
            return self.future.result(timeout=timeout_s)
        except TimeoutError as exc:
            raise TransientError(f"no outcome of the catalog write of {self._video_id} within {timeout_s:g}s") from exc


@dataclass(eq=False, slots=True)
class _Pending:
    record: VideoRecord
    expected_rev: int
    future: Future[VideoRecord | None] = field(default_factory=Future)


@dataclass(frozen=True, slots=True)
class CatalogWriterStats:
    commits: int
    writes: int
    lost: int
    failed_commits: int


#: Claimed videos the writer remembers at most (the oldest is forgotten first): far above any fleet's
#: concurrent jobs, so under any real load the count stays above ``quiet_videos``.
CLAIMS_REMEMBERED = 100_000


class ClaimedVideos:
    """The videos whose last landed write was a claim, each with when it landed (writer thread only)."""

    def __init__(self, memory_s: float) -> None:
        self._memory_s = memory_s
        self._claimed: OrderedDict[str, float] = OrderedDict()

    def landed(self, record: VideoRecord, now: float) -> None:
        self._claimed.pop(record.video_id, None)
        if record.status is VideoStatus.INDEXING:
            self._claimed[record.video_id] = now  # newest last
            while len(self._claimed) > CLAIMS_REMEMBERED:
                self._claimed.popitem(last=False)

    def count(self, now: float) -> int:
        """Claims younger than ``memory_s`` (older ones are dropped: their consumer is gone or slow)."""
        while self._claimed:
            vid, at = next(iter(self._claimed.items()))
            if now - at <= self._memory_s:
                break
            del self._claimed[vid]
        return len(self._claimed)


class GroupedCatalogWriter:
    """Gathers concurrent catalog writes into grouped commits (see the module docstring)."""

    def __init__(
        self,
        catalog: Catalog,
        *,
        min_interval_s: float = 1.0,
        burst_commits: int = 8,
        quiet_videos: int | None = None,
        quiet_writes: int = 4,
        quiet_interval_s: float = 0.25,
        claim_memory_s: float = 3600.0,
        max_writes: int = 512,
        stall_after_s: float = STALL_AFTER_S,
    ) -> None:
        if (
            min(min_interval_s, quiet_interval_s, quiet_videos or 0, quiet_writes) < 0
            or min(max_writes, burst_commits) < 1
        ):
            raise ValueError(
                "min_interval_s, quiet_interval_s, quiet_videos and quiet_writes must be >= 0, "
                "burst_commits and max_writes >= 1"
            )
        self._catalog = catalog
        self._min_interval_s = min_interval_s
        self._burst = burst_commits
        self._quiet_videos = quiet_videos
        self._quiet_interval_s = quiet_interval_s
        self._quiet_writes = quiet_writes
        # When each write arrived, kept only when pacing by load (appended by callers, dropped by the
        # writer thread once older than ``min_interval_s``; a deque's append and popleft are each atomic).
        self._arrivals: deque[float] = deque()
        # Writer thread only: the claimed, unfinished videos, and when the last commit ended.
        self._claims = ClaimedVideos(claim_memory_s)
        self._ended_at = float("-inf")
        # The token bucket (writer thread only): tokens in hand, as of ``_tokens_at``.
        self._tokens = float(burst_commits)
        self._tokens_at = time.monotonic()
        # Written by the writer thread only.
        self._lost = 0
        # Writes arriving while a group waits for its due time join it.
        policy: GroupPolicy[_Pending] = GroupPolicy(
            key=lambda p: p.record.video_id,
            due_at=self._due_at,
            max_items=max_writes,
            # A write whose caller cancelled its future is not committed; one taken can't be cancelled.
            admit=lambda p: p.future.set_running_or_notify_cancel(),
        )
        self._grouped = GroupedCommits(
            "catalog-writer",
            policy,
            write=self._write,
            landed=self._landed,
            failed=self._failed_commit,
            stall_after_s=stall_after_s,
        )

    @property
    def stats(self) -> CatalogWriterStats:
        c = self._grouped.counts
        return CatalogWriterStats(commits=c.commits, writes=c.items, lost=self._lost, failed_commits=c.failed)

    def submit(self, record: VideoRecord, expected_rev: int) -> FutureWrite:
        """Queue ``record`` to be written if its row still holds ``expected_rev``; returns at once."""
        pending = _Pending(record, expected_rev)
        if not self._grouped.put(pending):
            pending.future.set_exception(TransientError("the catalog writer is closed"))
        elif self._quiet_videos is not None:
            self._arrivals.append(time.monotonic())
        return FutureWrite(pending.future, record.video_id)

    def health(self) -> str | None:
        """None while the writer thread lives and its queue moves; else what is wrong."""
        return self._grouped.health()

    def close(self) -> None:
        """Commit what is queued, then stop the writer thread (bounded by ``CLOSE_TIMEOUT_S``)."""
        self._grouped.close()

    # -- the writer thread ------------------------------------------------------------------------
    def _refill(self, now: float) -> None:
        if self._min_interval_s > 0:
            self._tokens = min(self._burst, self._tokens + (now - self._tokens_at) / self._min_interval_s)
        else:
            self._tokens = float(self._burst)
        self._tokens_at = now

    def _due_at(self, _oldest: _Pending) -> float:
        """With a token in hand: at once; else when the next one is back. Quiet (few claimed videos
        unfinished, few writes of late, the one waiting included): ``quiet_interval_s`` after the last
        commit, if that is sooner."""
        now = time.monotonic()
        self._refill(now)
        due = now if self._tokens >= 1 else now + (1 - self._tokens) * self._min_interval_s
        while self._arrivals and self._arrivals[0] < now - self._min_interval_s:
            self._arrivals.popleft()
        if (
            self._quiet_videos is not None
            and self._claims.count(now) <= self._quiet_videos
            and len(self._arrivals) <= self._quiet_writes
        ):
            return min(due, max(now, self._ended_at + self._quiet_interval_s))
        return due

    def _spend(self) -> None:
        """A commit ended (landed or not): one token spent. The time the commit ran earns none (tokens
        come back from its end, as a fixed pace of one interval after each commit would have it)."""
        self._tokens = max(0.0, self._tokens - 1)
        self._tokens_at = self._ended_at = time.monotonic()

    def _write(self, group: list[_Pending]) -> list[VideoRecord | None]:
        self._refill(time.monotonic())  # the wait for this group earned tokens; its commit will not
        return self._catalog.write_many([(p.record, p.expected_rev) for p in group])

    def _failed_commit(self, group: list[_Pending], exc: Exception, _took_s: float) -> list[list[_Pending]]:
        log.warning("grouped catalog commit of %d writes failed: %s", len(group), exc)
        error = exc if isinstance(exc, TransientError) else TransientError(f"catalog commit failed: {exc}")
        self._spend()
        for pending in group:
            _settle(pending.future, error=error)
        return []

    def _landed(self, group: list[_Pending], outcomes: list[VideoRecord | None], took_s: float) -> None:
        self._lost += sum(1 for o in outcomes if o is None)
        self._spend()
        for outcome in outcomes:
            if outcome is not None:
                self._claims.landed(outcome, self._ended_at)
        log.debug("catalog commit of %d writes in %.3fs", len(group), took_s)
        for pending, outcome in zip(group, outcomes, strict=True):
            _settle(pending.future, outcome)


def _settle(
    future: Future[VideoRecord | None], outcome: VideoRecord | None = None, error: Exception | None = None
) -> None:
    """Hand a write's outcome to its future; one that already has one (it can't: admitted futures
    can't be cancelled) is left as it is rather than end the writer thread."""
    if future.done():
        log.warning("a catalog write's future already had an outcome; this one is dropped")
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(outcome)
