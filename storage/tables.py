"""LanceDB tables on S3: ``frames`` (one row per sampled frame) and ``videos`` (the catalog).

Schemas live here and nowhere else. A video's frames are replaced by one ``merge_insert`` (readers
never see a half video); ``frame_id`` and ``video_id`` are non-null unenforced primary keys, which
turns on Lance's conflict detection for concurrent inserts of one key.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, ParamSpec, TypeVar

import lancedb
import numpy as np
import pyarrow as pa
from lancedb.index import IvfHnswSq, IvfPq, IvfRq, IvfSq
from numpy.typing import NDArray

from pipeline.errors import TransientError
from storage.config import IndexSettings, S3Settings

log = logging.getLogger(__name__)

FRAMES = "frames"
VIDEOS = "videos"
LEASES = "leases"
#: Name LanceDB gives the index on ``frames.vector``.
VECTOR_INDEX = "vector_idx"
_PK = {"lance-schema:unenforced-primary-key": "true"}


class VideoStatus(enum.StrEnum):
    QUEUED = "queued"
    INDEXING = "indexing"
    INDEXED = "indexed"
    FAILED = "failed"
    DELETED = "deleted"


def frames_schema(dim: int) -> pa.Schema:
    return pa.schema(
        [
            pa.field("frame_id", pa.string(), nullable=False, metadata=_PK),
            pa.field("video_id", pa.string(), nullable=False),
            pa.field("uri", pa.string(), nullable=False),
            pa.field("version", pa.string(), nullable=False),
            pa.field("ts_s", pa.float64(), nullable=False),
            pa.field("vector", pa.list_(pa.float32(), dim), nullable=False),
            pa.field("thumbnail", pa.binary(), nullable=True),
            pa.field("model", pa.string(), nullable=False),
        ]
    )


VIDEOS_SCHEMA = pa.schema(
    [
        pa.field("video_id", pa.string(), nullable=False, metadata=_PK),
        pa.field("uri", pa.string(), nullable=False),
        pa.field("version", pa.string(), nullable=True),
        pa.field("status", pa.string(), nullable=False),
        pa.field("error", pa.string(), nullable=True),
        pa.field("frames", pa.int64(), nullable=False),
        pa.field("duration_s", pa.float64(), nullable=True),
        pa.field("model", pa.string(), nullable=True),
        pa.field("sampling", pa.string(), nullable=True),
        #: (version, model, sampling) of the rows in ``frames``; set only when they are written.
        pa.field("fingerprint", pa.string(), nullable=True),
        pa.field("updated_at", pa.timestamp("us", tz="UTC"), nullable=False),
    ]
)


#: One row per named lease (``maintenance``): who holds it and until when (epoch seconds).
LEASES_SCHEMA = pa.schema(
    [
        pa.field("name", pa.string(), nullable=False, metadata=_PK),
        pa.field("holder", pa.string(), nullable=False),
        pa.field("expires_at_s", pa.float64(), nullable=False),
    ]
)


@dataclass(frozen=True, slots=True)
class VectorIndexState:
    """How much of ``frames`` the ANN index covers."""

    rows: int
    indexed_rows: int
    unindexed_rows: int
    has_index: bool


@dataclass(slots=True)
class VideoRecord:
    """One row of the catalog."""

    video_id: str
    uri: str
    status: VideoStatus
    version: str | None = None
    error: str | None = None
    frames: int = 0
    duration_s: float | None = None
    model: str | None = None
    sampling: str | None = None
    fingerprint: str | None = None
    updated_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> VideoRecord:
        return cls(
            video_id=str(row["video_id"]),
            uri=str(row["uri"]),
            status=VideoStatus(row["status"]),
            version=row.get("version"),
            error=row.get("error"),
            frames=int(row.get("frames") or 0),
            duration_s=row.get("duration_s"),
            model=row.get("model"),
            sampling=row.get("sampling"),
            fingerprint=row.get("fingerprint"),
            updated_at=row["updated_at"],
        )


@dataclass(frozen=True, slots=True)
class FrameRow:
    frame_id: str
    ts_s: float
    vector: NDArray[np.float32]
    thumbnail: bytes | None


@dataclass(frozen=True, slots=True)
class VideoFrames:
    """All frames of one video version, as one grouped write takes them."""

    video_id: str
    uri: str
    version: str
    model: str
    rows: list[FrameRow]


def _quote(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def storage_options(s3: S3Settings) -> dict[str, str]:
    return {
        "endpoint": s3.endpoint_url,
        "allow_http": "true" if s3.endpoint_url.startswith("http://") else "false",
        "region": s3.region,
        "aws_access_key_id": s3.access_key.get_secret_value(),
        "aws_secret_access_key": s3.secret_key.get_secret_value(),
    }


P = ParamSpec("P")
R = TypeVar("R")


def _write_errors_are_transient(write: Callable[P, R]) -> Callable[P, R]:
    """Table writes fail under commit conflicts (``Too many concurrent writers``) and object-store
    hiccups as Lance ``RuntimeError``/``OSError``s: retrying can help, so they become ``TransientError``
    (first line only: Lance messages carry paths, never credentials, but can be long)."""

    @functools.wraps(write)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return write(*args, **kwargs)
        except (RuntimeError, OSError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise TransientError(f"index table write failed: {first}") from exc

    return wrapper


class IndexStore:
    """The frames and videos tables of one LanceDB database in the index bucket."""

    def __init__(self, s3: S3Settings, uri: str | None = None) -> None:
        """``uri`` overrides the database location (a local directory in unit tests, or another S3 prefix)."""
        self._uri = uri or s3.index_uri
        self._storage_options = storage_options(s3) if self._uri.startswith("s3://") else None
        self._db = lancedb.connect(
            self._uri,
            storage_options=self._storage_options,
            # Long-lived handles (API, consumers) must see other processes' commits at once.
            read_consistency_interval=timedelta(0),
        )
        self._frames: Any = None
        self._videos: Any = None
        self._leases: Any = None
        # Search's own warm handle, with its own staleness bound (see ``search``).
        self._search_frames: Any = None
        self._search_consistency_s: float | None = None

    # -- tables -----------------------------------------------------------------------------------
    def _videos_table(self) -> Any:
        if self._videos is None:
            self._videos = self._db.create_table(VIDEOS, schema=VIDEOS_SCHEMA, exist_ok=True)
        return self._videos

    def _frames_table(self, dim: int | None = None) -> Any:
        if self._frames is None:
            if dim is None:
                try:
                    self._frames = self._db.open_table(FRAMES)
                except (ValueError, FileNotFoundError):
                    return None
            else:
                self._frames = self._db.create_table(FRAMES, schema=frames_schema(dim), exist_ok=True)
        return self._frames

    # -- catalog ----------------------------------------------------------------------------------
    def get_video(self, video_id: str) -> VideoRecord | None:
        rows = self._videos_table().search().where(f"video_id = {_quote(video_id)}").limit(1).to_list()
        return VideoRecord.from_row(rows[0]) if rows else None

    def find_videos(
        self, *, uri: str | None = None, status: VideoStatus | None = None, limit: int = 100
    ) -> list[VideoRecord]:
        clauses = []
        if uri is not None:
            clauses.append(f"uri = {_quote(uri)}")
        if status is not None:
            clauses.append(f"status = {_quote(status.value)}")
        table = self._videos_table()
        query = table.search()
        if clauses:
            query = query.where(" AND ".join(clauses))
        # Newest first: every match is read before the limit applies (the catalog is one row per video).
        records = [VideoRecord.from_row(r) for r in query.limit(max(1, table.count_rows())).to_list()]
        records.sort(key=lambda r: r.updated_at, reverse=True)
        return records[:limit]

    def count_videos(self) -> dict[str, int]:
        table = self._videos_table().to_arrow().select(["status"])
        counts: dict[str, int] = {s.value: 0 for s in VideoStatus}
        for value in table.column("status").to_pylist():
            counts[value] = counts.get(value, 0) + 1
        return counts

    def scan_videos(
        self, uri_from: str, uri_to: str, *, include_from: bool, batch_rows: int = 4096
    ) -> Iterator[VideoRecord]:
        """Catalog rows whose ``uri`` lies in (``uri_from``, ``uri_to``] (``[`` with ``include_from``),
        streamed in batches: memory stays bounded however many rows match. Byte order of UTF-8, the
        order S3 lists keys in."""
        lower = ">=" if include_from else ">"
        where = f"uri {lower} {_quote(uri_from)} AND uri <= {_quote(uri_to)}"
        reader = self._videos_table().search().where(where).limit(None).to_batches(batch_rows)
        for batch in reader:
            for row in batch.to_pylist():
                yield VideoRecord.from_row(row)

    @_write_errors_are_transient
    def insert_video_if_absent(self, record: VideoRecord) -> None:
        """Insert ``record`` unless a row for its video exists (atomic: concurrent inserts keep one)."""
        record.updated_at = datetime.now(UTC)
        row = asdict(record)
        row["status"] = record.status.value
        data = pa.Table.from_pylist([row], schema=VIDEOS_SCHEMA)
        self._videos_table().merge_insert("video_id").when_not_matched_insert_all().execute(data)

    @_write_errors_are_transient
    def set_status(
        self, video_id: str, status: VideoStatus, error: str | None = None, *, only_if_fingerprint: str | None = None
    ) -> None:
        """Change only the status (and error) of one row, leaving what other writers set alone;
        with ``only_if_fingerprint``, only while the row still holds that fingerprint (one atomic
        update: a newer version written meanwhile is left alone)."""
        where = f"video_id = {_quote(video_id)}"
        if only_if_fingerprint is not None:
            where += f" AND fingerprint = {_quote(only_if_fingerprint)}"
        self._videos_table().update(
            where=where, values={"status": status.value, "error": error, "updated_at": datetime.now(UTC)}
        )

    @_write_errors_are_transient
    def mark_failed(self, video_id: str, uri: str, reason: str, version: str | None) -> None:
        """Record a failure of ``version`` (None: unknown) without overwriting a settled outcome
        (indexed, deleted) of another or unknown version — one conditional update, so a job that
        settles the video meanwhile wins."""
        self.insert_video_if_absent(
            VideoRecord(video_id=video_id, uri=uri, status=VideoStatus.FAILED, version=version, error=reason)
        )
        unsettled = f"status NOT IN ({_quote(VideoStatus.INDEXED.value)}, {_quote(VideoStatus.DELETED.value)})"
        where = f"video_id = {_quote(video_id)} AND ({unsettled}"
        values: dict[str, Any] = {"status": VideoStatus.FAILED.value, "error": reason, "updated_at": datetime.now(UTC)}
        if version is not None:
            where += f" OR version IS NULL OR version = {_quote(version)}"
            values["version"] = version
        self._videos_table().update(where=where + ")", values=values)

    @_write_errors_are_transient
    def put_video(self, record: VideoRecord) -> None:
        """Insert or replace one catalog row."""
        record.updated_at = datetime.now(UTC)
        row = asdict(record)
        row["status"] = record.status.value
        data = pa.Table.from_pylist([row], schema=VIDEOS_SCHEMA)
        (
            self._videos_table()
            .merge_insert("video_id")
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .execute(data)
        )

    # -- frames -----------------------------------------------------------------------------------
    @_write_errors_are_transient
    def replace_frames(self, *, video_id: str, uri: str, version: str, model: str, rows: list[FrameRow]) -> None:
        """Replace all of one video's frames with ``rows`` in one commit."""
        if not rows:
            self.delete_frames(video_id)
            return
        dim = int(rows[0].vector.shape[0])
        vectors = np.stack([r.vector for r in rows]).astype(np.float32, copy=False)
        data = pa.Table.from_arrays(
            [
                pa.array([r.frame_id for r in rows], pa.string()),
                pa.array([video_id] * len(rows), pa.string()),
                pa.array([uri] * len(rows), pa.string()),
                pa.array([version] * len(rows), pa.string()),
                pa.array([r.ts_s for r in rows], pa.float64()),
                pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()), dim),
                pa.array([r.thumbnail for r in rows], pa.binary()),
                pa.array([model] * len(rows), pa.string()),
            ],
            schema=frames_schema(dim),
        )
        (
            self._frames_table(dim)
            .merge_insert("frame_id")
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .when_not_matched_by_source_delete(f"video_id = {_quote(video_id)}")
            .execute(data)
        )

    @_write_errors_are_transient
    def replace_frames_of_videos(self, videos: Sequence[VideoFrames]) -> None:
        """Replace the frames of several videos in one commit: each video's old rows are replaced by
        its ``rows`` (none: removed), rows of videos not in ``videos`` are untouched.

        Raises:
            ValueError: a video appears twice, or the vectors differ in size.
        """
        if not videos:
            return
        ids = [v.video_id for v in videos]
        if len(set(ids)) != len(ids):
            raise ValueError("a video appears twice in one grouped write")
        scope = f"video_id IN ({', '.join(_quote(i) for i in ids)})"
        written = [v for v in videos if v.rows]
        if not written:
            table = self._frames_table()
            if table is not None:
                table.delete(scope)
            return
        dims = {int(r.vector.shape[0]) for v in written for r in v.rows}
        if len(dims) != 1:
            raise ValueError(f"vectors of different sizes in one grouped write: {sorted(dims)}")
        dim = dims.pop()
        rows = [r for v in written for r in v.rows]

        def per_row(value: Callable[[VideoFrames], str]) -> pa.Array:
            return pa.array([value(v) for v in written for _ in v.rows], pa.string())

        vectors = np.stack([r.vector for r in rows]).astype(np.float32, copy=False)
        data = pa.Table.from_arrays(
            [
                pa.array([r.frame_id for r in rows], pa.string()),
                per_row(lambda v: v.video_id),
                per_row(lambda v: v.uri),
                per_row(lambda v: v.version),
                pa.array([r.ts_s for r in rows], pa.float64()),
                pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()), dim),
                pa.array([r.thumbnail for r in rows], pa.binary()),
                per_row(lambda v: v.model),
            ],
            schema=frames_schema(dim),
        )
        (
            self._frames_table(dim)
            .merge_insert("frame_id")
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .when_not_matched_by_source_delete(scope)
            .execute(data)
        )

    @_write_errors_are_transient
    def delete_frames(self, video_id: str) -> None:
        table = self._frames_table()
        if table is not None:
            table.delete(f"video_id = {_quote(video_id)}")

    def count_frames(self, video_id: str | None = None) -> int:
        table = self._frames_table()
        if table is None:
            return 0
        return int(table.count_rows(f"video_id = {_quote(video_id)}" if video_id else None))

    def _search_table(self, consistency_s: float) -> Any:
        """A frames handle kept open for searches (its index pages stay cached), which re-checks the
        table's latest version at most every ``consistency_s`` seconds instead of before every query."""
        if self._search_frames is None or self._search_consistency_s != consistency_s:
            db = lancedb.connect(
                self._uri,
                storage_options=self._storage_options,
                read_consistency_interval=timedelta(seconds=consistency_s),
            )
            try:
                self._search_frames = db.open_table(FRAMES)
            except (ValueError, FileNotFoundError):
                return None
            self._search_consistency_s = consistency_s
        return self._search_frames

    def search(
        self, vector: NDArray[np.float32], limit: int, tuning: IndexSettings | None = None, *, exact: bool = False
    ) -> list[dict[str, Any]]:
        """The ``limit`` frames nearest to ``vector`` by cosine distance, best first.

        With ``tuning`` the search runs on a warm handle and probes the ANN index with its ``nprobes`` and
        ``refine_factor``; rows not yet in the index are scanned exactly and merged in (LanceDB's plan), so
        new frames are found before the maintenance loop folds them in. ``exact`` skips the index.
        """
        table = self._frames_table() if tuning is None else self._search_table(tuning.search_consistency_s)
        if table is None:
            return []
        query = (
            table.search(vector.astype(np.float32), vector_column_name="vector")
            .distance_type("cosine")
            .select(["frame_id", "video_id", "uri", "ts_s", "_distance"])
            .limit(limit)
        )
        if exact:
            query = query.bypass_vector_index()
        elif tuning is not None:
            query = query.nprobes(tuning.nprobes)
            if tuning.refine_factor:
                query = query.refine_factor(tuning.refine_factor)
        rows: list[dict[str, Any]] = query.to_list()
        return rows

    # -- index maintenance (one worker: see storage/maintenance.py) -------------------------------
    def vector_index_state(self) -> VectorIndexState | None:
        """Rows of ``frames`` and how many the ANN index covers; None before the table exists."""
        table = self._frames_table()
        if table is None:
            return None
        rows = int(table.count_rows())
        stats = table.index_stats(VECTOR_INDEX) if self._has_vector_index(table) else None
        if stats is None:
            return VectorIndexState(rows=rows, indexed_rows=0, unindexed_rows=rows, has_index=False)
        return VectorIndexState(
            rows=rows,
            indexed_rows=int(stats.num_indexed_rows),
            unindexed_rows=int(stats.num_unindexed_rows),
            has_index=True,
        )

    @staticmethod
    def _has_vector_index(table: Any) -> bool:
        return any(getattr(i, "name", None) == VECTOR_INDEX for i in table.list_indices())

    def create_vector_index(self, settings: IndexSettings) -> None:
        """(Re)build the cosine ANN index on ``frames.vector``; IVF partitions scale with the row count."""
        table = self._frames_table()
        if table is None:
            return
        partitions = max(1, int(table.count_rows()) // settings.rows_per_partition)
        config: Any
        if settings.index_type == "IVF_PQ":
            config = IvfPq(distance_type="cosine", num_partitions=partitions, num_sub_vectors=settings.num_sub_vectors)
        elif settings.index_type == "IVF_RQ":
            config = IvfRq(distance_type="cosine", num_partitions=partitions)
        elif settings.index_type == "IVF_HNSW_SQ":
            config = IvfHnswSq(distance_type="cosine", num_partitions=partitions)
        else:
            config = IvfSq(distance_type="cosine", num_partitions=partitions)
        table.create_index("vector", config=config, replace=True, name=VECTOR_INDEX)

    def optimize(self, keep_versions_s: float) -> None:
        """Compact both tables' small fragments, fold new frames into the ANN index and drop versions older
        than ``keep_versions_s``. Concurrent writers keep working (their commits are retried on conflict)."""
        keep = timedelta(seconds=keep_versions_s)
        frames = self._frames_table()
        if frames is not None:
            frames.optimize(cleanup_older_than=keep)
        self.optimize_catalog(keep_versions_s)

    def optimize_catalog(self, keep_versions_s: float) -> None:
        """Compact the ``videos`` table and drop its old versions (status writes commit all the time)."""
        self._videos_table().optimize(cleanup_older_than=timedelta(seconds=keep_versions_s))

    def acquire_lease(self, name: str, holder: str, ttl_s: float, now_s: float) -> bool:
        """Take or renew the lease ``name`` for ``holder`` until ``now_s + ttl_s``; False while another
        holder has it. One conditional ``merge_insert``: of two workers racing for it, one commit wins."""
        if self._leases is None:
            self._leases = self._db.create_table(LEASES, schema=LEASES_SCHEMA, exist_ok=True)
        row = pa.Table.from_pylist(
            [{"name": name, "holder": holder, "expires_at_s": now_s + ttl_s}], schema=LEASES_SCHEMA
        )
        result = (
            self._leases.merge_insert("name")
            .when_matched_update_all(where=f"target.holder = {_quote(holder)} OR target.expires_at_s < {now_s!r}")
            .when_not_matched_insert_all()
            .execute(row)
        )
        return int(result.num_updated_rows) + int(result.num_inserted_rows) > 0

    def thumbnail(self, frame_id: str) -> bytes | None:
        table = self._frames_table()
        if table is None:
            return None
        rows = table.search().where(f"frame_id = {_quote(frame_id)}").select(["thumbnail"]).limit(1).to_list()
        return rows[0]["thumbnail"] if rows else None
