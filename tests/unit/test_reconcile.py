"""Reconcile against in-memory stand-ins of the bucket listing and the catalog."""

from __future__ import annotations

import bisect
import tracemalloc
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from events.config import VideoFilterSettings
from events.jobs import IndexJob, JobOp, JobSource
from pipeline.reconcile import MAX_REPORTED_CHANGES, Drift, Reconciler
from storage.catalog import VideoRecord, VideoStatus
from storage.ids import fingerprint, s3_uri, video_id
from storage.s3 import ObjectHead

MODEL = "tiny"
BUCKET = "videos"


def head(key: str, version: str = "e1") -> ObjectHead:
    return ObjectHead(BUCKET, key, 10, version, None, None, None)


def indexed(key: str, version: str = "e1", model: str = MODEL) -> VideoRecord:
    return VideoRecord(
        video_id=video_id(BUCKET, key),
        uri=s3_uri(BUCKET, key),
        status=VideoStatus.INDEXED,
        version=version,
        frames=3,
        fingerprint=fingerprint(version, model, 1.0),
    )


class Listing:
    def __init__(self, objects: list[ObjectHead], page_size: int = 2) -> None:
        self.objects = sorted(objects, key=lambda o: o.key.encode())
        self.page_size = page_size

    def pages(self, bucket: str, prefix: str) -> Iterator[list[ObjectHead]]:
        chosen = [o for o in self.objects if o.bucket == bucket and o.key.startswith(prefix)]
        for i in range(0, len(chosen), self.page_size):
            yield chosen[i : i + self.page_size]


class Catalog:
    def __init__(self, records: list[VideoRecord]) -> None:
        self.records = sorted(records, key=lambda r: r.uri.encode())
        self.scans = 0

    def scan_videos(self, uri_from: str, uri_to: str, *, include_from: bool) -> Iterator[VideoRecord]:
        self.scans += 1
        for r in self.records:
            low = r.uri.encode() >= uri_from.encode() if include_from else r.uri.encode() > uri_from.encode()
            if low and r.uri.encode() <= uri_to.encode():
                yield r


class Sink:
    def __init__(self) -> None:
        self.jobs: list[IndexJob] = []

    def submit(self, job: IndexJob) -> str:
        self.jobs.append(job)
        return str(len(self.jobs))


def reconciler(catalog: object, listing: object, sink: Sink | None, **kw: object) -> Reconciler:
    return Reconciler(
        model_id=MODEL,
        every_s=1.0,
        videos=VideoFilterSettings(),
        catalog=catalog,  # type: ignore[arg-type]
        lister=listing,  # type: ignore[arg-type]
        sink=sink,
        **kw,  # type: ignore[arg-type]
    )


def test_drift_both_ways_is_found_and_repaired() -> None:
    old = datetime.now(UTC) - timedelta(hours=2)
    objects = [
        head("a.mp4"),  # in sync
        head("b.mp4"),  # missing
        head("c.mp4", "e2"),  # stale version
        head("d.mp4"),  # indexed by another model
        head("e.mp4"),  # failed at this version: left alone
        head("f.mp4"),  # queued a moment ago: in flight
        head("g.mp4"),  # stuck in indexing for hours
        head("notes.txt"),  # not a video
        head("h.mp4"),  # deleted before, uploaded again
    ]
    stuck = VideoRecord(video_id(BUCKET, "g.mp4"), s3_uri(BUCKET, "g.mp4"), VideoStatus.INDEXING, version="e1")
    stuck.updated_at = old
    records = [
        indexed("a.mp4"),
        indexed("c.mp4", "e1"),
        indexed("d.mp4", model="other"),
        VideoRecord(video_id(BUCKET, "e.mp4"), s3_uri(BUCKET, "e.mp4"), VideoStatus.FAILED, version="e1"),
        VideoRecord(video_id(BUCKET, "f.mp4"), s3_uri(BUCKET, "f.mp4"), VideoStatus.QUEUED),
        stuck,
        VideoRecord(video_id(BUCKET, "h.mp4"), s3_uri(BUCKET, "h.mp4"), VideoStatus.DELETED),
        indexed("0-before-first.mp4"),  # orphan before the first page
        indexed("bb-between.mp4"),  # orphan between pages
        indexed("zz-after-last.mp4"),  # orphan after the last page
        VideoRecord(video_id(BUCKET, "y.mp4"), s3_uri(BUCKET, "y.mp4"), VideoStatus.DELETED),  # already gone
        indexed("other-bucket.mp4").__class__(
            video_id("else", "x.mp4"), s3_uri("else", "x.mp4"), VideoStatus.INDEXED, version="e1"
        ),
    ]
    sink = Sink()
    report = reconciler(Catalog(records), Listing(objects), sink).run(BUCKET)
    assert (report.listed, report.pages, report.in_sync, report.failed, report.in_flight, report.ignored) == (
        9,
        5,
        1,
        1,
        1,
        1,
    )
    assert report.counts == {Drift.MISSING: 1, Drift.STALE: 4, Drift.ORPHANED: 3}
    submitted = {(j.op, j.key) for j in sink.jobs}
    assert submitted == {
        (JobOp.INDEX, "b.mp4"),
        (JobOp.INDEX, "c.mp4"),
        (JobOp.INDEX, "d.mp4"),
        (JobOp.INDEX, "g.mp4"),
        (JobOp.INDEX, "h.mp4"),
        (JobOp.DELETE, "0-before-first.mp4"),
        (JobOp.DELETE, "bb-between.mp4"),
        (JobOp.DELETE, "zz-after-last.mp4"),
    }
    assert all(j.source is JobSource.RECONCILE for j in sink.jobs)
    assert next(j for j in sink.jobs if j.key == "c.mp4").hint_version == "e2"
    assert report.submitted == 8
    assert "missing 1, stale 4, orphaned 3" in report.summary()


