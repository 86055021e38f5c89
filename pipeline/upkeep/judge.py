"""The checker's judgement of one video (``pipeline.upkeep.check`` walks the buckets and the tables):
its object, catalog row and frame rows held against each other, without reading anything."""

from __future__ import annotations

from datetime import datetime, timedelta

from pipeline.upkeep.report import Finding
from storage.catalog import IN_FLIGHT, VideoRecord, VideoStatus
from storage.frames import FrameSummary
from storage.ids import fingerprint
from storage.models import ModelTable
from storage.s3 import ObjectHead
from storage.sampling import Sampling

#: A finding (with the model whose rows it is about), or ``in_sync`` / ``failed`` / ``in_flight``, or None.
Verdict = tuple[Finding, str, str | None] | str | None


class Judge:
    """Judges videos for one deployment's sampling and graces. ``per_model``: each live table is held
    against the row's entry for it; else the one ``frames`` table against the row's own count."""

    def __init__(self, sampling: Sampling, stuck_after: timedelta, new_after: timedelta, per_model: bool) -> None:
        self._sampling = sampling
        self._stuck_after = stuck_after
        self._new_after = new_after
        self._per_model = per_model

    def __call__(
        self,
        obj: ObjectHead | None,
        record: VideoRecord | None,
        rows: dict[str, FrameSummary],
        tables: list[ModelTable],
        now: datetime,
    ) -> Verdict:
        """The finding for one video (with the model whose rows it is about), or ``in_sync`` /
        ``failed`` / ``in_flight``."""
        in_flight = record is not None and record.status in IN_FLIGHT
        if in_flight and record is not None and now - record.updated_at < self._stuck_after:
            return "in_flight"
        fresh = obj is not None and obj.last_modified is not None and now - obj.last_modified < self._new_after
        for t in tables:
            held = rows.get(t.table, FrameSummary())
            if held.duplicate_ids:
                detail = f"{held.duplicate_ids} repeated frame ids in {held.rows} rows"
                return Finding.DUPLICATE_FRAMES, self._of(t, detail), self._label(t)
        if record is None:
            for t in tables:
                if (held := rows.get(t.table, FrameSummary())).rows:
                    return Finding.ORPHAN_ROWS, self._of(t, f"{held.rows} rows, no catalog row"), self._label(t)
            return "in_flight" if fresh else (Finding.MISSING, "in the bucket, not in the catalog", None)
        for t in tables:
            held = rows.get(t.table, FrameSummary())
            count, fp = self._expected(record, t)
            if held.rows != count or not set(held.fingerprints) <= ({fp} if fp else set()):
                has = ", ".join(f"{n} of {f}" for f, n in held.fingerprints.items()) or "none"
                detail = f"{record.status.value}: catalog says {count} rows of {fp or '-'}, frames holds {has}"
                return Finding.ROWS_MISMATCH, self._of(t, detail), self._label(t)
        if in_flight:
            return Finding.STUCK, f"{record.status.value} since {record.updated_at.isoformat()}", None
        if obj is None:
            if record.status is VideoStatus.DELETED:
                return None
            return Finding.ORPHANED, f"{record.status.value}, object gone", None
        active = tables[0]
        current = fingerprint(obj.version, active.model, self._sampling)
        _, active_fp = self._expected(record, active)
        if record.status is VideoStatus.INDEXED and active_fp == current:
            return "in_sync"
        if record.status is VideoStatus.FAILED and record.version == obj.version:
            return "failed"
        if fresh:
            return "in_flight"
        detail = f"{record.status.value} at version {record.version or '-'}, object at {obj.version}"
        return Finding.STALE, detail, None

    def _expected(self, record: VideoRecord, table: ModelTable) -> tuple[int, str | None]:
        """The rows the catalog says ``table`` holds of the video: how many, of which fingerprint."""
        if not self._per_model:
            return record.frames, record.fingerprint
        entry = record.index_in(table.table)
        return (entry.frames, entry.fingerprint) if entry is not None else (0, None)

    def _label(self, table: ModelTable) -> str | None:
        return None if not self._per_model else table.model

    def _of(self, table: ModelTable, detail: str) -> str:
        return detail if not self._per_model else f"{table.model} ({table.table}): {detail}"
