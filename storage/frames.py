"""The ``frames`` table: one row per sampled frame, carrying the fingerprint of the index result it
belongs to, so that frames and catalog can be held against each other (``vidx check``).

A video's rows are replaced in one ``merge_insert`` (readers never see a half video); several videos
can share one commit (``replace_many``, ``storage.rows``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from storage.config import IndexSettings
from storage.db import PRIMARY_KEY, FreshTable, IndexDatabase, read_errors_are_transient, sql_quote
from storage.rows import FrameSummary as FrameSummary
from storage.rows import VideoRowsTable, unique_ids

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


class FrameTable(VideoRowsTable[VideoFrames]):
    """One frames table of an index database (one per model, see ``storage.models``; created on
    the first write: its vector size comes from the model)."""

    id_column = "frame_id"

    def __init__(self, db: IndexDatabase, name: str = FRAMES) -> None:
        super().__init__(db, name)
        # Search's own warm handles (see ``_search_handle``).
        self._search_table: Any = None
        self._search_consistency_s: float | None = None
        self._search_fresh: FreshTable | None = None

    def table(self, dim: int | None = None) -> Any | None:
        """The table handle; with ``dim`` it is created if missing, else None until it exists."""
        return self.opened(None if dim is None else frames_schema(dim))

    def no_rows(self, video_id: str, uri: str) -> VideoFrames:
        return VideoFrames(video_id, uri, "", "", "", rows=[])

    def arrow_rows(self, videos: Sequence[VideoFrames]) -> pa.Table:
        """The rows of ``videos`` as one Arrow table (one column build, no per-row Python objects but ids).

        Raises:
            ValueError: the vectors differ in size, or two rows share a ``frame_id``.
        """
        dims = {int(r.vector.shape[0]) for v in videos for r in v.rows}
        if len(dims) != 1:
            raise ValueError(f"vectors of different sizes in one grouped write: {sorted(dims)}")
        dim = dims.pop()
        rows = [r for v in videos for r in v.rows]
        unique_ids([r.frame_id for r in rows], "frame_id")

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

    # -- reads ------------------------------------------------------------------------------------
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
