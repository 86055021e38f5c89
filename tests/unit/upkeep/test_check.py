"""The invariant checker over a real local LanceDB (catalog and frames) and an in-memory bucket listing."""

from __future__ import annotations

import tracemalloc
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from events.jobs import IndexJob, JobOp
from pipeline.settings import Settings
from pipeline.upkeep.check import MAX_REPORTED, Checker, Finding
from storage.catalog import VideoRecord, VideoStatus
from storage.frames import FrameRow, FrameSummary, VideoFrames
from storage.ids import fingerprint, s3_uri, video_id
from storage.s3 import ObjectHead
from storage.sampling import Sampling
from storage.tables import IndexStore

MODEL = "tiny"
BUCKET = "videos"
OLD = datetime(2020, 1, 1, tzinfo=UTC)


class Listing:
    def __init__(self) -> None:
        self.objects: dict[str, ObjectHead] = {}

    def put(self, key: str, version: str = "e1", modified: datetime = OLD) -> ObjectHead:
        self.objects[key] = ObjectHead(BUCKET, key, 10, version, None, None, modified)
        return self.objects[key]

    def pages(self, bucket: str, prefix: str, start_after: str | None) -> Iterator[list[ObjectHead]]:
        keys = sorted((k for k in self.objects if k.startswith(prefix)), key=str.encode)
        keys = [k for k in keys if start_after is None or k.encode() > start_after.encode()]
        for i in range(0, len(keys), 2):
            yield [self.objects[k] for k in keys[i : i + 2]]


class Sink:
    def __init__(self) -> None:
        self.jobs: list[IndexJob] = []

    def submit(self, job: IndexJob) -> str:
        self.jobs.append(job)
        return f"t{len(self.jobs)}"


@pytest.fixture
def store(tmp_path: Path) -> IndexStore:
    return IndexStore(Settings().s3, uri=str(tmp_path / "lance"))


def checker(store: IndexStore, listing: Listing, sink: Sink | None = None, grace_s: float = 60.0) -> Checker:
    return Checker(
        model_id=MODEL,
        sampling=Sampling(1.0),
        extensions=[".mp4"],
        catalog=store.catalog,
        frames=store.frames,
        lister=listing,
        sink=sink,
        in_flight_grace_s=grace_s,
        new_object_grace_s=grace_s,
    )


def rows(key: str, n: int, seed: int = 0) -> list[FrameRow]:
    rng = np.random.default_rng(seed)
    vid = video_id(BUCKET, key)
    return [FrameRow(f"{vid}-{i:07d}", float(i), rng.random(8).astype(np.float32), None) for i in range(n)]


def index(store: IndexStore, key: str, version: str = "e1", n: int = 3) -> VideoRecord:
    """A video indexed as a job leaves it: rows of the fingerprint, then the catalog row."""
    fp = fingerprint(version, MODEL, Sampling(1.0))
    vid = video_id(BUCKET, key)
    store.frames.replace(VideoFrames(vid, s3_uri(BUCKET, key), version, fp, MODEL, rows(key, n)))
    seen = store.catalog.get(vid)
    record = VideoRecord(vid, s3_uri(BUCKET, key), VideoStatus.INDEXED, version=version, frames=n, fingerprint=fp)
    written = store.catalog.write(record if seen is None else record.evolve(rev=seen.rev), seen.rev if seen else 0)
    assert written is not None
    return written


def test_a_bucket_in_step_with_the_index_has_no_findings(store: IndexStore) -> None:
    listing = Listing()
    for key in ("a.mp4", "b.mp4", "c.mp4"):
        listing.put(key)
        index(store, key)
    listing.put("notes.txt")
    report = checker(store, listing).run([BUCKET])
    assert report.inconsistencies == 0 and report.in_sync == 3 and report.ignored == 1 and report.videos == 3


def test_indexed_without_its_rows_is_found_and_repaired(store: IndexStore) -> None:
    listing, sink = Listing(), Sink()
    listing.put("a.mp4")
    record = index(store, "a.mp4")
    store.frames.delete(record.video_id)
    report = checker(store, listing, sink).run([BUCKET], repair=True)
    assert report.counts[Finding.ROWS_MISMATCH] == 1 and "catalog says 3 rows" in report.found[0].detail
    assert [(j.op, j.key) for j in sink.jobs] == [(JobOp.INDEX, "a.mp4")] and report.submitted == 1


def test_rows_of_another_version_under_an_indexed_row_are_found(store: IndexStore) -> None:
    listing = Listing()
    listing.put("a.mp4", "e2")
    record = index(store, "a.mp4", "e2")
    old = fingerprint("e1", MODEL, Sampling(1.0))
    store.frames.replace(VideoFrames(record.video_id, record.uri, "e1", old, MODEL, rows("a.mp4", 3)))
    report = checker(store, listing).run([BUCKET])
    assert [i.finding for i in report.found] == [Finding.ROWS_MISMATCH] and old in report.found[0].detail


