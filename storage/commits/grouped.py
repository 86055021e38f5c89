"""Grouped commits: one writer thread takes what callers queued and commits it in groups.

The core of the catalog writer (storage/commits/catalog.py) and the frame writer (storage/commits/frames.py):
the queue, the thread, closing and draining, one item per key in a group, and taking a group under a
``GroupPolicy``. Each writer brings the policy, the write itself and how outcomes reach its callers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

#: Longest wait for the writer thread to finish what is queued when the writer is closed.
CLOSE_TIMEOUT_S = 30.0

#: How long work may wait without a group taken or a commit ending before ``health`` says the writer
#: stopped moving (a default: each writer passes its own, above its longest due time and commit).
STALL_AFTER_S = 120.0

T = TypeVar("T")
R = TypeVar("R")


def _unweighted(_item: object) -> int:
    return 0


@dataclass(frozen=True)  # no slots: they break calls of a subscripted generic (GroupPolicy[X](...))
class GroupPolicy(Generic[T]):
    """When the next group is taken and how big it may be.

    ``due_at(oldest)``: the ``time.monotonic()`` by which a group is taken once ``oldest`` waits (a rate
    cap, or how long the oldest waits for company); closing takes it at once. ``take_when_full``: a
    queue holding ``max_items`` keys or ``max_weight`` is taken before that. A group holds at most
    ``max_items`` items (one per ``key``) and, but for its first item, at most ``max_weight``.
    """

    key: Callable[[T], str]
    due_at: Callable[[T], float]
    max_items: int
    weight: Callable[[T], int] = _unweighted
    max_weight: int | None = None
    take_when_full: bool = False
    #: Called once on each item as a group takes it (under the queue's lock): False drops the item
    #: (its caller gave up on it: e.g. a cancelled future), True admits it to the group.
    admit: Callable[[T], bool] = lambda _item: True
    #: Asked (under the queue's lock) each time the writer wakes while a group waits for its due time, an
    #: item's arrival included: True takes the group now (no more company is coming). None: never asked.
    ready: Callable[[], bool] | None = None


@dataclass(frozen=True, slots=True)
class CommitCounts:
    """Writes that landed, the items and weight they carried, and writes that raised (a retried part counts
    again)."""

    commits: int
    items: int
    weight: int
    failed: int


class GroupedCommits(Generic[T, R]):
    """A queue of items and the thread (named ``thread_name``) that commits them in groups, in arrival order.

    ``write(group)`` commits a group; what it returns goes to ``landed(group, result, took_s)``, what it
    raises to ``failed(group, error, took_s)``, which returns the parts of the group to commit again, each
    on its own (none: the group is done). Items are told apart by identity. Runs until ``close``.

    The thread outlives anything one group does: a hook that raises is logged and counted
    (``hook_errors``), and ``health`` says when it died anyway or stopped moving.
    """

    def __init__(
        self,
        thread_name: str,
        policy: GroupPolicy[T],
        *,
        write: Callable[[list[T]], R],
        landed: Callable[[list[T], R, float], None],
        failed: Callable[[list[T], Exception, float], Sequence[list[T]]],
        stall_after_s: float = STALL_AFTER_S,
    ) -> None:
        if policy.max_items < 1:
            raise ValueError("a group must hold at least one item")
        self._policy = policy
        self._write = write
        self._landed = landed
        self._failed = failed
        self._queue: deque[T] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._counts = CommitCounts(0, 0, 0, 0)
        self._stall_after_s = stall_after_s
        #: When a group was last taken or a commit last ended, and whether a commit is under way.
        self._moved_at = time.monotonic()
        self._committing = False
        self.hook_errors = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    @property
    def counts(self) -> CommitCounts:
        """Counted before the hooks run: a caller told of its outcome finds its commit counted."""
        with self._cond:
            return self._counts

    def health(self) -> str | None:
        """None while the writer works; else why not: its thread died, or work has waited
        ``stall_after_s`` without a group taken or a commit ending (a stalled store, a hung commit)."""
        if not self._thread.is_alive():
            return None if self._closed else "its writer thread is dead"
        with self._cond:
            waiting = bool(self._queue) or self._committing
            still_s = time.monotonic() - self._moved_at
        if waiting and still_s > self._stall_after_s:
            what = "a commit has run" if self._committing else "writes have waited"
            return f"{what} {still_s:.0f}s without progress (bound {self._stall_after_s:g}s)"
        return None

    def put(self, item: T) -> bool:
        """Queue ``item`` for the next groups; False (not queued) once the writer is closed."""
        with self._cond:
            if self._closed:
                return False
            if not self._queue and not self._committing:
                self._moved_at = time.monotonic()  # idle until now: the wait starts here
            self._queue.append(item)
            self._cond.notify_all()
        return True

    def withdraw(self, item: T) -> bool:
        """Take ``item`` back if no group has taken it yet; False when it is (being) committed."""
        with self._cond:
            for i, queued in enumerate(self._queue):
                if queued is item:
                    del self._queue[i]
                    return True
        return False

    def close(self) -> None:
        """Commit what is queued, then stop the writer thread (bounded by ``CLOSE_TIMEOUT_S``)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(CLOSE_TIMEOUT_S)

    # -- the writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while (group := self._next_group()) is not None:
            if group:
                self._commit(group)
            self._moved(committing=False)

    def _moved(self, *, committing: bool) -> None:
        with self._cond:
            self._moved_at = time.monotonic()
            self._committing = committing

    def _full(self) -> bool:
        p = self._policy
        if len({p.key(item) for item in self._queue}) >= p.max_items:
            return True
        return p.max_weight is not None and sum(p.weight(item) for item in self._queue) >= p.max_weight

    def _next_group(self) -> list[T] | None:
        """The next group, in arrival order; None once closed and drained."""
        p = self._policy
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            due = p.due_at(self._queue[0])
            # Items arriving meanwhile join this group; closing flushes at once.
            while not self._closed and not (p.take_when_full and self._full()):
                if p.ready is not None and p.ready():
                    break
                if (left := due - time.monotonic()) <= 0:
                    break
                self._cond.wait(left)
            group: list[T] = []
            keys: set[str] = set()
            weight = 0
            for item in self._queue:
                if len(group) >= p.max_items:
                    break
                key = p.key(item)
                if key in keys:
                    continue  # a second item of one key waits for the first one's commit
                w = p.weight(item)
                if group and p.max_weight is not None and weight + w > p.max_weight:
                    break
                group.append(item)
                keys.add(key)
                weight += w
            taken = set(map(id, group))
            self._queue = deque(item for item in self._queue if id(item) not in taken)
            admitted = [item for item in group if p.admit(item)]
            self.dropped += len(group) - len(admitted)
            self._moved_at = time.monotonic()
            self._committing = bool(admitted)
            return admitted

    def _commit(self, group: list[T]) -> None:
        started = time.perf_counter()
        try:
            result = self._write(group)
        except Exception as exc:  # the writer thread carries on whatever a commit raises
            self._moved(committing=True)  # a commit ended: progress, even if the parts go again
            with self._cond:
                self._counts = replace(self._counts, failed=self._counts.failed + 1)
            parts = self._hook(self._failed, group, exc, time.perf_counter() - started) or []
            for part in parts:
                self._commit(part)
            return
        self._moved(committing=True)
        weight = sum(self._policy.weight(item) for item in group)
        with self._cond:
            c = self._counts
            self._counts = CommitCounts(c.commits + 1, c.items + len(group), c.weight + weight, c.failed)
        self._hook(self._landed, group, result, time.perf_counter() - started)

    def _hook(self, hook: Callable[..., Sequence[list[T]] | None], *args: object) -> Sequence[list[T]] | None:
        """Run an outcome hook; what it raises is one group's trouble, never the thread's end."""
        try:
            return hook(*args)
        except Exception:
            with self._cond:
                self.hook_errors += 1
            log.exception("%s: an outcome hook raised; the writer carries on", self._thread.name)
            return None
