"""Grouped frame writes: the jobs of one consumer process share LanceDB commits.

Each job hands its video's rows to ``GroupedFrameWriter.replace`` and blocks. One writer
thread gathers the videos that are waiting, at most ``max_videos`` videos / ``max_rows`` rows and
at most ``wait_s`` after the oldest arrived (not at all when no other job of the process is on its
way: ``expected``), and replaces all their rows in one ``merge_insert`` (``FrameTable.replace_many``:
each video's old rows are replaced, other videos are left alone).
Commits are what cost on object storage (a manifest PUT and its conflict check each), so fewer,
larger commits write more frames per second and leave fewer versions to compact.

A commit can't land after its caller gave up: each call has a deadline (``commit_timeout_s`` after it
arrived); the writer thread drops a call with less time left than twice what the last commit took
(its caller gives up before a commit could land; its error says so), and runs
each merge with Lance's timeout set to the group's earliest deadline, so the merge is cancelled rather
than committed late. (A cancel can't reach a manifest PUT already sent: MinIO orders that conditional PUT
before any later commit, which then replaces those rows.) So a retry, or another version's job, never
has its rows replaced by an older, slower commit of the same video.

Durability is unchanged: a call returns only after the commit holding its rows succeeded, so the
task is acknowledged (acks late) only once its rows are in the table. If the process dies before
the group is written, no job of the group has returned: the broker redelivers them all and the old
rows are still there. When a grouped commit fails, each video of the group is committed alone, so one
video's deterministic error fails that video only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from storage.commits.grouped import CLOSE_TIMEOUT_S, STALL_AFTER_S, GroupedCommits, GroupPolicy
from storage.errors import PermanentError, TransientError
from storage.rows import VideoRows

log = logging.getLogger(__name__)


class FrameWriter(Protocol):
    """Replaces one video's rows and returns once they are durable (``FrameTable`` and ``TextTable``
    themselves are the ungrouped writers: one commit per call)."""

    def replace(self, frames: Any) -> None: ...


class GroupStore(Protocol):
    def replace_many(self, videos: Sequence[Any], timeout: timedelta | None = None) -> None: ...


#: The least time a merge is given (and at least twice what the last commit took): a call with less left
#: is not written.
MIN_COMMIT_S = 0.05


@dataclass(eq=False, slots=True)
class _Pending:
    frames: VideoRows
    #: When the caller stops waiting (``time.monotonic``): after it, these rows must not land.
    deadline: float
    arrived: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None


@dataclass(frozen=True, slots=True)
class WriterStats:
    commits: int
    videos: int
    rows: int
    failed_commits: int


class GroupedFrameWriter:
    """Gathers concurrent ``replace`` calls into grouped commits (see the module docstring)."""

    def __init__(
        self,
        store: GroupStore,
        *,
        max_videos: int = 16,
        max_rows: int = 50_000,
        wait_s: float = 0.05,
        commit_timeout_s: float = 120.0,
        stall_after_s: float = STALL_AFTER_S,
        expected: Callable[[], int] | None = None,
    ) -> None:
        """``expected``: how many of the process's jobs are on their way here now (decoding or embedding);
        when none is (asked as the group forms and at each arrival), the group is taken at once rather
        than waiting out ``wait_s`` for company that can't come (a lone upload's frames commit 50 ms
        sooner). None: always wait."""
        if max_videos < 1 or max_rows < 1 or wait_s < 0 or commit_timeout_s <= 0:
            raise ValueError("max_videos and max_rows must be >= 1, wait_s >= 0, commit_timeout_s > 0")
        self._store = store
        self._commit_timeout_s = commit_timeout_s
        #: How long the last commit that landed took (written by the writer thread only).
        self._last_commit_s = 0.0

        # The oldest waits at most wait_s for company, less once the queue fills a group or no other job
        # of the process is on its way any more (asked again at each arrival).
        policy: GroupPolicy[_Pending] = GroupPolicy(
            key=lambda p: p.frames.video_id,
            due_at=lambda oldest: oldest.arrived + wait_s,
            ready=None if expected is None else lambda: expected() == 0,
            max_items=max_videos,
            weight=lambda p: len(p.frames.rows),
            max_weight=max_rows,
            take_when_full=True,
        )
        self._grouped = GroupedCommits(
            "frame-writer",
            policy,
            write=self._write,
            landed=self._landed,
            failed=self._failed_commit,
            stall_after_s=stall_after_s,
        )

    @property
    def stats(self) -> WriterStats:
        c = self._grouped.counts  # a video's weight is its rows
        return WriterStats(commits=c.commits, videos=c.items, rows=c.weight, failed_commits=c.failed)

    def replace(self, frames: VideoRows) -> None:
        """Replace ``frames.video_id``'s rows with ``frames.rows``; returns once the commit holding them succeeded.

        Raises:
            TransientError: the group's commit failed, no commit came within ``commit_timeout_s``
                (the rows are then withdrawn if not yet being written), or the writer is closed.
        """
        pending = _Pending(frames, deadline=time.monotonic() + self._commit_timeout_s)
        video_id = frames.video_id
        if not self._grouped.put(pending):
            raise TransientError("the frame writer is closed")
        if not pending.done.wait(self._commit_timeout_s):
            if self._grouped.withdraw(pending):
                raise TransientError(f"no commit of {video_id}'s frames within {self._commit_timeout_s:g}s")
            # Already being written: its merge is cancelled at the deadline (see the module docstring);
            # take its outcome, which comes moments later.
            if not pending.done.wait(CLOSE_TIMEOUT_S):
                raise TransientError(f"the commit of {video_id}'s frames did not finish")
        if isinstance(pending.error, ValueError):
            # The rows themselves are wrong (vector size, repeated frame ids): retrying can't help.
            raise PermanentError(f"the rows of {video_id} can't be written: {pending.error}") from pending.error
        if pending.error is not None:
            raise TransientError(
                f"grouped commit of {video_id}'s frames failed: {type(pending.error).__name__}"
            ) from pending.error

    def health(self) -> str | None:
        """None while the writer thread lives and its queue moves; else what is wrong."""
        return self._grouped.health()

    def close(self) -> None:
        """Write what is queued, then stop the writer thread (bounded by ``CLOSE_TIMEOUT_S``)."""
        self._grouped.close()

    # -- the writer thread ------------------------------------------------------------------------
    def _write(self, group: list[_Pending]) -> None:
        # A group is taken once, so a caller that gave up meanwhile has its rows here still: those go,
        # and so do those with less time left than commits have been taking (their merge would be
        # cancelled, and take the rest of the group with it).
        now = time.monotonic()
        need_s = max(MIN_COMMIT_S, 2 * self._last_commit_s)
        live = []
        for pending in group:
            if pending.done.is_set():  # dropped by an earlier try of this group
                continue
            if pending.deadline - now < need_s:
                video_id = pending.frames.video_id
                pending.error = TransientError(f"{video_id}'s caller would stop waiting before the commit")
                pending.done.set()
            else:
                live.append(pending)
        if not live:
            return
        timeout = timedelta(seconds=min(p.deadline for p in live) - now)
        self._store.replace_many([p.frames for p in live], timeout=timeout)

    def _failed_commit(self, group: list[_Pending], error: Exception, took_s: float) -> list[list[_Pending]]:
        log.warning("grouped commit of %d videos failed: %s: %s", len(group), type(error).__name__, error)
        waiting = [p for p in group if not p.done.is_set()]
        if len(waiting) > 1:
            # One video's bad rows must not fail the others: each goes alone, with its own outcome.
            return [[pending] for pending in waiting]
        self._done(group, error, took_s)
        return []

    def _landed(self, group: list[_Pending], _result: None, took_s: float) -> None:
        self._done(group, None, took_s)

    def _done(self, group: list[_Pending], error: Exception | None, took_s: float) -> None:
        if error is None:
            self._last_commit_s = took_s
        rows = sum(len(p.frames.rows) for p in group)
        log.debug("commit of %d videos, %d rows in %.3fs", len(group), rows, took_s)
        for pending in group:
            if pending.done.is_set():  # dropped before the commit (``_write``): its outcome stands
                continue
            pending.error = error
            pending.done.set()
