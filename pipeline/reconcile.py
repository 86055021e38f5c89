"""Reconcile: list a bucket page by page, compare with the catalog, and submit the jobs that repair
any drift — objects never indexed (a missed create), indexed at an old version or with another model
or sampling (stale), and catalog entries whose object is gone (a missed delete).

Memory stays bounded: one listing page and the catalog rows in that page's key range are held at a
time (S3 lists keys in UTF-8 byte order; the catalog is scanned in the same order by ``uri`` range).
Jobs are hints like any other: the consumer HEADs the object, so a reconcile racing with live events
converges all the same.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import posixpath
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Protocol

from events.config import VideoFilterSettings
from events.jobs import IndexJob, JobOp, JobSink, JobSource
from storage.catalog import VideoRecord, VideoStatus
from storage.config import S3Settings
from storage.ids import fingerprint, s3_uri, video_id
from storage.s3 import ObjectHead, ObjectStore
from storage.tables import IndexStore

if TYPE_CHECKING:
    from pipeline.settings import Settings

log = logging.getLogger(__name__)

#: Changes kept in a report for display; the counts cover all of them.
MAX_REPORTED_CHANGES = 1000


class Drift(enum.StrEnum):
    MISSING = "missing"  # in the bucket, not in the index
    STALE = "stale"  # indexed at another version, model or sampling, or stuck
    ORPHANED = "orphaned"  # in the index, gone from the bucket


@dataclass(frozen=True, slots=True)
class Change:
    drift: Drift
    uri: str
    detail: str


@dataclass(slots=True)
class ReconcileReport:
    bucket: str
    dry_run: bool
    listed: int = 0
    pages: int = 0
    in_sync: int = 0
    #: Failed at the object's current version: left alone (it is in the dead-letter queue).
    failed: int = 0
    #: Queued or indexing recently: a job is on its way.
    in_flight: int = 0
    #: Objects that aren't videos by name and were never cataloged.
    ignored: int = 0
    counts: dict[Drift, int] = field(default_factory=lambda: dict.fromkeys(Drift, 0))
    changes: list[Change] = field(default_factory=list)

    @property
    def submitted(self) -> int:
        return 0 if self.dry_run else sum(self.counts.values())

    def add(self, change: Change) -> None:
        self.counts[change.drift] += 1
        if len(self.changes) < MAX_REPORTED_CHANGES:
            self.changes.append(change)

    def summary(self) -> str:
        verb = "would submit" if self.dry_run else "submitted"
        return (
            f"s3://{self.bucket}: {self.listed} objects in {self.pages} pages; in sync {self.in_sync}, "
            f"missing {self.counts[Drift.MISSING]}, stale {self.counts[Drift.STALE]}, "
            f"orphaned {self.counts[Drift.ORPHANED]}, failed {self.failed}, in flight {self.in_flight}, "
            f"ignored {self.ignored}; {verb} {sum(self.counts.values())} jobs"
        )


class PageLister(Protocol):
    def pages(self, bucket: str, prefix: str) -> Iterator[list[ObjectHead]]: ...


class Catalog(Protocol):
    def scan(self, uri_from: str, uri_to: str, *, include_from: bool) -> Iterator[VideoRecord]: ...


class S3PageLister:
    """``PageLister`` over aiobotocore, driven from synchronous code on one private event loop."""

    def __init__(self, s3: S3Settings) -> None:
        self._s3 = s3

    def pages(self, bucket: str, prefix: str) -> Iterator[list[ObjectHead]]:
        with asyncio.Runner() as runner:
            store = ObjectStore(self._s3)
            runner.run(store.__aenter__())
            try:
                listing = store.list_current(bucket, prefix)
                while True:
                    page = runner.run(_next_page(listing))
                    if page is None:
                        return
                    yield page
            finally:
                runner.run(store.__aexit__(None, None, None))


async def _next_page(listing: AsyncIterator[list[ObjectHead]]) -> list[ObjectHead] | None:
    try:
        return await anext(listing)
    except StopAsyncIteration:
        return None


def _prefix_end(bucket: str, prefix: str) -> str:
    """The smallest URI greater than every ``s3://bucket/prefix…``: the prefix with its last
    character incremented."""
    start = s3_uri(bucket, prefix)
    return start[:-1] + chr(ord(start[-1]) + 1)


class Reconciler:
    """Compares one bucket with the catalog and submits the repairing jobs."""

    def __init__(
        self,
        *,
        model_id: str,
        every_s: float,
        videos: VideoFilterSettings,
        catalog: Catalog,
        lister: PageLister,
        sink: JobSink | None,
        in_flight_grace_s: float = 600.0,
    ) -> None:
        self._model_id = model_id
        self._every_s = every_s
        self._extensions = {e.lower() for e in videos.extensions}
        self._catalog = catalog
        self._lister = lister
        self._sink = sink
        self._grace = timedelta(seconds=in_flight_grace_s)

    def run(self, bucket: str, *, prefix: str = "", dry_run: bool = False) -> ReconcileReport:
        """Reconcile ``s3://bucket/prefix…``.

        Raises:
            TransientError: the object store, the catalog or the task queue is unavailable; jobs
                already submitted stay submitted and a rerun picks up the rest.
        """
        if self._sink is None and not dry_run:
            raise ValueError("a job sink is needed unless dry_run")
        report = ReconcileReport(bucket=bucket, dry_run=dry_run)
        now = datetime.now(UTC)
        lower, include_lower = s3_uri(bucket, prefix), True
        for page in self._lister.pages(bucket, prefix):
            if not page:
                continue
            report.pages += 1
            report.listed += len(page)
            upper = s3_uri(bucket, page[-1].key)
            known = {r.video_id: r for r in self._catalog.scan(lower, upper, include_from=include_lower)}
            for obj in page:
                self._compare(report, obj, known.pop(video_id(bucket, obj.key), None), now)
            self._orphans(report, known.values())
            lower, include_lower = upper, False
        tail = self._catalog.scan(lower, _prefix_end(bucket, prefix), include_from=include_lower)
        # The end bound is exclusive in effect: no URI under the prefix equals it.
        self._orphans(report, (r for r in tail if r.uri.startswith(s3_uri(bucket, prefix))))
        log.info("reconcile %s", report.summary())
        return report

    def _compare(self, report: ReconcileReport, obj: ObjectHead, record: VideoRecord | None, now: datetime) -> None:
        uri = s3_uri(obj.bucket, obj.key)
        if record is None:
            if posixpath.splitext(obj.key)[1].lower() not in self._extensions:
                report.ignored += 1
                return
            self._index(report, Change(Drift.MISSING, uri, "not in the index"), obj)
            return
        expected = fingerprint(obj.version, self._model_id, self._every_s)
        if record.status is VideoStatus.INDEXED and record.fingerprint == expected:
            report.in_sync += 1
        elif record.status is VideoStatus.FAILED and record.version == obj.version:
            report.failed += 1
        elif record.status in (VideoStatus.QUEUED, VideoStatus.INDEXING) and now - record.updated_at < self._grace:
            report.in_flight += 1
        else:
            detail = f"{record.status.value} at version {record.version or '-'}, object at {obj.version}"
            self._index(report, Change(Drift.STALE, uri, detail), obj)

    def _orphans(self, report: ReconcileReport, records: Iterable[VideoRecord]) -> None:
        for record in records:
            if record.status is VideoStatus.DELETED and record.frames == 0:
                continue
            bucket, _, key = record.uri.removeprefix("s3://").partition("/")
            change = Change(Drift.ORPHANED, record.uri, f"{record.status.value}, object gone")
            self._submit(report, change, IndexJob(op=JobOp.DELETE, bucket=bucket, key=key, source=JobSource.RECONCILE))

    def _index(self, report: ReconcileReport, change: Change, obj: ObjectHead) -> None:
        job = IndexJob(
            op=JobOp.INDEX, bucket=obj.bucket, key=obj.key, source=JobSource.RECONCILE, hint_version=obj.version
        )
        self._submit(report, change, job)

    def _submit(self, report: ReconcileReport, change: Change, job: IndexJob) -> None:
        report.add(change)
        if report.dry_run or self._sink is None:
            return
        self._sink.submit(job)


def build_reconciler(settings: Settings, store: IndexStore, sink: JobSink | None) -> Reconciler:
    """The reconciler the CLI and the admin API use: this deployment's model, sampling and buckets;
    jobs it submits are marked queued in the catalog."""
    return Reconciler(
        model_id=settings.model.id,
        every_s=settings.sampling.every_s,
        videos=settings.videos,
        catalog=store.catalog,
        lister=S3PageLister(settings.s3),
        sink=sink,
    )
