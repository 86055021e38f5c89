"""What the invariant checker (``pipeline.upkeep.check``) reports: each finding by kind, and a round's counts."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

#: Findings kept in a report for display; the counts cover all of them.
MAX_REPORTED = 1000


class Finding(enum.StrEnum):
    MISSING = "missing"  # in the bucket, never cataloged
    STALE = "stale"  # cataloged at another version, model or sampling than the object (or deleted while it exists)
    ORPHANED = "orphaned"  # cataloged as present, the object is gone
    STUCK = "stuck"  # queued or indexing past the grace: no job is alive for it
    ROWS_MISMATCH = "rows_mismatch"  # frames doesn't hold exactly the rows the catalog says
    ORPHAN_ROWS = "orphan_rows"  # frames rows of a video with no catalog row
    DUPLICATE_FRAMES = "duplicate_frames"  # one frame_id twice


@dataclass(frozen=True, slots=True)
class Inconsistency:
    finding: Finding
    uri: str
    video_id: str
    detail: str


@dataclass(slots=True)
class CheckReport:
    repair: bool
    buckets: list[str] = field(default_factory=list)
    listed: int = 0
    videos: int = 0
    in_sync: int = 0
    #: Failed at the object's current version: left alone (it is in the dead-letter queue).
    failed: int = 0
    #: Queued or indexing within the grace, or changed in the bucket within the grace.
    in_flight: int = 0
    #: Objects that aren't videos by name and were never cataloged.
    ignored: int = 0
    counts: dict[Finding, int] = field(default_factory=lambda: dict.fromkeys(Finding, 0))
    found: list[Inconsistency] = field(default_factory=list)
    #: Each live model whose frames table was checked, and the findings about its rows.
    models: dict[str, int] = field(default_factory=dict)
    submitted: int = 0
    #: Where an incremental round stopped: (bucket, last key) to resume after; None when it went through.
    resume_after: tuple[str, str] | None = None
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    took_s: float = 0.0
    #: Parts of a round that kept going past a failure (a bucket, the stuck-row step), and why.
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def inconsistencies(self) -> int:
        return sum(self.counts.values())

    def add(self, item: Inconsistency, model: str | None = None) -> None:
        self.counts[item.finding] += 1
        if model is not None:
            self.models[model] = self.models.get(model, 0) + 1
        if len(self.found) < MAX_REPORTED:
            self.found.append(item)

    def summary(self) -> str:
        kinds = ", ".join(f"{k.value} {n}" for k, n in self.counts.items() if n) or "none"
        verb = f"; submitted {self.submitted} repairing jobs" if self.repair else ""
        models = "; findings per model: " + ", ".join(f"{m} {n}" for m, n in self.models.items()) if self.models else ""
        errors = "; not checked: " + "; ".join(f"{k}: {v}" for k, v in self.errors.items()) if self.errors else ""
        return (
            f"checked {self.videos} videos, {self.listed} objects in {', '.join(self.buckets) or 'no buckets'}: "
            f"{self.inconsistencies} inconsistencies ({kinds}); in sync {self.in_sync}, failed {self.failed}, "
            f"in flight {self.in_flight}, ignored {self.ignored}{models}{verb}{errors}"
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "inconsistencies": self.inconsistencies,
            "counts": {k.value: n for k, n in self.counts.items()},
            "models": dict(self.models),
            "in_flight": self.in_flight,
            "in_sync": self.in_sync,
            "failed": self.failed,
            "ignored": self.ignored,
            "listed": self.listed,
            "videos": self.videos,
            "buckets": self.buckets,
            "repair": self.repair,
            "submitted": self.submitted,
            "resume_after": list(self.resume_after) if self.resume_after else None,
            "started_at": self.started_at.isoformat(),
            "took_s": round(self.took_s, 3),
            "errors": dict(self.errors),
            "found": [
                {"finding": i.finding.value, "uri": i.uri, "video_id": i.video_id, "detail": i.detail}
                for i in self.found
            ],
        }
