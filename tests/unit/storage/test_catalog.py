"""storage/catalog.py over a local LanceDB: every write is a compare-and-set on the row's revision (of
racing writers from one revision exactly one lands), reads select what they say, and store failures
become TransientError."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from pipeline.upkeep.maintenance import ensure_scalar_indexes
from storage.catalog import VIDEOS, VIDEOS_SCHEMA, VideoRecord, VideoStatus
from storage.config import S3Settings
from storage.db import FreshTable
from storage.errors import TransientError
from storage.tables import IndexStore

RACERS = 8
RACE_ROUNDS = 10
#: Longest a racer waits for the others at the barrier, and for a racer to finish.
RACE_WAIT_S = 30.0


@pytest.fixture
def db_dir(tmp_path: Path) -> Path:
    return tmp_path / "lance"


@pytest.fixture
def store(db_dir: Path) -> IndexStore:
    return IndexStore(S3Settings(), uri=str(db_dir))


def record(video_id: str = "v1", status: VideoStatus = VideoStatus.QUEUED, **fields: Any) -> VideoRecord:
    return VideoRecord(video_id=video_id, uri=f"s3://videos/{video_id}.mp4", status=status, **fields)


def rows_of(store: IndexStore, video_id: str) -> int:
    table = store.db.open(VIDEOS)
    assert table is not None
    return int(table.count_rows(f"video_id = '{video_id}'"))


# -- compare-and-set ----------------------------------------------------------------------------------


def test_an_insert_lands_at_revision_one_and_reads_back_whole(store: IndexStore) -> None:
    wanted = record(
        version="e1",
        frames=3,
        fingerprint="fp",
        duration_s=2.5,
        model="m",
        sampling="every_s=1",
        task_id="t1",
        holder="h1",
        crashes=1,
    )
    written = store.catalog.write(wanted, 0)
    assert written is not None and written.rev == 1
    got = store.catalog.get("v1")
    assert got == written
    assert got.evolve(rev=0, updated_at=wanted.updated_at) == wanted  # every field as given


def test_each_write_bumps_the_revision_it_read(store: IndexStore) -> None:
    first = store.catalog.write(record(), 0)
    assert first is not None
    second = store.catalog.write(first.evolve(status=VideoStatus.INDEXING), first.rev)
    assert second is not None and second.rev == 2 and second.status is VideoStatus.INDEXING
    assert store.catalog.get("v1") == second and rows_of(store, "v1") == 1


def test_a_stale_expected_rev_loses_and_returns_none(store: IndexStore) -> None:
    first = store.catalog.write(record(), 0)
    assert first is not None
    winner = store.catalog.write(first.evolve(status=VideoStatus.INDEXING, holder="a"), first.rev)
    assert winner is not None
    # A second writer that also read revision 1 writes after the first: it loses, and learns it.
    assert store.catalog.write(first.evolve(status=VideoStatus.FAILED, error="b"), first.rev) is None
    # So does one that names a revision the row never had.
    assert store.catalog.write(first.evolve(status=VideoStatus.FAILED), winner.rev + 5) is None
    assert store.catalog.get("v1") == winner


def test_an_insert_over_an_existing_row_loses(store: IndexStore) -> None:
    first = store.catalog.write(record(holder="a"), 0)
    assert first is not None
    assert store.catalog.write(record(status=VideoStatus.INDEXING, holder="b"), 0) is None
    assert store.catalog.get("v1") == first and rows_of(store, "v1") == 1


def test_an_update_of_a_missing_row_loses_and_inserts_nothing(store: IndexStore) -> None:
    assert store.catalog.write(record(), 3) is None
    assert store.catalog.get("v1") is None


@pytest.mark.parametrize("indexed", [False, True], ids=["no-index", "btree-on-video-id"])
@pytest.mark.parametrize("from_rev", [0, 2], ids=["insert", "update"])
def test_racing_writers_from_one_revision_exactly_one_wins(db_dir: Path, from_rev: int, indexed: bool) -> None:
    """RACERS threads, each with its own connection, released together, all write from ``from_rev``;
    also with the BTREE index maintenance puts on ``video_id`` (merges must not go through it)."""
    seed = IndexStore(S3Settings(), uri=str(db_dir))
    seed.catalog.get("warm")  # the table exists
    if indexed:
        assert ensure_scalar_indexes(seed) == ["videos.video_id"]
    racers = [IndexStore(S3Settings(), uri=str(db_dir)) for _ in range(RACERS)]
    for round_ in range(RACE_ROUNDS):
        video_id = f"race-{round_}"
        if from_rev:
            base = seed.catalog.write(record(video_id), 0)
            assert base is not None
            base = seed.catalog.write(base.evolve(status=VideoStatus.INDEXING), base.rev)
            assert base is not None and base.rev == from_rev
        else:
            seed.catalog.get(video_id)  # the table exists before the race: the race is for the row
        barrier = threading.Barrier(RACERS)
        results: list[VideoRecord | BaseException | None] = [None] * RACERS

        def race(
            i: int, video_id: str, barrier: threading.Barrier, results: list[VideoRecord | BaseException | None]
        ) -> None:
            store = racers[i]
            seen = store.catalog.get(video_id) or record(video_id)  # each read before the start
            mine = seen.evolve(status=VideoStatus.INDEXED, holder=f"racer-{i}", frames=i)
            try:
                barrier.wait(RACE_WAIT_S)
                results[i] = store.catalog.write(mine, from_rev)
            except BaseException as exc:
                results[i] = exc

        threads = [threading.Thread(target=race, args=(i, video_id, barrier, results)) for i in range(RACERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(RACE_WAIT_S * 2)
        assert not any(t.is_alive() for t in threads)
        winners = [(i, r) for i, r in enumerate(results) if isinstance(r, VideoRecord)]
        # A loser learns it lost: None, or (if the store gave up on the conflict) a TransientError to retry.
        losers = [r for r in results if not isinstance(r, VideoRecord)]
        assert all(r is None or isinstance(r, TransientError) for r in losers), losers
        assert len(winners) == 1, f"round {round_}: {len(winners)} writers won: {results}"
        (i, won) = winners[0]
        row = seed.catalog.get(video_id)
        assert row == won and row.holder == f"racer-{i}" and row.frames == i and row.rev == from_rev + 1
        assert rows_of(seed, video_id) == 1


# -- reads --------------------------------------------------------------------------------------------


def test_find_filters_by_uri_and_status_newest_first(store: IndexStore) -> None:
    for n, status in enumerate([VideoStatus.INDEXED, VideoStatus.FAILED, VideoStatus.INDEXED]):
        assert store.catalog.write(record(f"v{n}", status), 0) is not None
    assert [r.video_id for r in store.catalog.find(status=VideoStatus.INDEXED)] == ["v2", "v0"]
    assert [r.video_id for r in store.catalog.find(uri="s3://videos/v1.mp4")] == ["v1"]
    assert [r.video_id for r in store.catalog.find(limit=2)] == ["v2", "v1"]
    assert store.catalog.find(uri="s3://videos/v1.mp4", status=VideoStatus.INDEXED) == []
    counts = store.catalog.counts()
    assert counts[VideoStatus.INDEXED] == 2 and counts[VideoStatus.FAILED] == 1 and counts[VideoStatus.QUEUED] == 0


def test_quotes_in_ids_and_uris_are_matched_literally(store: IndexStore) -> None:
    odd = VideoRecord(video_id="o'k", uri="s3://videos/o'k.mp4", status=VideoStatus.QUEUED)
    assert store.catalog.write(odd, 0) is not None
    assert store.catalog.write(record("ok"), 0) is not None
    got = store.catalog.get("o'k")
    assert got is not None and got.uri == "s3://videos/o'k.mp4"
    assert [r.video_id for r in store.catalog.find(uri="s3://videos/o'k.mp4")] == ["o'k"]


def test_scan_streams_a_uri_range_in_batches(store: IndexStore) -> None:
    for name in ["a", "b", "c", "d"]:
        assert store.catalog.write(record(name), 0) is not None
    half_open = store.catalog.scan("s3://videos/a.mp4", "s3://videos/c.mp4", include_from=False, batch_rows=1)
    assert sorted(r.video_id for r in half_open) == ["b", "c"]
    closed = store.catalog.scan("s3://videos/a.mp4", "s3://videos/c.mp4", include_from=True, batch_rows=1)
    assert sorted(r.video_id for r in closed) == ["a", "b", "c"]
    assert sorted(r.video_id for r in store.catalog.scan_all(batch_rows=3)) == ["a", "b", "c", "d"]


def test_in_flight_since_finds_only_old_queued_or_indexing_rows(store: IndexStore) -> None:
    for name, status in [("q", VideoStatus.QUEUED), ("i", VideoStatus.INDEXING), ("d", VideoStatus.INDEXED)]:
        assert store.catalog.write(record(name, status), 0) is not None
    later = datetime.now(UTC) + timedelta(seconds=60)
    assert sorted(r.video_id for r in store.catalog.in_flight_since(later)) == ["i", "q"]
    assert store.catalog.in_flight_since(datetime.now(UTC) - timedelta(seconds=60)) == []


# -- store failures -----------------------------------------------------------------------------------


def _failing_videos_table(store: IndexStore, monkeypatch: pytest.MonkeyPatch, method: str, error: Exception) -> None:
    """The catalog's table handle, with ``method`` raising ``error`` (handed out by ``db.create`` and,
    for reads, ``db.fresh``)."""
    table = store.db.create(VIDEOS, VIDEOS_SCHEMA)

    class Failing:
        def __getattr__(self, _: str) -> object:
            return lambda *args, **kwargs: self

        def execute(self, *_: object) -> None:
            raise error

        def to_list(self) -> None:
            raise error

    monkeypatch.setattr(table, method, lambda *_, **__: Failing())
    monkeypatch.setattr(store.db, "create", lambda name, schema: table)
    monkeypatch.setattr(store.db, "fresh", lambda name: FreshTable(lambda: table))


def test_a_commit_conflict_is_transient(store: IndexStore, monkeypatch: pytest.MonkeyPatch) -> None:
    conflict = RuntimeError("lance error: Too many concurrent writers\ncaused by: retry_timeout of 30.000")
    _failing_videos_table(store, monkeypatch, "merge_insert", conflict)
    with pytest.raises(TransientError, match=r"^index table write failed: lance error: Too many concurrent writers$"):
        store.catalog.write(record(), 0)


def test_a_failed_read_is_transient(store: IndexStore, monkeypatch: pytest.MonkeyPatch) -> None:
    _failing_videos_table(store, monkeypatch, "search", OSError("connection reset by peer"))
    with pytest.raises(TransientError, match=r"^index table read failed: connection reset by peer$"):
        store.catalog.get("v1")
