"""pipeline/upkeep/check.py with several live models over a real local LanceDB: each table's rows are held
against the catalog's entry for that table, findings about rows name their model in
``report.models``, and a backfill's partial progress is not a finding."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from pipeline.reindex.lifecycle import LiveModels
from pipeline.settings import Settings
from pipeline.upkeep.check import Checker, Finding
from pipeline.upkeep.sources import FrameReader
from storage.catalog import VideoRecord, VideoStatus
from storage.frames import FrameRow, FrameSummary, VideoFrames, frames_schema
from storage.ids import fingerprint, s3_uri, video_id
from storage.models import ModelIndex, ModelState, ModelTable, table_name
from storage.s3 import ObjectHead
from storage.sampling import Sampling
from storage.tables import IndexStore

A = ModelTable("model-a", 8, table_name("model-a", 8, "g1"))
B = ModelTable("model-b", 12, table_name("model-b", 12, "g2"))
BUCKET = "videos"
OLD = datetime(2020, 1, 1, tzinfo=UTC)


class Listing:
    def __init__(self) -> None:
        self.objects: dict[str, ObjectHead] = {}

    def put(self, key: str, version: str = "e1") -> None:
        self.objects[key] = ObjectHead(BUCKET, key, 10, version, None, None, OLD)

    def pages(self, bucket: str, prefix: str, start_after: str | None) -> Iterator[list[ObjectHead]]:
        keys = sorted(k for k in self.objects if k.startswith(prefix) and (start_after is None or k > start_after))
        yield [self.objects[k] for k in keys]


@pytest.fixture
def store(tmp_path: Path) -> IndexStore:
    return IndexStore(Settings().s3, uri=str(tmp_path / "lance"))


def checker(
    store: IndexStore,
    listing: Listing,
    models: Callable[[], list[ModelTable]] = lambda: [A, B],
    frames_for: Callable[[str], FrameReader] | None = None,
) -> Checker:
    return Checker(
        model_id=A.model,
        sampling=Sampling(1.0),
        extensions=[".mp4"],
        catalog=store.catalog,
        frames=store.frames,
        lister=listing,
        sink=None,
        in_flight_grace_s=60.0,
        new_object_grace_s=60.0,
        models=models,
        frames_for=frames_for or store.frames_table,
    )


def rows(key: str, dim: int, n: int) -> list[FrameRow]:
    rng = np.random.default_rng(dim)
    vid = video_id(BUCKET, key)
    return [FrameRow(f"{vid}-{i:07d}", float(i), rng.random(dim).astype(np.float32), None) for i in range(n)]


def write_rows(store: IndexStore, t: ModelTable, key: str, version: str = "e1", n: int = 3) -> None:
    fp = fingerprint(version, t.model, Sampling(1.0))
    vid = video_id(BUCKET, key)
    store.frames_table(t.table).replace(
        VideoFrames(vid, s3_uri(BUCKET, key), version, fp, t.model, rows(key, t.dim, n))
    )


def index(
    store: IndexStore, key: str, version: str = "e1", entries: tuple[ModelTable, ...] = (A, B), n: int = 3
) -> VideoRecord:
    """A video as a job leaves it: rows in each table of ``entries``, then the row naming them."""
    for t in entries:
        write_rows(store, t, key, version, n)
    indexes = tuple(
        ModelIndex(t.table, t.model, fingerprint(version, t.model, Sampling(1.0)), n, Sampling(1.0)) for t in entries
    )
    vid = video_id(BUCKET, key)
    record = VideoRecord(
        vid,
        s3_uri(BUCKET, key),
        VideoStatus.INDEXED,
        version=version,
        frames=n,
        fingerprint=indexes[0].fingerprint,
        indexes=indexes,
    )
    seen = store.catalog.get(vid)
    written = store.catalog.write(record.evolve(rev=seen.rev) if seen else record, seen.rev if seen else 0)
    assert written is not None
    return written


def test_a_consistent_index_lists_both_models_with_no_findings(store: IndexStore) -> None:
    listing = Listing()
    for key in ("a.mp4", "b.mp4"):
        listing.put(key)
        index(store, key)
    report = checker(store, listing).run([BUCKET])
    assert report.inconsistencies == 0 and report.in_sync == 2
    assert report.models == {A.model: 0, B.model: 0}
    assert report.as_json()["models"] == {A.model: 0, B.model: 0}


def test_rows_in_one_table_with_no_entry_for_it_are_a_mismatch_of_that_model(store: IndexStore) -> None:
    listing = Listing()
    listing.put("a.mp4")
    index(store, "a.mp4", entries=(A,))
    write_rows(store, B, "a.mp4")  # B holds rows the catalog doesn't know of
    report = checker(store, listing).run([BUCKET])
    assert [i.finding for i in report.found] == [Finding.ROWS_MISMATCH]
    assert report.models == {A.model: 0, B.model: 1}
    assert report.found[0].detail.startswith(f"{B.model} ({B.table}):")


def test_an_entry_whose_rows_are_missing_is_a_mismatch_of_that_model(store: IndexStore) -> None:
    listing = Listing()
    listing.put("a.mp4")
    record = index(store, "a.mp4")
    store.frames_table(B.table).delete(record.video_id)
    report = checker(store, listing).run([BUCKET])
    assert [i.finding for i in report.found] == [Finding.ROWS_MISMATCH] and report.models == {A.model: 0, B.model: 1}


def test_repeated_frame_ids_in_one_table_are_duplicates_of_that_model(store: IndexStore) -> None:
    listing = Listing()
    listing.put("a.mp4")
    record = index(store, "a.mp4")
    table = store.frames_table(B.table).table()
    assert table is not None
    fp = fingerprint("e1", B.model, Sampling(1.0))
    dup = {
        "frame_id": f"{record.video_id}-0000000",
        "video_id": record.video_id,
        "uri": record.uri,
        "version": "e1",
        "fingerprint": fp,
        "ts_s": 0.0,
        "vector": [0.1] * B.dim,
        "thumbnail": None,
        "model": B.model,
    }
    table.add(pa.Table.from_pylist([dup], schema=frames_schema(B.dim)))  # bypasses the merge on frame_id
    report = checker(store, listing).run([BUCKET])
    assert [i.finding for i in report.found] == [Finding.DUPLICATE_FRAMES]
    assert report.models == {A.model: 0, B.model: 1}


def test_orphan_rows_in_one_table_name_that_model(store: IndexStore) -> None:
    listing = Listing()
    write_rows(store, B, "stray.mp4")
    report = checker(store, listing).run([BUCKET])
    assert [i.finding for i in report.found] == [Finding.ORPHAN_ROWS] and report.models == {A.model: 0, B.model: 1}


def test_a_video_with_only_the_active_entry_during_a_backfill_is_in_sync(store: IndexStore) -> None:
    listing = Listing()
    listing.put("a.mp4")
    listing.put("b.mp4")
    index(store, "a.mp4", entries=(A,))  # not backfilled yet
    index(store, "b.mp4")  # backfilled
    report = checker(store, listing).run([BUCKET])
    assert report.inconsistencies == 0 and report.in_sync == 2 and report.models == {A.model: 0, B.model: 0}


def test_an_active_entry_of_another_version_is_stale(store: IndexStore) -> None:
    listing = Listing()
    listing.put("a.mp4", "e2")  # overwritten; the index still holds e1
    index(store, "a.mp4", "e1")
    report = checker(store, listing).run([BUCKET])
    assert [i.finding for i in report.found] == [Finding.STALE]
    assert report.models == {A.model: 0, B.model: 0}  # not about either table's rows


def test_after_the_switch_only_the_new_active_table_is_checked(store: IndexStore) -> None:
    listing = Listing()
    listing.put("a.mp4")
    record = index(store, "a.mp4")
    store.frames_table(A.table).delete(record.video_id)  # the retired table's rows no longer matter
    report = checker(store, listing, models=lambda: [B]).run([BUCKET])
    assert report.inconsistencies == 0 and report.in_sync == 1 and report.models == {B.model: 0}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ReadThenWait:
    """A frames reader that lets time pass right after it read (a slow range, an injected pause)."""

    def __init__(self, inner: FrameReader, after: Callable[[], None]) -> None:
        self._inner = inner
        self._after = after

    def summaries_in(self, uri_from: str, uri_to: str, *, include_from: bool) -> dict[str, FrameSummary]:
        found = self._inner.summaries_in(uri_from, uri_to, include_from=include_from)
        self._after()
        return found


def test_a_lifecycle_refresh_within_one_range_is_not_a_finding(store: IndexStore) -> None:
    """A range's videos are judged against the tables its frames were read for: when ``LiveModels``
    refreshes meanwhile, a table it learnt of is not judged as holding nothing (a false rows_mismatch)."""
    listing = Listing()
    listing.put("a.mp4")
    store.models.write(ModelState(active=A), 0)
    clock = Clock()
    live = LiveModels(store.models, refresh_s=2.0, clock=clock)
    live.live()  # cached: [A]
    # A backfill to B starts, and the video's backfill job lands, before the cache is refreshed.
    state = store.models.read()
    store.models.write(state.evolve(target=B), state.rev)
    index(store, "a.mp4")

    def time_passes() -> None:
        clock.now += 5.0

    def frames_for(name: str) -> Any:
        return ReadThenWait(store.frames_table(name), time_passes)

    report = checker(store, listing, models=live.live, frames_for=frames_for).run([BUCKET])
    assert report.inconsistencies == 0, report.found
