"""storage/models.py over a local LanceDB: table names LanceDB accepts, distinct per model id and new
per backfill; the lifecycle row round-trips through its JSON; of racing writers from one revision
exactly one lands. And the catalog's per-model entries: a row written before per-model tables reads as
speaking of table ``frames``, and the ``indexes`` column is added on first use."""

from __future__ import annotations

import json
import re
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest

from storage.catalog import VIDEOS, VIDEOS_SCHEMA, VideoRecord, VideoStatus
from storage.config import S3Settings
from storage.errors import TransientError
from storage.ids import fingerprint
from storage.models import LEGACY_FRAMES, Backfill, ModelIndex, ModelState, ModelTable, table_name
from storage.sampling import Sampling
from storage.tables import IndexStore

RACERS = 6
RACE_ROUNDS = 5
#: Longest a racer waits for the others at the barrier, and for a racer to finish.
RACE_WAIT_S = 30.0
#: What LanceDB accepts in a table name.
LANCE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def db_dir(tmp_path: Path) -> Path:
    return tmp_path / "lance"


@pytest.fixture
def store(db_dir: Path) -> IndexStore:
    return IndexStore(S3Settings(), uri=str(db_dir))


# -- table names --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model",
    ["google/siglip-base-patch16-224", "Org/Model v2 (final)!", "../../etc", "ünïcode/模型", "", "x" * 300],
)
def test_a_table_name_is_one_lancedb_accepts(model: str, db_dir: Path) -> None:
    name = table_name(model, 768)
    assert LANCE_NAME.match(name), name
    assert name.startswith("frames-") and "-768d-" in name
    db = IndexStore(S3Settings(), uri=str(db_dir)).db
    db.create(name, pa.schema([pa.field("x", pa.int64())]))
    assert db.open(name) is not None


def test_two_ids_of_one_slug_get_distinct_names() -> None:
    # Both lower-case and strip to the slug "org-model"; the id's hash keeps them apart.
    a, b = table_name("Org/Model", 8, "g1"), table_name("org_model", 8, "g1")
    assert a != b
    assert a.split("-")[1:3] == b.split("-")[1:3] == ["org", "model"]
    # Long ids that differ only at the front share the (tail) slug, not the name.
    long_a, long_b = "a/" + "x" * 80, "b/" + "x" * 80
    assert table_name(long_a, 8, "g1") != table_name(long_b, 8, "g1")


def test_every_call_names_a_new_generation() -> None:
    names = {table_name("org/model", 8) for _ in range(50)}
    assert len(names) == 50
    assert table_name("org/model", 8, "abc") == table_name("org/model", 8, "abc")
    assert ModelTable.new("org/model", 8).table != ModelTable.new("org/model", 8).table


# -- the lifecycle row ------------------------------------------------------------------------------


def full_state() -> ModelState:
    backfill = Backfill(
        started_at=T0,
        live_from=T0 + timedelta(seconds=32),
        auto=True,
        total=10,
        done=4,
        done_at_resume=2,
        resumed_at=T0 + timedelta(minutes=1),
        progress_at=T0 + timedelta(minutes=2),
        failed=1,
        waiting_for="the vector index of the new table",
        waiting_since=T0 + timedelta(minutes=3),
    )
    return ModelState(
        active=ModelTable("model-a", 8, table_name("model-a", 8, "g1")),
        target=ModelTable("model-b", 12, table_name("model-b", 12, "g2")),
        backfill=backfill,
        retired=(ModelTable("model-0", 4, LEGACY_FRAMES), ModelTable("model-z", 4, table_name("model-z", 4, "g0"))),
        switched_at=T0 - timedelta(days=1),
        text=ModelTable.for_text("subtitles+speech:pocketsphinx/en-us"),
    )


