"""Grouped frame writes: the jobs of one consumer process share LanceDB commits.

Each job hands its video's rows to ``GroupedFrameWriter.replace`` and blocks. One writer
thread gathers the videos that are waiting, at most ``max_videos`` videos / ``max_rows`` rows and
at most ``wait_s`` after the oldest arrived, and replaces all their rows in one ``merge_insert``
(``FrameTable.replace_many``: each video's old rows are replaced, other videos are left alone).
Commits are what cost on object storage (a manifest PUT and its conflict check each), so fewer,
larger commits write more frames per second and leave fewer versions to compact.

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
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from storage.errors import PermanentError, TransientError
from storage.frames import VideoFrames

log = logging.getLogger(__name__)

#: Longest wait for the writer thread to finish what is queued when the writer is closed.
CLOSE_TIMEOUT_S = 30.0


class FrameWriter(Protocol):
    """Replaces one video's frames and returns once they are durable (``FrameTable`` itself is the
    ungrouped writer: one commit per call)."""

    def replace(self, frames: VideoFrames) -> None: ...


class GroupStore(Protocol):
    def replace_many(self, videos: Sequence[VideoFrames]) -> None: ...


@dataclass(eq=False, slots=True)
class _Pending:
    frames: VideoFrames
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
    ) -> None:
        if max_videos < 1 or max_rows < 1 or wait_s < 0 or commit_timeout_s <= 0:
            raise ValueError("max_videos and max_rows must be >= 1, wait_s >= 0, commit_timeout_s > 0")
        self._store = store
        self._max_videos = max_videos
        self._max_rows = max_rows
        self._wait_s = wait_s
        self._commit_timeout_s = commit_timeout_s
        self._queue: deque[_Pending] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._commits = self._videos = self._rows = self._failed = 0
        self._thread = threading.Thread(target=self._run, name="frame-writer", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> WriterStats:
        with self._cond:
            return WriterStats(self._commits, self._videos, self._rows, self._failed)

    def replace(self, frames: VideoFrames) -> None:
        """Replace ``frames.video_id``'s rows with ``frames.rows``; returns once the commit holding them succeeded.

        Raises:
            TransientError: the group's commit failed, no commit came within ``commit_timeout_s``
                (the rows are then withdrawn if not yet being written), or the writer is closed.
        """
        pending = _Pending(frames)
        video_id = frames.video_id
        with self._cond:
            if self._closed:
                raise TransientError("the frame writer is closed")
            self._queue.append(pending)
            self._cond.notify_all()
        if not pending.done.wait(self._commit_timeout_s):
            with self._cond:
                withdrawn = pending in self._queue
                if withdrawn:
                    self._queue.remove(pending)
            if withdrawn:
                raise TransientError(f"no commit of {video_id}'s frames within {self._commit_timeout_s:g}s")
            # Already being written: that commit may still land, so wait for its outcome (a commit is
            # bounded by the store's timeouts) rather than let a retry race a late write of old rows.
            if not pending.done.wait(CLOSE_TIMEOUT_S):
                raise TransientError(f"the commit of {video_id}'s frames did not finish")
        if isinstance(pending.error, ValueError):
            # The rows themselves are wrong (vector size, repeated frame ids): retrying can't help.
            raise PermanentError(f"the rows of {video_id} can't be written: {pending.error}") from pending.error
        if pending.error is not None:
            raise TransientError(
                f"grouped commit of {video_id}'s frames failed: {type(pending.error).__name__}"
            ) from pending.error

    def close(self) -> None:
        """Write what is queued, then stop the writer thread (bounded by ``CLOSE_TIMEOUT_S``)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(CLOSE_TIMEOUT_S)

    # -- the writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while (group := self._next_group()) is not None:
            self._commit(group)

    def _full(self) -> bool:
        ids = {p.frames.video_id for p in self._queue}
        return len(ids) >= self._max_videos or sum(len(p.frames.rows) for p in self._queue) >= self._max_rows

    def _next_group(self) -> list[_Pending] | None:
        """The next group to commit, in arrival order; None once closed and drained."""
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            # The oldest waits at most wait_s for company; closing flushes at once.
            deadline = self._queue[0].arrived + self._wait_s
            while not self._closed and not self._full() and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            group: list[_Pending] = []
            ids: set[str] = set()
            rows = 0
            for pending in list(self._queue):
                if len(ids) >= self._max_videos:
                    break
                if pending.frames.video_id in ids:
                    # Two jobs of one video: the later one goes in the next commit, after this one.
                    continue
                if group and rows + len(pending.frames.rows) > self._max_rows:
                    break
                group.append(pending)
                ids.add(pending.frames.video_id)
                rows += len(pending.frames.rows)
            for pending in group:
                self._queue.remove(pending)
            return group

    def _commit(self, group: list[_Pending]) -> None:
        started = time.perf_counter()
        error: Exception | None = None
        try:
            self._store.replace_many([p.frames for p in group])
        except Exception as exc:  # the writer thread carries on whatever a commit raises
            error = exc
            log.warning("grouped commit of %d videos failed: %s: %s", len(group), type(exc).__name__, exc)
        if error is not None and len(group) > 1:
            with self._cond:
                self._failed += 1
            # One video's bad rows must not fail the others: each goes alone, with its own outcome.
            for pending in group:
                self._commit([pending])
            return
        rows = sum(len(p.frames.rows) for p in group)
        with self._cond:
            if error is None:
                self._commits += 1
                self._videos += len(group)
                self._rows += rows
            else:
                self._failed += 1
        log.debug("commit of %d videos, %d rows in %.3fs", len(group), rows, time.perf_counter() - started)
        for pending in group:
            pending.error = error
            pending.done.set()
