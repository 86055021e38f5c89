"""storage/commits/grouped.py: the grouped-commit core the catalog and frame writers share, with in-memory items."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from storage.commits.grouped import CommitCounts, GroupedCommits, GroupPolicy

#: Longest any wait of these tests lasts.
WAIT_S = 30.0


@dataclass(eq=False)
class Item:
    key: str
    weight: int = 1
    arrived: float = field(default_factory=time.monotonic)


class Recorder:
    """A write that records each group; can hold the writer thread, or fail the first ``fail`` groups
    (handing each failed item back to be committed alone when ``retry_alone``)."""

    def __init__(self, fail: int = 0, *, retry_alone: bool = False) -> None:
        self.fail = fail
        self.retry_alone = retry_alone
        self.groups: list[list[str]] = []
        self.landed: list[list[str]] = []
        self.failed: list[tuple[list[str], Exception]] = []
        self.writing = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.settled = threading.Condition()

    def write(self, group: list[Item]) -> int:
        self.groups.append([i.key for i in group])
        self.writing.set()
        assert self.release.wait(WAIT_S)
        if self.fail > 0:
            self.fail -= 1
            raise OSError("store went away")
        return len(group)

    def on_landed(self, group: list[Item], result: int, _took_s: float) -> None:
        assert result == len(group)
        with self.settled:
            self.landed.append([i.key for i in group])
            self.settled.notify_all()

    def on_failed(self, group: list[Item], error: Exception, _took_s: float) -> Sequence[list[Item]]:
        with self.settled:
            self.failed.append(([i.key for i in group], error))
            self.settled.notify_all()
        return [[i] for i in group] if self.retry_alone and len(group) > 1 else []

    def wait_landed(self, n: int) -> None:
        with self.settled:
            assert self.settled.wait_for(lambda: len(self.landed) + len(self.failed) >= n, WAIT_S)


def writer(rec: Recorder, *, wait_s: float = 0.0, **limits: int) -> GroupedCommits[Item, int]:
    policy: GroupPolicy[Item] = GroupPolicy(
        key=lambda i: i.key,
        due_at=lambda oldest: oldest.arrived + wait_s,
        max_items=limits.get("max_items", 100),
        weight=lambda i: i.weight,
        max_weight=limits.get("max_weight"),
        take_when_full="max_weight" in limits or "max_items" in limits,
    )
    return GroupedCommits("test-writer", policy, write=rec.write, landed=rec.on_landed, failed=rec.on_failed)


def test_groups_are_taken_in_arrival_order_with_one_item_per_key() -> None:
    rec = Recorder()
    rec.release.clear()
    w = writer(rec)
    try:
        assert w.put(Item("first"))
        assert rec.writing.wait(WAIT_S)  # the thread is held in the first commit: the rest queue up
        for key in ["a", "b", "a", "c", "b", "a"]:
            assert w.put(Item(key))
        rec.release.set()
        rec.wait_landed(4)
    finally:
        w.close()
    assert rec.groups == [["first"], ["a", "b", "c"], ["a", "b"], ["a"]]


def test_a_group_holds_at_most_max_items_and_max_weight_but_always_its_first_item() -> None:
    rec = Recorder()
    rec.release.clear()
    w = writer(rec, max_items=2, max_weight=5)
    try:
        w.put(Item("hold"))
        assert rec.writing.wait(WAIT_S)
        for key, weight in [("a", 1), ("b", 1), ("c", 1), ("heavy", 9), ("d", 3), ("e", 3)]:
            w.put(Item(key, weight))
        rec.release.set()
        rec.wait_landed(5)
    finally:
        w.close()
    assert rec.groups == [["hold"], ["a", "b"], ["c"], ["heavy"], ["d"], ["e"]]


def test_a_full_queue_is_taken_before_its_due_time() -> None:
    rec = Recorder()
    w = writer(rec, wait_s=60.0, max_items=2)
    try:
        started = time.monotonic()
        w.put(Item("a"))
        w.put(Item("b"))
        rec.wait_landed(1)
        assert time.monotonic() - started < WAIT_S
    finally:
        w.close()
    assert rec.groups == [["a", "b"]]


def test_close_commits_what_is_queued_then_stops_the_thread() -> None:
    rec = Recorder()
    w = writer(rec, wait_s=60.0)  # nothing would be due for a minute
    for key in ["a", "b", "a"]:
        w.put(Item(key))
    started = time.monotonic()
    w.close()
    assert time.monotonic() - started < WAIT_S
    assert rec.landed == [["a", "b"], ["a"]]
    assert "test-writer" not in {t.name for t in threading.enumerate()}
    assert not w.put(Item("late"))


def test_a_failing_write_reaches_the_failed_hook_and_the_thread_carries_on() -> None:
    rec = Recorder(fail=1)
    w = writer(rec)
    try:
        w.put(Item("a"))
        rec.wait_landed(1)
        w.put(Item("b"))
        rec.wait_landed(2)
    finally:
        w.close()
    assert [(keys, type(e)) for keys, e in rec.failed] == [(["a"], OSError)]
    assert rec.landed == [["b"]]


def test_the_parts_a_failed_hook_returns_are_committed_each_on_its_own() -> None:
    rec = Recorder(fail=1, retry_alone=True)
    w = writer(rec, wait_s=60.0)
    w.put(Item("a"))
    w.put(Item("b"))
    w.close()  # takes the group at once, and drains the retries too
    assert rec.groups == [["a", "b"], ["a"], ["b"]]
    assert [keys for keys, _ in rec.failed] == [["a", "b"]] and rec.landed == [["a"], ["b"]]
    assert w.counts == CommitCounts(commits=2, items=2, weight=2, failed=1)


def test_withdraw_takes_back_a_queued_item_but_not_one_being_written() -> None:
    rec = Recorder()
    rec.release.clear()
    w = writer(rec)
    try:
        writing, queued = Item("a"), Item("b")
        w.put(writing)
        assert rec.writing.wait(WAIT_S)
        w.put(queued)
        assert w.withdraw(queued)
        assert not w.withdraw(writing)
        rec.release.set()
        rec.wait_landed(1)
    finally:
        w.close()
    assert rec.groups == [["a"]]


def test_a_policy_without_room_for_one_item_is_refused() -> None:
    with pytest.raises(ValueError):
        writer(Recorder(), max_items=0)


def test_a_hook_that_raises_is_counted_and_the_thread_carries_on() -> None:
    """A landed hook that raises (as ``Future.set_result`` on a cancelled future did) ends one group's
    hand-over, never the writer thread: the next item still commits and ``health`` stays None."""
    rec = Recorder()
    calls = {"n": 0}

    def landed(group: list[Item], result: int, took_s: float) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("invalid state")
        rec.on_landed(group, result, took_s)

    policy: GroupPolicy[Item] = GroupPolicy(key=lambda i: i.key, due_at=lambda o: o.arrived, max_items=10)
    w = GroupedCommits("test-writer", policy, write=rec.write, landed=landed, failed=rec.on_failed)
    try:
        w.put(Item("a"))
        w.put(Item("b"))  # may share a's group; then c goes alone
        deadline = time.monotonic() + WAIT_S
        while w.hook_errors == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        w.put(Item("c"))
        with rec.settled:
            assert rec.settled.wait_for(lambda: any("c" in g for g in rec.landed), WAIT_S)
        assert w.hook_errors == 1 and w.health() is None
    finally:
        w.close()


def test_items_the_policy_does_not_admit_are_dropped_uncommitted() -> None:
    rec = Recorder()
    policy: GroupPolicy[Item] = GroupPolicy(
        key=lambda i: i.key, due_at=lambda o: o.arrived + 60, max_items=10, admit=lambda i: i.key != "gave-up"
    )
    w = GroupedCommits("test-writer", policy, write=rec.write, landed=rec.on_landed, failed=rec.on_failed)
    w.put(Item("a"))
    w.put(Item("gave-up"))
    w.close()
    assert rec.groups == [["a"]] and w.dropped == 1


def test_health_says_when_the_queue_stops_moving_and_when_it_moves_again() -> None:
    rec = Recorder()
    rec.release.clear()  # the first commit hangs
    policy: GroupPolicy[Item] = GroupPolicy(key=lambda i: i.key, due_at=lambda o: o.arrived, max_items=10)
    w = GroupedCommits(
        "test-writer", policy, write=rec.write, landed=rec.on_landed, failed=rec.on_failed, stall_after_s=0.3
    )
    try:
        assert w.health() is None  # idle is healthy, however long
        w.put(Item("a"))
        assert rec.writing.wait(WAIT_S)
        w.put(Item("b"))
        time.sleep(0.5)
        problem = w.health()
        assert problem is not None and "without progress" in problem
        rec.release.set()
        rec.wait_landed(2)
        deadline = time.monotonic() + WAIT_S
        while w.health() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert w.health() is None
    finally:
        w.close()
    assert w.health() is None  # closed on purpose: not a dead thread


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_says_when_the_writer_thread_died() -> None:
    rec = Recorder()
    policy: GroupPolicy[Item] = GroupPolicy(
        key=lambda i: i.key, due_at=lambda o: o.arrived, max_items=10, admit=lambda i: 1 // 0 == 0
    )
    w = GroupedCommits("test-writer", policy, write=rec.write, landed=rec.on_landed, failed=rec.on_failed)
    w.put(Item("a"))  # admit raises in the thread: it dies
    deadline = time.monotonic() + WAIT_S
    while w.health() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.health() == "its writer thread is dead"
