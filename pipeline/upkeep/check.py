"""The invariant checker: bucket, catalog and frames held against each other (``vidx check``, the
admin API, and a scheduled, leased, incremental round inside the app).

For every video: what ``frames`` holds is exactly what its catalog row says (``frames`` rows, all of
``fingerprint``, no repeated ``frame_id``); ``indexed`` means the object exists at the fingerprint's
version, model and sampling; ``deleted`` (or no row) means no rows and no object; nothing stays
``queued``/``indexing`` past a grace. Each breach is a ``Finding``; repairing submits the job that
converges it (the consumer HEADs the object, so a repair racing live events is harmless).

Memory stays bounded per page: one listing page, the catalog rows in its key range and those
videos' frame summaries (S3 lists keys in UTF-8 byte order; the catalog is scanned in the same order).
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from events.jobs import IndexJob, JobOp, JobSink, JobSource
from pipeline.upkeep.judge import Judge
from pipeline.upkeep.report import MAX_REPORTED, CheckReport, Finding, Inconsistency
from pipeline.upkeep.sources import CatalogReader, FrameReader, PageLister, S3PageLister
from storage.catalog import IN_FLIGHT, VideoRecord
from storage.errors import PermanentError, TransientError
from storage.frames import FRAMES, FrameSummary
from storage.ids import s3_uri, video_id
from storage.models import ModelTable
from storage.s3 import ObjectHead
from storage.sampling import Sampling

if TYPE_CHECKING:
    from pipeline.settings import Settings
    from storage.tables import IndexStore

log = logging.getLogger(__name__)

__all__ = ["MAX_REPORTED", "CheckReport", "Checker", "Finding", "Inconsistency", "S3PageLister", "build_checker"]


def _never(_record: VideoRecord) -> bool:
    return False


def _nothing(_record: VideoRecord) -> None:
    return None


def _prefix_end(bucket: str, prefix: str) -> str:
    """The smallest URI greater than every ``s3://bucket/prefix…``: the prefix with its last
    character incremented."""
    start = s3_uri(bucket, prefix)
    return start[:-1] + chr(ord(start[-1]) + 1)


def _split_uri(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


class Checker:
    """Holds buckets, catalog and frames against each other; optionally submits the repairs."""

    def __init__(
        self,
        *,
        model_id: str,
        sampling: Sampling,
        extensions: Iterable[str],
        catalog: CatalogReader,
        frames: FrameReader,
        lister: PageLister,
        sink: JobSink | None,
        in_flight_grace_s: float,
        new_object_grace_s: float,
        models: Callable[[], list[ModelTable]] | None = None,
        frames_for: Callable[[str], FrameReader] | None = None,
    ) -> None:
        """``models`` gives the live frames tables (active first, ``LiveModels.live``) and
        ``frames_for`` each one's reader: each video's rows in each are held against its catalog
        entry for that table. Without them, the one ``frames`` table against the row's own
        ``frames``/``fingerprint`` (``model_id``'s index)."""
        self._models = models
        self._frames_for = frames_for
        self._model_id = model_id
        self._extensions = {e.lower() for e in extensions}
        self._catalog = catalog
        self._frames = frames
        self._lister = lister
        self._sink = sink
        self._stuck_after = timedelta(seconds=in_flight_grace_s)
        #: For the duration of one ``run``: rows in flight already resubmitted, and who to tell of a resubmit.
        self._skip: Callable[[VideoRecord], bool] = _never
        self._resubmitted: Callable[[VideoRecord], None] = _nothing
        self._judge = Judge(sampling, self._stuck_after, timedelta(seconds=new_object_grace_s), models is not None)

    def run(
        self,
        buckets: Iterable[str],
        *,
        prefix: str = "",
        repair: bool = False,
        max_objects: int | None = None,
        resume_after: tuple[str, str] | None = None,
        keep_going: bool = False,
        skip: Callable[[VideoRecord], bool] = _never,
        resubmitted: Callable[[VideoRecord], None] = _nothing,
    ) -> CheckReport:
        """Check ``s3://bucket/prefix…`` of each bucket; with ``max_objects``, stop after about that
        many objects and say where to resume (``report.resume_after``). With ``keep_going`` a bucket
        that fails (deleted, refusing listing, a table read failing within it) is recorded in
        ``report.errors`` and the walk goes on with the next one. ``skip`` and ``resubmitted`` as in
        ``stuck``, for rows in flight.

        Raises:
            TransientError: the object store, a table or the task queue is unavailable; repairs
                already submitted stay submitted and a rerun picks up the rest.
        """
        if repair and self._sink is None:
            raise ValueError("a job sink is needed to repair")
        self._skip, self._resubmitted = skip, resubmitted
        try:
            return self._run(list(buckets), prefix, repair, max_objects, resume_after, keep_going)
        finally:
            self._skip, self._resubmitted = _never, _nothing

    def stuck(
        self,
        *,
        repair: bool,
        skip: Callable[[VideoRecord], bool] = _never,
        resubmitted: Callable[[VideoRecord], None] = _nothing,
        limit: int = 10_000,
    ) -> CheckReport:
        """Rows queued/indexing past the grace, found by one catalog query rather than by walking the
        buckets (the scheduled check runs this every round, so no row waits for the walk to reach it).
        A row ``skip`` says was resubmitted already is counted in flight, not found again; at most
        ``limit`` rows are resubmitted (the rest wait for the next round), each told to ``resubmitted``.

        Raises:
            TransientError: the catalog or the task queue is unavailable.
        """
        report = CheckReport(repair=repair)
        for record in self._catalog.in_flight_since(datetime.now(UTC) - self._stuck_after):
            report.videos += 1
            if skip(record):
                report.in_flight += 1
                continue
            report.add(
                Inconsistency(Finding.STUCK, record.uri, record.video_id, f"{record.status.value} past the grace")
            )
            if repair and self._sink is not None and report.submitted < limit:
                bucket, key = _split_uri(record.uri)
                self._sink.submit(IndexJob(op=JobOp.INDEX, bucket=bucket, key=key, source=JobSource.RECONCILE))
                report.submitted += 1
                resubmitted(record)
        return report

    def _run(
        self,
        buckets: list[str],
        prefix: str,
        repair: bool,
        max_objects: int | None,
        resume_after: tuple[str, str] | None,
        keep_going: bool,
    ) -> CheckReport:
        report = CheckReport(repair=repair)
        if self._models is not None:
            report.models = {t.model: 0 for t in self._models()}
        now = datetime.now(UTC)
        budget = max_objects
        names = list(buckets)
        skipping = resume_after is not None
        for bucket in names:
            if skipping and resume_after is not None:
                if bucket != resume_after[0]:
                    continue
                skipping = False
                start_after: str | None = resume_after[1]
            else:
                start_after = None
            report.buckets.append(bucket)
            try:
                try:
                    stopped = self._bucket(report, bucket, prefix, start_after, now, repair, budget)
                except (RuntimeError, OSError) as exc:  # a table read failed mid-stream (scans are generators)
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                    raise TransientError(f"check: index table read failed: {first}") from exc
            except (TransientError, PermanentError) as exc:
                if not keep_going:
                    raise
                log.warning("check: bucket %s failed, going on with the others: %s", bucket, exc)
                report.errors[bucket] = str(exc)[:300]
                continue
            if stopped is not None:
                report.resume_after = (bucket, stopped)
                break
            if budget is not None:
                budget = max(0, budget - report.listed)
        report.took_s = (datetime.now(UTC) - report.started_at).total_seconds()
        log.info("check %s", report.summary())
        return report

    def _bucket(
        self,
        report: CheckReport,
        bucket: str,
        prefix: str,
        start_after: str | None,
        now: datetime,
        repair: bool,
        budget: int | None,
    ) -> str | None:
        """Check one bucket from ``start_after``; the last key checked when the budget ran out."""
        if start_after is None:
            lower, include_lower = s3_uri(bucket, prefix), True
        else:
            lower, include_lower = s3_uri(bucket, start_after), False
        seen_here = 0
        for page in self._lister.pages(bucket, prefix, start_after):
            if not page:
                continue
            report.listed += len(page)
            seen_here += len(page)
            upper = s3_uri(bucket, page[-1].key)
            self._range(report, bucket, page, lower, upper, include_lower, now, repair)
            lower, include_lower = upper, False
            if budget is not None and seen_here >= budget:
                return page[-1].key
        self._range(report, bucket, [], lower, _prefix_end(bucket, prefix), include_lower, now, repair, tail=prefix)
        return None

    def _range(
        self,
        report: CheckReport,
        bucket: str,
        objects: list[ObjectHead],
        lower: str,
        upper: str,
        include_lower: bool,
        now: datetime,
        repair: bool,
        tail: str | None = None,
    ) -> None:
        """Judge every video of one key range: its objects (one listing page), its catalog rows and
        its frame rows, each read for that range only. ``tail``: the range past the last page, up to
        the prefix's end (exclusive in effect: no URI under the prefix equals it)."""
        rows = {r.video_id: r for r in self._catalog.scan(lower, upper, include_from=include_lower)}
        tables = self._tables()
        frames: dict[str, dict[str, FrameSummary]] = {}
        for t in tables:
            reader = self._frames if self._frames_for is None else self._frames_for(t.table)
            frames[t.table] = reader.summaries_in(lower, upper, include_from=include_lower)
        if tail is not None:
            under = s3_uri(bucket, tail)
            rows = {v: r for v, r in rows.items() if r.uri.startswith(under)}
            frames = {n: {v: f for v, f in held.items() if f.uri.startswith(under)} for n, held in frames.items()}

        def take(vid: str) -> dict[str, FrameSummary]:
            return {n: held.pop(vid) for n, held in frames.items() if vid in held}

        for obj in objects:
            vid = video_id(bucket, obj.key)
            self._one(report, s3_uri(bucket, obj.key), vid, obj, rows.pop(vid, None), take(vid), tables, now, repair)
        for record in rows.values():  # cataloged in this key range, not in the bucket
            self._one(report, record.uri, record.video_id, None, record, take(record.video_id), tables, now, repair)
        for vid in sorted({v for held in frames.values() for v in held}):  # rows, neither object nor catalog row
            held = take(vid)
            self._one(report, next(iter(held.values())).uri, vid, None, None, held, tables, now, repair)

    def _tables(self) -> list[ModelTable]:
        if self._models is None:
            return [ModelTable(self._model_id, 0, FRAMES)]
        return self._models()

    def _one(
        self,
        report: CheckReport,
        uri: str,
        vid: str,
        obj: ObjectHead | None,
        record: VideoRecord | None,
        rows: dict[str, FrameSummary],
        tables: list[ModelTable],
        now: datetime,
        repair: bool,
    ) -> None:
        if record is None and not any(r.rows for r in rows.values()):
            if obj is None:
                return
            if posixpath.splitext(obj.key)[1].lower() not in self._extensions:
                report.ignored += 1
                return
        report.videos += 1
        if record is not None and record.status in IN_FLIGHT and self._skip(record):
            report.in_flight += 1  # resubmitted already; its job may wait in a backlog
            return
        found = self._judge(obj, record, rows, tables, now)
        if found is None:
            return
        if not isinstance(found, tuple):
            if found == "in_flight":
                report.in_flight += 1
            elif found == "failed":
                report.failed += 1
            else:
                report.in_sync += 1
            return
        finding, detail, model = found
        report.add(Inconsistency(finding, uri, vid, detail), model)
        if repair and self._sink is not None:
            bucket, key = _split_uri(uri)
            op = JobOp.INDEX if obj is not None else JobOp.DELETE
            self._sink.submit(
                IndexJob(
                    op=op, bucket=bucket, key=key, source=JobSource.RECONCILE, hint_version=obj.version if obj else None
                )
            )
            report.submitted += 1
            if record is not None and record.status in IN_FLIGHT:
                self._resubmitted(record)


def build_checker(
    settings: Settings,
    store: IndexStore,
    sink: JobSink | None,
    models: Callable[[], list[ModelTable]] | None = None,
) -> Checker:
    """The checker of this index's live models (or of ``models``' tables, active first), this
    deployment's sampling and buckets (CLI, admin API, scheduled round)."""
    from pipeline.reindex.lifecycle import LiveModels

    live = LiveModels(store.models, settings.reindex.live_refresh_s)

    def live_tables() -> list[ModelTable]:
        # An index no app has started on yet has no lifecycle row: its one table is ``frames``. The
        # text table (while a text source is on) is held against the rows' entries like the others.
        state = live.state()
        return (state.tables() if settings.text.on else state.live()) or [ModelTable(settings.model.id, 0, FRAMES)]

    return Checker(
        model_id=settings.model.id,
        sampling=settings.sampling.spec,
        extensions=settings.videos.extensions,
        catalog=store.catalog,
        frames=store.frames,
        lister=S3PageLister(settings.s3),
        sink=sink,
        in_flight_grace_s=settings.check.in_flight_grace_s,
        new_object_grace_s=settings.check.new_object_grace_s,
        models=models or live_tables,
        frames_for=store.table_for,
    )