def test_rows_of_a_deleted_video_and_rows_without_a_catalog_row_are_found(store: IndexStore) -> None:
    listing, sink = Listing(), Sink()
    record = index(store, "gone.mp4")
    store.catalog.write(record.evolve(status=VideoStatus.DELETED, frames=0, fingerprint=None), record.rev)
    vid = video_id(BUCKET, "stray.mp4")
    fp = fingerprint("e1", MODEL, Sampling(1.0))
    store.frames.replace(VideoFrames(vid, s3_uri(BUCKET, "stray.mp4"), "e1", fp, MODEL, rows("stray.mp4", 2)))
    report = checker(store, listing, sink).run([BUCKET], repair=True)
    assert report.counts[Finding.ROWS_MISMATCH] == 1 and report.counts[Finding.ORPHAN_ROWS] == 1
    assert sorted((j.op.value, j.key) for j in sink.jobs) == [("delete", "gone.mp4"), ("delete", "stray.mp4")]


def test_a_row_whose_object_is_gone_is_orphaned(store: IndexStore) -> None:
    listing, sink = Listing(), Sink()
    index(store, "a.mp4")
    report = checker(store, listing, sink).run([BUCKET], repair=True)
    assert [i.finding for i in report.found] == [Finding.ORPHANED]
    assert [(j.op, j.key) for j in sink.jobs] == [(JobOp.DELETE, "a.mp4")]


def test_missing_and_stale_objects_wait_out_the_grace(store: IndexStore) -> None:
    listing = Listing()
    listing.put("new.mp4", modified=datetime.now(UTC))
    listing.put("old.mp4")
    listing.put("changed.mp4", "e2")
    index(store, "changed.mp4", "e1")
    report = checker(store, listing).run([BUCKET])
    assert report.counts[Finding.MISSING] == 1 and report.counts[Finding.STALE] == 1 and report.in_flight == 1
    strict = checker(store, listing, grace_s=0).run([BUCKET])
    assert strict.counts[Finding.MISSING] == 2 and strict.in_flight == 0


def test_queued_or_indexing_past_the_grace_is_stuck(store: IndexStore) -> None:
    listing = Listing()
    listing.put("a.mp4")
    listing.put("b.mp4")
    for key in ("a.mp4", "b.mp4"):
        store.catalog.write(VideoRecord(video_id(BUCKET, key), s3_uri(BUCKET, key), VideoStatus.INDEXING), 0)
    assert checker(store, listing).run([BUCKET]).in_flight == 2
    report = checker(store, listing, grace_s=0).run([BUCKET])
    assert report.counts[Finding.STUCK] == 2 and report.in_flight == 0


def test_a_video_failed_at_its_current_version_is_not_an_inconsistency(store: IndexStore) -> None:
    listing = Listing()
    listing.put("bad.mp4", "e9")
    vid = video_id(BUCKET, "bad.mp4")
    failed = VideoRecord(vid, s3_uri(BUCKET, "bad.mp4"), VideoStatus.FAILED, version="e9", error="not a video")
    store.catalog.write(failed, 0)
    report = checker(store, listing, grace_s=0).run([BUCKET])
    assert report.inconsistencies == 0 and report.failed == 1


def test_repeated_frame_ids_are_found(store: IndexStore) -> None:
    listing = Listing()
    listing.put("a.mp4")
    record = index(store, "a.mp4", n=2)
    table = store.frames.table()
    assert table is not None
    table.add(table.search().where(f"video_id = '{record.video_id}'").limit(1).to_arrow())  # a stray duplicate
    report = checker(store, listing).run([BUCKET])
    assert report.counts[Finding.DUPLICATE_FRAMES] == 1


def test_rounds_resume_where_the_last_one_stopped_and_wrap_around(store: IndexStore) -> None:
    listing = Listing()
    keys = [f"k{i}.mp4" for i in range(5)]
    for key in keys:
        listing.put(key)
        index(store, key)
    check = checker(store, listing)
    first = check.run([BUCKET], max_objects=2)
    assert first.listed == 2 and first.resume_after == (BUCKET, "k1.mp4")
    second = check.run([BUCKET], max_objects=2, resume_after=first.resume_after)
    assert second.listed == 2 and second.resume_after == (BUCKET, "k3.mp4")
    third = check.run([BUCKET], max_objects=2, resume_after=second.resume_after)
    assert third.listed == 1 and third.resume_after is None  # the next round starts over
    assert first.in_sync + second.in_sync + third.in_sync == 5