def test_the_state_round_trips_through_the_registry_every_field(store: IndexStore) -> None:
    assert store.models.read() == ModelState()  # nothing before the first write
    state = full_state()
    written = store.models.write(state, 0)
    assert written is not None and written.rev == 1 and written.updated_at is not None
    # A fresh connection reads every field back, datetimes with their zone.
    read = IndexStore(S3Settings(), uri=store.db.uri).models.read()
    assert read == written
    assert read.evolve(rev=0, updated_at=None) == state
    assert read.backfill is not None and read.backfill.live_from.tzinfo is not None
    assert isinstance(read.retired, tuple) and read.live() == [state.active, state.target]
    assert read.tables() == [state.active, state.target, state.text] and read.text is not None
    assert read.text.is_text and read.text.pipeline == "subtitles+speech:pocketsphinx/en-us"


def test_a_read_finds_every_commit_and_reads_the_row_only_when_the_table_moved(store: IndexStore) -> None:
    """The registry's reader and a writer of another connection: each read sees the latest write, and the
    row itself is read again only after a commit (the manifest check alone answers the rest)."""
    writer = IndexStore(S3Settings(), uri=store.db.uri).models
    first = writer.write(ModelState(active=ModelTable.new("model-a", 8)), 0)
    assert first is not None and store.models.read() == first
    table = store.models._fresh.table()  # type: ignore[union-attr]
    scans: list[int] = []
    search = table.search

    def counted(*args: object, **kwargs: object) -> object:
        scans.append(1)
        return search(*args, **kwargs)

    table.search = counted
    assert store.models.read() == first and store.models.read() == first
    assert scans == []  # the table did not move: the row read before stands
    second = writer.write(first.evolve(target=ModelTable.new("model-b", 12)), first.rev)
    assert second is not None and store.models.read() == second
    assert scans == [1]


def test_a_row_written_before_text_tables_reads_with_none() -> None:
    data = json.loads(full_state().to_json())
    del data["text"]
    read = ModelState.from_row({"state": json.dumps(data), "rev": 3, "updated_at": None})
    assert read.text is None and read.tables() == read.live()


def test_an_idle_state_round_trips_with_nones(store: IndexStore) -> None:
    state = ModelState(active=ModelTable("model-a", 8, LEGACY_FRAMES))
    written = store.models.write(state, 0)
    assert written is not None
    read = store.models.read()
    assert read == written and read.target is None and read.backfill is None and read.retired == ()


def test_a_backfill_key_this_version_does_not_know_is_left_out() -> None:
    """A row a newer version wrote (a rollback reads it) still reads: unknown backfill keys are dropped."""
    data = json.loads(full_state().to_json())
    data["backfill"]["written_by_a_newer_version"] = 1
    read = ModelState.from_row({"state": json.dumps(data), "rev": 3, "updated_at": None})
    assert read.backfill == full_state().backfill


def test_a_write_from_a_stale_revision_loses(store: IndexStore) -> None:
    first = store.models.write(ModelState(active=ModelTable.new("model-a", 8)), 0)
    assert first is not None
    second = store.models.write(first.evolve(target=ModelTable.new("model-b", 12)), first.rev)
    assert second is not None and second.rev == 2
    assert store.models.write(first.evolve(retired=(ModelTable.new("x", 1),)), first.rev) is None
    assert store.models.write(ModelState(active=ModelTable.new("model-c", 4)), 0) is None  # the row exists
    assert store.models.read() == second