def test_dry_run_reports_without_submitting() -> None:
    report = reconciler(Catalog([indexed("gone.mp4")]), Listing([head("new.mp4")]), None).run(BUCKET, dry_run=True)
    assert report.counts == {Drift.MISSING: 1, Drift.STALE: 0, Drift.ORPHANED: 1}
    assert report.submitted == 0 and "would submit 2 jobs" in report.summary()
    assert {c.uri for c in report.changes} == {s3_uri(BUCKET, "new.mp4"), s3_uri(BUCKET, "gone.mp4")}


def test_a_prefix_limits_both_sides() -> None:
    sink = Sink()
    catalog = Catalog([indexed("cams/1/gone.mp4"), indexed("cams/2/gone.mp4"), indexed("cams/10.mp4")])
    listing = Listing([head("cams/1/new.mp4"), head("cams/2/new.mp4")])
    reconciler(catalog, listing, sink).run(BUCKET, prefix="cams/1/")
    assert {(j.op, j.key) for j in sink.jobs} == {(JobOp.INDEX, "cams/1/new.mp4"), (JobOp.DELETE, "cams/1/gone.mp4")}


def test_an_empty_bucket_orphans_everything_in_it() -> None:
    sink = Sink()
    reconciler(Catalog([indexed("a.mp4"), indexed("b.mp4")]), Listing([]), sink).run(BUCKET)
    assert sorted(j.key for j in sink.jobs) == ["a.mp4", "b.mp4"]


def test_unicode_keys_order_like_s3() -> None:
    # S3 lists in UTF-8 byte order: "z" < "é" < "日"; the catalog ranges follow the same order.
    keys = ["z.mp4", "é.mp4", "日本.mp4", "a b+c%20.mp4"]
    report = reconciler(Catalog([indexed(k) for k in keys]), Listing([head(k) for k in keys], 1), Sink()).run(BUCKET)
    assert report.in_sync == 4 and sum(report.counts.values()) == 0


def test_a_sink_is_needed_unless_dry_run() -> None:
    with pytest.raises(ValueError):
        reconciler(Catalog([]), Listing([]), None).run(BUCKET)


class LazyBucket:
    """n objects generated on demand; the even ones are indexed, the odd ones missing."""

    def __init__(self, n: int, page_size: int = 1000) -> None:
        self.keys = [f"k{i:07d}.mp4" for i in range(0)]  # nothing materialised
        self.n = n
        self.page_size = page_size

    @staticmethod
    def key(i: int) -> str:
        return f"k{i:07d}.mp4"

    def pages(self, bucket: str, prefix: str) -> Iterator[list[ObjectHead]]:
        for start in range(0, self.n, self.page_size):
            yield [head(self.key(i)) for i in range(start, min(self.n, start + self.page_size))]

    def scan_videos(self, uri_from: str, uri_to: str, *, include_from: bool) -> Iterator[VideoRecord]:
        class Keys:
            def __getitem__(_, i: int) -> bytes:
                return s3_uri(BUCKET, LazyBucket.key(i)).encode()

            def __len__(_) -> int:
                return self.n

        keys = Keys()
        lo = (bisect.bisect_left if include_from else bisect.bisect_right)(keys, uri_from.encode())  # type: ignore[call-overload]
        hi = bisect.bisect_right(keys, uri_to.encode())  # type: ignore[call-overload]
        for i in range(lo, hi):
            if i % 2 == 0:
                yield indexed(self.key(i))


def _peak_bytes(n: int) -> tuple[int, int]:
    bucket = LazyBucket(n)
    tracemalloc.start()
    try:
        report = reconciler(bucket, bucket, None).run(BUCKET, dry_run=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.listed == n and report.in_sync == n // 2 and report.counts[Drift.MISSING] == n // 2
    assert len(report.changes) == MAX_REPORTED_CHANGES
    return peak, report.pages


def test_memory_stays_bounded_at_100k_objects() -> None:
    small, _ = _peak_bytes(10_000)
    large, pages = _peak_bytes(100_000)
    assert pages == 100
    # Ten times the objects, about the same peak: one page and its catalog range at a time.
    assert large < 1.5 * small, (small, large)
