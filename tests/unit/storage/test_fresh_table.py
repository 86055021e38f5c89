"""``FreshTable``: reads see every commit finished before they began, and concurrent readers share
one manifest check."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from storage.catalog import VideoRecord, VideoStatus
from storage.db import FreshTable
from storage.tables import IndexStore


class CountingTable:
    """Stands in for a Lance table handle: counts ``checkout_latest`` calls, each taking ``check_s``."""

    def __init__(self, check_s: float = 0.0, fail: int = 0, fail_checks: frozenset[int] = frozenset()) -> None:
        self.checks = 0
        self.check_s = check_s
        self.fail = fail
        self.fail_checks = fail_checks  # these checks (1-based) fail
        self.in_check = 0
        self.most_at_once = 0
        self._lock = threading.Lock()

    def checkout_latest(self) -> None:
        with self._lock:
            self.in_check += 1
            self.most_at_once = max(self.most_at_once, self.in_check)
        time.sleep(self.check_s)
        with self._lock:
            self.in_check -= 1
            self.checks += 1
            if self.checks in self.fail_checks:
                raise OSError("connection reset by peer")
            if self.fail:
                self.fail -= 1
                raise OSError("connection reset by peer")


def _readers(fresh: FreshTable, n: int) -> tuple[list[threading.Thread], list[object]]:
    got: list[object] = []

    def read() -> None:
        try:
            got.append(fresh.table())
        except OSError as exc:
            got.append(exc)

    threads = [threading.Thread(target=read) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, got


def test_readers_arriving_during_a_check_share_the_next_one() -> None:
    table = CountingTable(check_s=0.3)
    fresh = FreshTable(lambda: table)
    fresh.table()  # opens (no check)
    threads, got = _readers(fresh, 20)
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    # The first reader's check, then one more for the 19 that arrived while it ran (a check begun
    # before a reader arrived never serves it).
    assert table.checks == 2
    assert got == [table] * 20
    assert table.most_at_once == 1


def test_a_reader_never_takes_a_check_that_began_before_it_arrived() -> None:
    table = CountingTable(check_s=0.3)
    fresh = FreshTable(lambda: table)
    fresh.table()
    early = threading.Thread(target=fresh.table)
    early.start()
    time.sleep(0.1)  # the early reader's check is running
    fresh.table()  # must wait for a check begun after now: a second one
    early.join(5)
    assert table.checks == 2


def test_a_failed_check_fails_its_reader_and_the_next_reader_checks_again() -> None:
    table = CountingTable(fail=1)
    fresh = FreshTable(lambda: table)
    fresh.table()
    with pytest.raises(OSError):
        fresh.table()
    assert fresh.table() is table
    assert table.checks == 2


def test_readers_sharing_a_check_that_fails_never_get_the_stale_handle() -> None:
    """Readers that arrived while check 1 ran share check 2; it fails: only the reader that ran it
    sees the error, the others must not return until check 3 (begun after they arrived) ends well."""
    table = CountingTable(check_s=0.3, fail_checks=frozenset({2}))
    fresh = FreshTable(lambda: table)
    fresh.table()  # opens (no check)
    first, first_got = _readers(fresh, 1)  # runs check 1
    time.sleep(0.1)
    sharing, got = _readers(fresh, 5)  # arrive during check 1: need check 2 or later
    for t in [*first, *sharing]:
        t.join(10)
    assert not any(t.is_alive() for t in [*first, *sharing])
    assert first_got == [table]
    errors = [g for g in got if isinstance(g, OSError)]
    assert len(errors) == 1  # the one that ran check 2
    assert got.count(table) == 4
    assert table.checks == 3


def test_a_catalog_read_sees_a_commit_made_through_another_handle(tmp_path: Path) -> None:
    from storage.config import S3Settings

    writer, reader = IndexStore(S3Settings(), str(tmp_path)), IndexStore(S3Settings(), str(tmp_path))
    assert reader.catalog.get("v1") is None  # the reader's handle is open from here on
    writer.catalog.write(VideoRecord(video_id="v1", uri="s3://b/k", status=VideoStatus.QUEUED), 0)
    got = reader.catalog.get("v1")
    assert got is not None and got.status is VideoStatus.QUEUED
    writer.catalog.write(got.evolve(status=VideoStatus.INDEXING), got.rev)
    again = reader.catalog.get("v1")
    assert again is not None and again.status is VideoStatus.INDEXING
    assert reader.catalog.get_many_at(["v1"], 1) == {}  # version 1: the empty table
    at_2 = reader.catalog.get_many_at(["v1", "v2"], 2)
    assert list(at_2) == ["v1"] and at_2["v1"].status is VideoStatus.QUEUED