def test_the_report_as_json_has_counts_by_kind_and_in_flight(store: IndexStore) -> None:
    listing = Listing()
    listing.put("a.mp4")
    data = checker(store, listing, grace_s=0).run([BUCKET]).as_json()
    assert data["inconsistencies"] == 1 and data["counts"]["missing"] == 1 and data["in_flight"] == 0
    assert data["found"][0]["uri"] == "s3://videos/a.mp4" and isinstance(data["took_s"], float)
    assert timedelta(seconds=data["took_s"]) < timedelta(seconds=60)


def test_unicode_keys_order_like_s3(store: IndexStore) -> None:
    # S3 lists in UTF-8 byte order: "z" < "é" < "日"; catalog and frames ranges follow the same order.
    listing = Listing()
    for key in ["z.mp4", "é.mp4", "日本.mp4", "a b+c%20.mp4"]:
        listing.put(key)
        index(store, key)
    report = checker(store, listing).run([BUCKET])
    assert report.in_sync == 4 and report.inconsistencies == 0


def test_a_sink_is_needed_to_repair(store: IndexStore) -> None:
    with pytest.raises(ValueError, match="sink"):
        checker(store, Listing()).run([BUCKET], repair=True)


class LazyBucket:
    """n objects generated on demand, one listing page at a time; the even ones are cataloged (and
    have rows), the odd ones missing. Catalog and frames answer key ranges by bisection."""

    def __init__(self, n: int, page_size: int = 1000) -> None:
        self.n = n
        self.page_size = page_size

    @staticmethod
    def key(i: int) -> str:
        return f"k{i:07d}.mp4"

    def pages(self, bucket: str, prefix: str, start_after: str | None) -> Iterator[list[ObjectHead]]:
        for start in range(0, self.n, self.page_size):
            yield [
                ObjectHead(BUCKET, self.key(i), 10, "e1", None, None, OLD)
                for i in range(start, min(self.n, start + self.page_size))
            ]

    def _range(self, uri_from: str, uri_to: str, include_from: bool) -> range:
        def index_of(uri: str) -> int:
            key = uri.removeprefix(f"s3://{BUCKET}/")
            if not key.startswith("k"):
                return 0 if key < "k" else self.n
            digits = key[1:8]
            return int(digits) if digits.isdigit() else self.n

        lo = index_of(uri_from) + (0 if include_from else 1)
        hi = min(self.n, index_of(uri_to) + 1)
        return range(max(0, lo), hi)

    def scan(self, uri_from: str, uri_to: str, *, include_from: bool) -> Iterator[VideoRecord]:
        fp = fingerprint("e1", MODEL, Sampling(1.0))
        for i in self._range(uri_from, uri_to, include_from):
            if i % 2 == 0:
                key = self.key(i)
                yield VideoRecord(
                    video_id(BUCKET, key),
                    s3_uri(BUCKET, key),
                    VideoStatus.INDEXED,
                    version="e1",
                    frames=1,
                    fingerprint=fp,
                )

    def summaries_in(self, uri_from: str, uri_to: str, *, include_from: bool) -> dict[str, FrameSummary]:
        fp = fingerprint("e1", MODEL, Sampling(1.0))
        found = {}
        for i in self._range(uri_from, uri_to, include_from):
            if i % 2 == 0:
                key = self.key(i)
                found[video_id(BUCKET, key)] = FrameSummary(
                    rows=1, fingerprints=Counter({fp: 1}), uri=s3_uri(BUCKET, key)
                )
        return found


def _peak_bytes(n: int) -> int:
    bucket = LazyBucket(n)
    check = Checker(
        model_id=MODEL,
        sampling=Sampling(1.0),
        extensions=[".mp4"],
        catalog=bucket,
        frames=bucket,
        lister=bucket,
        sink=None,
        in_flight_grace_s=60,
        new_object_grace_s=60,
    )
    tracemalloc.start()
    try:
        report = check.run([BUCKET])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.listed == n and report.in_sync == n // 2 and report.counts[Finding.MISSING] == n // 2
    assert len(report.found) == MAX_REPORTED
    return peak


def test_memory_stays_bounded_at_100k_objects() -> None:
    small, large = _peak_bytes(10_000), _peak_bytes(100_000)
    # Ten times the objects, about the same peak: one page and its key range at a time.
    assert large < 1.5 * small, (small, large)


def test_rows_stuck_in_flight_are_found_without_walking_the_buckets(store: IndexStore) -> None:
    sink = Sink()
    stuck = VideoRecord(video_id(BUCKET, "deep/x.mp4"), s3_uri(BUCKET, "deep/x.mp4"), VideoStatus.INDEXING)
    store.catalog.write(stuck, 0)
    assert checker(store, Listing(), sink).stuck(repair=True).inconsistencies == 0  # within the grace
    report = checker(store, Listing(), sink, grace_s=0).stuck(repair=True)
    assert report.counts[Finding.STUCK] == 1 and [j.key for j in sink.jobs] == ["deep/x.mp4"]
