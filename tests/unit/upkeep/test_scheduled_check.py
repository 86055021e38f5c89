"""The scheduled check: one leader at a time, incremental rounds, its last round kept for status, and
its loop keeping a failed round's error until a round succeeds."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.settings import Settings
from pipeline.upkeep.check import Checker
from pipeline.upkeep.scheduled import ScheduledCheck
from storage.catalog import VideoRecord, VideoStatus
from storage.errors import PermanentError, TransientError
from storage.ids import s3_uri, video_id
from storage.s3 import ObjectHead
from storage.sampling import Sampling
from storage.tables import IndexStore
from tests.unit.upkeep.test_check import BUCKET, Listing, Sink, index

#: Longest the loop's thread is waited for.
WAIT_S = 10.0


def scheduled(
    store: IndexStore,
    listing: Listing,
    now: list[float],
    interval_s: float = 1,
    *,
    buckets: list[str] | None = None,
    sink: Sink | None = None,
    objects_per_round: int = 2,
) -> ScheduledCheck:
    """A scheduled check over ``listing`` with no grace; with ``sink`` it repairs what it finds."""
    checker = Checker(
        model_id="tiny",
        sampling=Sampling(1.0),
        extensions=[".mp4"],
        catalog=store.catalog,
        frames=store.frames,
        lister=listing,
        sink=sink,
        in_flight_grace_s=0,
        new_object_grace_s=0,
    )
    return ScheduledCheck(
        checker,
        store.leases,
        buckets or [BUCKET],
        interval_s=interval_s,
        objects_per_round=objects_per_round,
        lease_ttl_s=10,
        repair=sink is not None,
        clock=lambda: now[0],
    )


def test_one_worker_checks_while_it_holds_the_lease(tmp_path: Path) -> None:
    store = IndexStore(Settings().s3, uri=str(tmp_path / "lance"))
    listing = Listing()
    now = [1000.0]
    a, b = scheduled(store, listing, now), scheduled(store, listing, now)
    assert a.run_once() is not None and b.run_once() is None
    assert a.state.leader and not b.state.leader
    now[0] += 11  # a stopped renewing: the lease expired
    assert b.run_once() is not None and b.state.leader


def test_rounds_walk_the_bucket_and_keep_the_last_report(tmp_path: Path) -> None:
    store = IndexStore(Settings().s3, uri=str(tmp_path / "lance"))
    listing = Listing()
    for i in range(3):
        listing.put(f"k{i}.mp4")
        index(store, f"k{i}.mp4")
    listing.put("missing.mp4")
    loop = scheduled(store, listing, [0.0])
    listed = []
    for _ in range(3):
        report = loop.run_once()
        assert report is not None
        listed.append(report.listed)
    assert listed == [2, 2, 2]  # k0 k1 | k2 missing | (wrapped) k0 k1
    state = loop.state.as_json()
    assert state["rounds"] == 3 and state["last"]["listed"] == 2 and state["leader"] is True


class FlakyListing(Listing):
    """A bucket listing that fails while ``failing``."""

    failing = True

    def pages(self, bucket: str, prefix: str, start_after: str | None) -> Iterator[list[ObjectHead]]:
        if self.failing:
            raise OSError("store unreachable")
        return super().pages(bucket, prefix, start_after)


def test_the_loop_keeps_a_failed_rounds_error_until_a_round_succeeds(tmp_path: Path) -> None:
    store = IndexStore(Settings().s3, uri=str(tmp_path / "lance"))
    listing = FlakyListing()
    listing.put("k0.mp4")
    check = scheduled(store, listing, [1000.0], interval_s=0.01)
    thread, stop = check.service.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while check.state.last_error is None:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert "store unreachable" in check.state.last_error
        failed_rounds = check.state.rounds
        listing.failing = False
        while check.state.last_error is not None or check.state.rounds <= failed_rounds:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        state = check.state
        assert state.last_error is None and state.leader and state.last is not None and state.last.listed == 1
    finally:
        stop.set()
        thread.join(WAIT_S)
    assert not thread.is_alive() and thread.name == "scheduled-check"


class GoneBucketListing(Listing):
    """Two buckets: ``gone`` was deleted after it was configured (its listing always fails)."""

    def pages(self, bucket: str, prefix: str, start_after: str | None) -> Iterator[list[ObjectHead]]:
        if bucket == "gone":
            raise PermanentError("the bucket gone does not exist (NoSuchBucket)")
        return super().pages(bucket, prefix, start_after)


def stuck_row(store: IndexStore, key: str) -> VideoRecord:
    """A row left `indexing` by a job that died (the grace is 0 in these tests)."""
    vid = video_id(BUCKET, key)
    written = store.catalog.write(VideoRecord(vid, s3_uri(BUCKET, key), VideoStatus.INDEXING, version="e1"), 0)
    assert written is not None
    return written


def repairing(store: IndexStore, listing: Listing, buckets: list[str], sink: Sink, now: list[float]) -> ScheduledCheck:
    return scheduled(store, listing, now, buckets=buckets, sink=sink, objects_per_round=100)


def test_a_deleted_bucket_does_not_stop_stuck_row_repair_or_the_walk_of_the_others(tmp_path: Path) -> None:
    store = IndexStore(Settings().s3, uri=str(tmp_path / "lance"))
    listing = GoneBucketListing()
    listing.put("stuck.mp4")
    stuck_row(store, "stuck.mp4")
    listing.put("missing.mp4")  # never indexed: the walk of the live bucket finds it
    sink = Sink()
    check = repairing(store, listing, ["gone", BUCKET], sink, [1000.0])
    for _ in range(2):  # every round, not once
        report = check.run_once()
        assert report is not None
        assert "gone" in report.errors and "NoSuchBucket" in report.errors["gone"]
        assert BUCKET in report.buckets and report.listed == 2
    assert sorted(j.key for j in sink.jobs) == ["missing.mp4", "missing.mp4", "stuck.mp4"]
    assert check.state.last_error is not None and "gone" in check.state.last_error
    # A round in which every bucket failed checked nothing: kept as the last round, but not a success.
    only_gone = repairing(store, listing, ["gone"], Sink(), [2000.0])  # after the first one's lease
    with pytest.raises(TransientError, match="checked too little"):
        only_gone.run_once()
    assert only_gone.state.last is not None and "gone" in only_gone.state.last.errors


def test_a_resubmitted_stuck_row_is_not_resubmitted_again_until_it_changes_or_its_stamp_expires(
    tmp_path: Path,
) -> None:
    store = IndexStore(Settings().s3, uri=str(tmp_path / "lance"))
    listing = Listing()
    row = stuck_row(store, "stuck.mp4")
    sink = Sink()
    now = [1000.0]
    check = repairing(store, listing, [BUCKET], sink, now)
    for _ in range(3):  # its job waits in a backlog: the row does not change
        assert check.run_once() is not None
        now[0] += 1
    assert [j.key for j in sink.jobs] == ["stuck.mp4"]
    # The job ran and died again: the row changed, so it is stuck anew and resubmitted.
    assert store.catalog.write(row.evolve(holder="another"), row.rev) is not None
    assert check.run_once() is not None
    assert len(sink.jobs) == 2
    now[0] += 14_401  # the stamp expired (the job may have been lost): once more
    assert check.run_once() is not None
    assert len(sink.jobs) == 3