@pytest.mark.parametrize("from_rev", [0, 2], ids=["first-write", "update"])
def test_racing_writers_from_one_revision_exactly_one_lands(db_dir: Path, from_rev: int) -> None:
    """RACERS threads with a connection each, released together by a barrier, all write from ``from_rev``."""
    for round_ in range(RACE_ROUNDS):
        uri = str(db_dir / f"round-{round_}")
        seed = IndexStore(S3Settings(), uri=uri)
        seed.models.read()  # the table exists: the race is for the row
        if from_rev:
            base = seed.models.write(ModelState(active=ModelTable.new("model-a", 8)), 0)
            assert base is not None
            base = seed.models.write(base.evolve(switched_at=T0), base.rev)
            assert base is not None and base.rev == from_rev
        racers = [IndexStore(S3Settings(), uri=uri) for _ in range(RACERS)]
        barrier = threading.Barrier(RACERS)
        results: list[ModelState | BaseException | None] = [None] * RACERS

        def race(
            i: int,
            racers: list[IndexStore],
            barrier: threading.Barrier,
            results: list[ModelState | BaseException | None],
        ) -> None:
            registry = racers[i].models
            seen = registry.read()
            mine = seen.evolve(target=ModelTable(f"model-{i}", 4, table_name(f"model-{i}", 4, "g")))
            try:
                barrier.wait(RACE_WAIT_S)
                results[i] = registry.write(mine, from_rev)
            except BaseException as exc:
                results[i] = exc

        threads = [threading.Thread(target=race, args=(i, racers, barrier, results)) for i in range(RACERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(RACE_WAIT_S * 2)
        assert not any(t.is_alive() for t in threads)
        winners = [(i, r) for i, r in enumerate(results) if isinstance(r, ModelState)]
        losers = [r for r in results if not isinstance(r, ModelState)]
        # A loser learns it lost: None, or (if the store gave up on the conflict) a TransientError.
        assert all(r is None or isinstance(r, TransientError) for r in losers), losers
        assert len(winners) == 1, f"round {round_}: {len(winners)} writers landed: {results}"
        i, won = winners[0]
        row = seed.models.read()
        assert row == won and row.rev == from_rev + 1 and row.target is not None and row.target.model == f"model-{i}"
        table = seed.db.open("models")
        assert table is not None and table.count_rows() == 1


# -- the catalog's per-model entries ----------------------------------------------------------------

#: Neither ``indexes`` (added with per-model tables) nor ``write_id`` (added with read-back writes).
OLD_VIDEOS_SCHEMA = pa.schema([f for f in VIDEOS_SCHEMA if f.name not in ("indexes", "write_id")])


def legacy_catalog(db_dir: Path, **row: object) -> None:
    """A ``videos`` table as a release before per-model tables made it, holding one row."""
    seed = IndexStore(S3Settings(), uri=str(db_dir))
    table = seed.db.create(VIDEOS, OLD_VIDEOS_SCHEMA)
    base = {
        "video_id": "v1",
        "uri": "s3://videos/v1.mp4",
        "version": "e1",
        "status": "indexed",
        "error": None,
        "frames": 4,
        "fingerprint": fingerprint("e1", "model-a", Sampling(1.0)),
        "duration_s": 4.0,
        "model": "model-a",
        "sampling": "every_s=1",
        "rev": 3,
        "task_id": None,
        "holder": None,
        "crashes": 0,
        "updated_at": T0,
    }
    table.add(pa.Table.from_pylist([{**base, **row}], schema=OLD_VIDEOS_SCHEMA))


def test_a_legacy_row_speaks_of_the_frames_table_and_the_column_is_added_on_first_use(db_dir: Path) -> None:
    """A catalog made before per-model tables (the old schema: ``create`` with ``exist_ok`` refuses
    it) is opened, and its ``indexes`` column added on first use."""
    legacy_catalog(db_dir)
    store = IndexStore(S3Settings(), uri=str(db_dir))
    opened = store.db.open(VIDEOS)
    assert opened is not None and "indexes" not in opened.schema.names
    record = store.catalog.get("v1")
    assert record is not None and record.rev == 3
    assert record.indexes == (
        ModelIndex(LEGACY_FRAMES, "model-a", fingerprint("e1", "model-a", Sampling(1.0)), 4, Sampling(1.0)),
    )
    assert record.index_in(LEGACY_FRAMES) is not None and record.index_in("frames-other") is None
    reopened = store.db.open(VIDEOS)
    assert reopened is not None and {"indexes", "write_id"} <= set(reopened.schema.names)
    # A new write round-trips its entries, the legacy one rewritten as an entry of its own.
    entry_b = ModelIndex(
        "frames-model-b-1234abcd-12d-g1", "model-b", fingerprint("e1", "model-b", Sampling(2.0)), 2, Sampling(2.0)
    )
    written = store.catalog.write(record.evolve(indexes=(*record.indexes, entry_b)), record.rev)
    assert written is not None
    again = IndexStore(S3Settings(), uri=str(db_dir)).catalog.get("v1")
    assert again == written and again.indexes == (record.indexes[0], entry_b)


@pytest.mark.parametrize(
    "row",
    [
        {"status": "deleted", "frames": 0, "fingerprint": None},
        {"status": "queued", "frames": 0, "fingerprint": None, "model": None, "sampling": None},
        {"sampling": None},
    ],
    ids=["deleted", "queued", "no-sampling"],
)
def test_a_legacy_row_without_rows_has_no_entries(db_dir: Path, row: dict[str, object]) -> None:
    legacy_catalog(db_dir, **row)
    record = IndexStore(S3Settings(), uri=str(db_dir)).catalog.get("v1")
    assert record is not None and record.indexes == ()


def test_a_second_process_opening_a_migrated_catalog_adds_nothing(db_dir: Path) -> None:
    legacy_catalog(db_dir)
    first = IndexStore(S3Settings(), uri=str(db_dir))
    assert first.catalog.get("v1") is not None
    version = first.catalog.version()
    second = IndexStore(S3Settings(), uri=str(db_dir))
    record = second.catalog.get("v1")
    assert record is not None and second.catalog.version() == version


def test_a_new_catalog_round_trips_entries(store: IndexStore) -> None:
    entries = (
        ModelIndex("frames-a-1-8d-g", "model-a", "fpa", 3, Sampling(1.0)),
        ModelIndex("frames-b-2-12d-g", "model-b", "fpb", 3, Sampling(1.0)),
    )
    record = VideoRecord("v9", "s3://videos/v9.mp4", VideoStatus.INDEXED, version="e1", indexes=entries)
    written = store.catalog.write(record, 0)
    assert written is not None and store.catalog.get("v9") == written and written.indexes == entries


def test_a_rows_entries_are_stored_as_they_always_were() -> None:
    """The ``indexes`` column's JSON, byte for byte, as written before entries held a ``Sampling``."""
    entry = ModelIndex("frames-a-1-8d-g", "model-a", "fpa", 3, Sampling(1.0))
    row = VideoRecord("v1", "s3://videos/a.mp4", VideoStatus.INDEXED, indexes=(entry,)).to_row()
    stored = '[{"every_s": 1.0, "fingerprint": "fpa", "frames": 3, "model": "model-a", "table": "frames-a-1-8d-g"}]'
    assert row["indexes"] == stored
    assert VideoRecord.from_row(row).indexes == (entry,)


def test_keys_a_newer_release_wrote_survive_this_release_s_writes(store: IndexStore) -> None:
    """A rollback mid-rollout: this release rewrites the row (a backfill's progress, a cleanup) and
    the newer release's keys are still there afterwards, as they were."""
    state = full_state()
    data = json.loads(state.to_json())
    data["written_by_a_newer_release"] = {"table": "x-1", "n": 2}
    read = ModelState.from_row({"state": json.dumps(data), "rev": 3, "updated_at": None})
    assert read.evolve(rev=0) == state  # compares what this release knows
    written = store.models.write(read.evolve(switched_at=T0), 0)
    assert written is not None
    again = json.loads(ModelState.from_row({"state": written.to_json(), "rev": 1, "updated_at": None}).to_json())
    assert again["written_by_a_newer_release"] == {"table": "x-1", "n": 2}
