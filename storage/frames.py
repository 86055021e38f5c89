"""The ``frames`` table: one row per sampled frame, carrying the fingerprint of the index result it
belongs to, so that frames and catalog can be held against each other (``vidx check``).

A video's rows are replaced in one ``merge_insert`` (readers never see a half video); several videos
can share one commit (``replace_many``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from storage.config import IndexSettings
from storage.db import (
    PRIMARY_KEY,
    FreshTable,
    IndexDatabase,
    merge_on,
    read_errors_are_transient,
    sql_quote,
    write_errors_are_transient,
)

log = logging.getLogger(__name__)

FRAMES = "frames"


def frames_schema(dim: int) -> pa.Schema:
    return pa.schema(
        [
            pa.field("frame_id", pa.string(), nullable=False, metadata=PRIMARY_KEY),
            pa.field("video_id", pa.string(), nullable=False),
            pa.field("uri", pa.string(), nullable=False),
            pa.field("version", pa.string(), nullable=False),
            #: (version, model, sampling) of the index result this row belongs to.
            pa.field("fingerprint", pa.string(), nullable=False),
            pa.field("ts_s", pa.float64(), nullable=False),
            pa.field("vector", pa.list_(pa.float32(), dim), nullable=False),
            pa.field("thumbnail", pa.binary(), nullable=True),
            pa.field("model", pa.string(), nullable=False),
        ]
    )


@dataclass(frozen=True, slots=True)
class FrameRow:
    frame_id: str
    ts_s: float
    vector: NDArray[np.float32]
    thumbnail: bytes | None


@dataclass(frozen=True, slots=True)
class VideoFrames:
    """All frames of one index result of one video (none: the video's rows are removed)."""

    video_id: str
    uri: str
    version: str
    fingerprint: str
    model: str
    rows: list[FrameRow]


@dataclass(slots=True)
class FrameSummary:
    """What ``frames`` holds for one video."""

    rows: int = 0
    fingerprints: Counter[str] = field(default_factory=Counter)
    duplicate_ids: int = 0
    #: The object the rows say they come from (any one row's ``uri``).
    uri: str = ""


class FrameTable:
    """One frames table of an index database (one per model, see ``storage.models``; created on
    the first write: its vector size comes from the model)."""

    def __init__(self, db: IndexDatabase, name: str = FRAMES) -> None:
        self._db = db
        self.name = name
        self._table: Any = None
        # Search's own warm handles (see ``_search_handle``).
        self._search_table: Any = None
        self._search_consistency_s: float | None = None
        self._search_fresh: FreshTable | None = None

    def table(self, dim: int | None = None) -> Any | None:
        """The table handle; with ``dim`` it is created if missing, else None until it exists."""
        if self._table is None:
            if dim is None:
                self._table = self._db.open(self.name)
            else:
                self._table = self._db.create(self.name, frames_schema(dim))
        return self._table

    # -- writes -----------------------------------------------------------------------------------
    @write_errors_are_transient
    def replace(self, frames: VideoFrames) -> None:
        """Replace all of one video's rows with ``frames.rows`` in one commit."""
        self.replace_many([frames])

    @write_errors_are_transient
    def replace_many(self, videos: Sequence[VideoFrames], timeout: timedelta | None = None) -> None:
        """Replace the rows of several videos in one commit: each video's old rows are replaced by
        its ``rows`` (none: removed), rows of videos not in ``videos`` are untouched. ``timeout``:
        the merge is cancelled once it has run that long, its first attempt included (Lance's own
        default bounds only its conflict retries), so it can't commit after that.

        Raises:
            ValueError: a video appears twice, two rows share a ``frame_id``, or the vectors differ in size.
        """
        if not videos:
            return
        ids = [v.video_id for v in videos]
        if len(set(ids)) != len(ids):
            raise ValueError("a video appears twice in one grouped write")
        scope = f"video_id IN ({', '.join(sql_quote(i) for i in ids)})"
        written = [v for v in videos if v.rows]
        if written:
            data = _arrow_rows(written)
            table = self.table(data.schema.field("vector").type.list_size)
            assert table is not None  # created above: a dimension was given
        else:  # removals only: the same merge with no source rows (a plain delete can't take a timeout)
            table = self.table()
            if table is None:
                return
            data = table.schema.empty_table()
        (
            merge_on(table, "frame_id")
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .when_not_matched_by_source_delete(scope)
            .execute(data, timeout=timeout)
        )

    @write_errors_are_transient
    def delete(self, video_id: str) -> None:
        table = self.table()
        if table is not None:
            table.delete(f"video_id = {sql_quote(video_id)}")

    # -- reads ------------------------------------------------------------------------------------
    @read_errors_are_transient
    def count(self, video_id: str | None = None) -> int:
        table = self.table()
        if table is None:
            return 0
        return int(table.count_rows(f"video_id = {sql_quote(video_id)}" if video_id else None))

    @read_errors_are_transient
    def summary(self, video_id: str) -> FrameSummary:
        """Rows, fingerprints and repeated ``frame_id``s of one video."""
        return summary_of(self.table(), "frame_id", video_id)

    @read_errors_are_transient
    def summaries_in(self, uri_from: str, uri_to: str, *, include_from: bool) -> dict[str, FrameSummary]:
        """The summaries of the videos whose rows' ``uri`` lies in (``uri_from``, ``uri_to``] (``[``
        with ``include_from``): one filtered scan of four small columns, memory bounded by the range."""
        return summaries_in(self.table(), "frame_id", uri_from, uri_to, include_from=include_from)

    def summaries(self, batch_rows: int = 65_536) -> Iterator[tuple[str, FrameSummary]]:
        """Every video's summary, from one streamed scan of three columns. Memory grows with the
        number of frame ids (to find repeats), not with vectors or thumbnails."""
        table = self.table()
        if table is None:
            return
        by_video: dict[str, FrameSummary] = {}
        seen: dict[str, set[str]] = {}
        reader = (
            table.search().select(["video_id", "frame_id", "fingerprint", "uri"]).limit(None).to_batches(batch_rows)
        )
        for batch in reader:
            add_summary_batch(by_video, seen, batch)
        yield from by_video.items()

    @read_errors_are_transient
    def thumbnail(self, frame_id: str, version: str | None = None) -> bytes | None:
        """The frame's JPEG; with ``version``, only while the frame is of that content version (a link
        to a video's old version finds nothing once the video is overwritten)."""
        table = self.table()
        if table is None:
            return None
        where = f"frame_id = {sql_quote(frame_id)}"
        if version is not None:
            where += f" AND version = {sql_quote(version)}"
        rows = table.search().where(where).select(["thumbnail"]).limit(1).to_list()
        return rows[0]["thumbnail"] if rows else None

    def _search_handle(self, consistency_s: float) -> Any | None:
        """A handle kept open for searches (its index pages stay cached); None while the table does not
        exist. With ``consistency_s`` 0 it sees every commit finished before the search began (one
        manifest check shared by the searches waiting at that moment, ``FreshTable``): a frame whose
        commit landed is found. Above 0 it re-checks the latest version at most that often instead."""
        # "No such table" is caught on the first open only: a later failed check is the search's error.
        if consistency_s == 0:
            if self._search_fresh is not None:
                return self._search_fresh.table()
            fresh = self._db.fresh(self.name)
            try:
                table = fresh.table()  # opens it, at the latest version
            except (ValueError, FileNotFoundError):  # nothing was indexed with this model yet
                return None
            self._search_fresh = fresh
            return table
        if self._search_table is None or self._search_consistency_s != consistency_s:
            try:
                self._search_table = self._db.connect(timedelta(seconds=consistency_s)).open_table(self.name)
            except (ValueError, FileNotFoundError):
                return None
            self._search_consistency_s = consistency_s
        return self._search_table

    @read_errors_are_transient
    def search(
        self, vector: NDArray[np.float32], limit: int, tuning: IndexSettings | None = None, *, exact: bool = False
    ) -> list[dict[str, Any]]:
        """The ``limit`` frames nearest to ``vector`` by cosine distance, best first.

        With ``tuning`` the search runs on a warm handle and probes the ANN index with its ``nprobes`` and
        ``refine_factor``; rows not yet in the index are scanned exactly and merged in (LanceDB's plan), so
        new frames are found before the maintenance loop folds them in. ``exact`` skips the index.
        """
        table = self.table() if tuning is None else self._search_handle(tuning.search_consistency_s)
        if table is None:
            return []
        query = (
            table.search(vector.astype(np.float32), vector_column_name="vector")
            .distance_type("cosine")
            .select(["frame_id", "video_id", "uri", "version", "ts_s", "_distance"])
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


def summary_of(table: Any | None, id_column: str, video_id: str) -> FrameSummary:
    """One video's rows, fingerprints and repeated ids (told by ``id_column``) in ``table``."""
    found = FrameSummary()
    if table is None:
        return found
    rows = table.search().where(f"video_id = {sql_quote(video_id)}").select([id_column, "fingerprint", "uri"])
    seen: set[str] = set()
    for row in rows.limit(None).to_list():
        _add(found, seen, row[id_column], row["fingerprint"], row["uri"])
    return found


def summaries_in(
    table: Any | None, id_column: str, uri_from: str, uri_to: str, *, include_from: bool
) -> dict[str, FrameSummary]:
    """Each video's summary over the rows of ``table`` whose ``uri`` lies in (``uri_from``, ``uri_to``]
    (``[`` with ``include_from``), repeats told by ``id_column``: one filtered scan of four small columns."""
    found: dict[str, FrameSummary] = {}
    if table is None:
        return found
    lower = ">=" if include_from else ">"
    where = f"uri {lower} {sql_quote(uri_from)} AND uri <= {sql_quote(uri_to)}"
    seen: dict[str, set[str]] = {}
    columns = {"video_id": "video_id", "frame_id": id_column, "fingerprint": "fingerprint", "uri": "uri"}
    for batch in table.search().where(where).select(columns).limit(None).to_batches():
        add_summary_batch(found, seen, batch)
    return found


def add_summary_batch(found: dict[str, FrameSummary], seen: dict[str, set[str]], batch: pa.RecordBatch) -> None:
    for vid, fid, fp, uri in zip(
        batch.column("video_id").to_pylist(),
        batch.column("frame_id").to_pylist(),
        batch.column("fingerprint").to_pylist(),
        batch.column("uri").to_pylist(),
        strict=True,
    ):
        _add(found.setdefault(vid, FrameSummary()), seen.setdefault(vid, set()), fid, fp, uri)


def _add(summary: FrameSummary, seen: set[str], frame_id: str, fingerprint: str, uri: str) -> None:
    summary.uri = summary.uri or uri
    summary.rows += 1
    summary.fingerprints[fingerprint] += 1
    if frame_id in seen:
        summary.duplicate_ids += 1
    seen.add(frame_id)


def _arrow_rows(videos: Sequence[VideoFrames]) -> pa.Table:
    """The rows of ``videos`` as one Arrow table (one column build, no per-row Python objects but ids).

    Raises:
        ValueError: the vectors differ in size, or two rows share a ``frame_id``.
    """
    dims = {int(r.vector.shape[0]) for v in videos for r in v.rows}
    if len(dims) != 1:
        raise ValueError(f"vectors of different sizes in one grouped write: {sorted(dims)}")
    dim = dims.pop()
    rows = [r for v in videos for r in v.rows]
    if len({r.frame_id for r in rows}) != len(rows):
        raise ValueError("two rows share a frame_id in one write")

    def per_row(value: Callable[[VideoFrames], str]) -> pa.Array:
        return pa.array([value(v) for v in videos for _ in v.rows], pa.string())

    vectors = np.stack([r.vector for r in rows]).astype(np.float32, copy=False)
    return pa.Table.from_arrays(
        [
            pa.array([r.frame_id for r in rows], pa.string()),
            per_row(lambda v: v.video_id),
            per_row(lambda v: v.uri),
            per_row(lambda v: v.version),
            per_row(lambda v: v.fingerprint),
            pa.array([r.ts_s for r in rows], pa.float64()),
            pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()), dim),
            pa.array([r.thumbnail for r in rows], pa.binary()),
            per_row(lambda v: v.model),
        ],
        schema=frames_schema(dim),
    )
