"""The scheduled check: one leader at a time, incremental rounds, its last round kept for status."""

from __future__ import annotations

from pathlib import Path

from pipeline.settings import Settings
from pipeline.upkeep.check import Checker
from pipeline.upkeep.scheduled import ScheduledCheck
from storage.tables import IndexStore
from tests.unit.test_check import BUCKET, Listing, index


def scheduled(store: IndexStore, listing: Listing, now: list[float]) -> ScheduledCheck:
    checker = Checker(
        model_id="tiny",
        every_s=1.0,
        extensions=[".mp4"],
        catalog=store.catalog,
        frames=store.frames,
        lister=listing,
        sink=None,
        in_flight_grace_s=0,
        new_object_grace_s=0,
    )
    return ScheduledCheck(
        checker,
        store.leases,
        [BUCKET],
        interval_s=1,
        objects_per_round=2,
        lease_ttl_s=10,
        repair=False,
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
