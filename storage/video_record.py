"""A row of the ``videos`` table (the catalog) and its states: ``VideoRecord``, ``VideoStatus``, the
table's schema. ``storage.catalog`` is the table itself."""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

from storage.db import PRIMARY_KEY
from storage.models import LEGACY_FRAMES, ModelIndex
from storage.sampling import Sampling, SamplingStrategy


class VideoStatus(enum.StrEnum):
    QUEUED = "queued"
    INDEXING = "indexing"
    INDEXED = "indexed"
    FAILED = "failed"
    DELETED = "deleted"


#: A job for the video may be alive: reconcile and ``vidx check`` give these a grace period.
IN_FLIGHT = frozenset({VideoStatus.QUEUED, VideoStatus.INDEXING})

VIDEOS_SCHEMA = pa.schema(
    [
        pa.field("video_id", pa.string(), nullable=False, metadata=PRIMARY_KEY),
        pa.field("uri", pa.string(), nullable=False),
        #: The object version the status speaks of (indexed, failed or being indexed).
        pa.field("version", pa.string(), nullable=True),
        pa.field("status", pa.string(), nullable=False),
        pa.field("error", pa.string(), nullable=True),
        #: What ``frames`` holds for this video: the row count and the (version, model, sampling)
        #: fingerprint every one of those rows carries; 0 and null when it holds none.
        pa.field("frames", pa.int64(), nullable=False),
        pa.field("fingerprint", pa.string(), nullable=True),
        pa.field("duration_s", pa.float64(), nullable=True),
        pa.field("model", pa.string(), nullable=True),
        pa.field("sampling", pa.string(), nullable=True),
        #: Bumped by every write; a write lands only on the revision it read.
        pa.field("rev", pa.int64(), nullable=False),
        #: The task that last claimed the video, the consumer process that ran it, and how many
        #: times that task's consumer died while holding it (the started-marker: see pipeline/index/consumer.py).
        pa.field("task_id", pa.string(), nullable=True),
        pa.field("holder", pa.string(), nullable=True),
        pa.field("crashes", pa.int64(), nullable=False),
        pa.field("updated_at", pa.timestamp("us", tz="UTC"), nullable=False),
        #: Per frames table (one per model, ``storage.models``): the model, the fingerprint its rows
        #: carry, how many and the sampling interval (JSON list of ``ModelIndex``; null in rows
        #: written before per-model tables, which speak of the table ``frames``).
        pa.field("indexes", pa.string(), nullable=True),
        #: Chosen by the writer of this revision (``pipeline.jobs.videostate``): a caller that lost
        #: the reply to its write reads the row back to tell "landed" from "not landed".
        pa.field("write_id", pa.string(), nullable=True),
        #: Which attempt of ``task_id`` claimed the row (the task queue's retry count): a start of a later
        #: attempt finds the earlier one ended by a retry, not by a death (null: not recorded).
        pa.field("attempt", pa.int64(), nullable=True),
    ]
)


def _indexes_json(indexes: Sequence[ModelIndex]) -> str:
    return json.dumps([i.to_json() for i in indexes], sort_keys=True)


def _indexes_from(row: dict[str, Any]) -> tuple[ModelIndex, ...]:
    raw = row.get("indexes")
    if raw is not None:
        return tuple(ModelIndex.from_json(i) for i in json.loads(raw))
    # A row written before per-model tables (null) speaks of the one table named ``frames``.
    fp, frames, sampling = row.get("fingerprint"), int(row.get("frames") or 0), row.get("sampling") or ""
    if fp and frames > 0 and row.get("model") and sampling.startswith(f"{SamplingStrategy.INTERVAL.value}="):
        return (ModelIndex(LEGACY_FRAMES, str(row["model"]), str(fp), frames, Sampling.parse(sampling)),)
    return ()


@dataclass(slots=True)
class VideoRecord:
    """One row of the catalog."""

    video_id: str
    uri: str
    status: VideoStatus
    version: str | None = None
    error: str | None = None
    frames: int = 0
    fingerprint: str | None = None
    duration_s: float | None = None
    model: str | None = None
    sampling: str | None = None
    rev: int = 0
    task_id: str | None = None
    holder: str | None = None
    crashes: int = 0
    updated_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    indexes: tuple[ModelIndex, ...] = ()
    write_id: str | None = None
    attempt: int | None = None

    def index_in(self, table: str) -> ModelIndex | None:
        """What the catalog says frames table ``table`` holds for this video (None: nothing)."""
        return next((i for i in self.indexes if i.table == table), None)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> VideoRecord:
        return cls(
            video_id=str(row["video_id"]),
            uri=str(row["uri"]),
            status=VideoStatus(row["status"]),
            version=row.get("version"),
            error=row.get("error"),
            frames=int(row.get("frames") or 0),
            fingerprint=row.get("fingerprint"),
            duration_s=row.get("duration_s"),
            model=row.get("model"),
            sampling=row.get("sampling"),
            rev=int(row.get("rev") or 0),
            task_id=row.get("task_id"),
            holder=row.get("holder"),
            crashes=int(row.get("crashes") or 0),
            updated_at=row["updated_at"],
            indexes=_indexes_from(row),
            write_id=row.get("write_id"),
            attempt=row.get("attempt"),
        )

    def to_row(self) -> dict[str, Any]:
        row = asdict(self)
        row["status"] = self.status.value
        row["indexes"] = _indexes_json(self.indexes)
        return row

    def evolve(self, **changes: Any) -> VideoRecord:
        """A copy with ``changes`` applied (the record itself is left as read)."""
        return replace(self, **changes)
