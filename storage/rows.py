"""A table of videos' rows: what a frames table and a text table share.

Each row carries its video's ``video_id``, ``uri``, ``version`` and the ``fingerprint`` of the result it
belongs to, and an id of its own (the merge key). A video's rows are replaced in one ``merge_insert``
(readers never see half a video); several videos can share one commit. The kinds of table bring their
layout, their rows and their searches (``storage.frames``, ``storage.texts``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Generic, Protocol, TypeVar

import pyarrow as pa

from storage.db import IndexDatabase, merge_on, read_errors_are_transient, sql_quote, write_errors_are_transient


class VideoRows(Protocol):
    """One video's rows for one table: ``storage.frames.VideoFrames`` or ``storage.texts.VideoText``."""

    @property
    def video_id(self) -> str: ...

    @property
    def rows(self) -> Sequence[object]: ...


V = TypeVar("V", bound=VideoRows)


@dataclass(slots=True)
class FrameSummary:
    """What a table of rows (frames or text segments) holds for one video."""

    rows: int = 0
    fingerprints: Counter[str] = field(default_factory=Counter)
    duplicate_ids: int = 0
    #: The object the rows say they come from (any one row's ``uri``).
    uri: str = ""


class VideoRowsTable(ABC, Generic[V]):
    """One table of videos' rows in an index database, created on the first write of rows. A kind of
    table names its row id column and turns videos of its kind into Arrow rows of its layout."""

    #: The column that tells rows apart (the merge key).
    id_column: str

    def __init__(self, db: IndexDatabase, name: str) -> None:
        self._db = db
        self.name = name
        self._table: Any = None

    # -- what a kind of table calls and fills in (public: the kinds live in other modules) --------

    def opened(self, schema: pa.Schema | None = None) -> Any | None:
        """The table handle; with ``schema`` it is created if missing, else None until it exists."""
        if self._table is None:
            self._table = self._db.open(self.name) if schema is None else self._db.create(self.name, schema)
        return self._table

    @abstractmethod
    def arrow_rows(self, videos: Sequence[V]) -> pa.Table:
        """The rows of ``videos`` (each with rows) as one Arrow table of this table's layout (its schema is
        the one a missing table is created with).

        Raises:
            ValueError: the rows can't be written (two share an id, or they break the layout's rules).
        """

    def after_write(self) -> None:
        """Called after a commit that wrote rows."""

    @abstractmethod
    def no_rows(self, video_id: str, uri: str) -> V:
        """A video with no rows in this table: replacing with it removes the video's rows."""

    # -- writes -----------------------------------------------------------------------------------
    @write_errors_are_transient
    def replace(self, video: V) -> None:
        """Replace all of one video's rows with ``video.rows`` in one commit (the ungrouped writer)."""
        self.replace_many([video])

    @write_errors_are_transient
    def replace_many(self, videos: Sequence[V], timeout: timedelta | None = None) -> None:
        """Replace the rows of several videos in one commit: each video's old rows are replaced by
        its ``rows`` (none: removed), rows of videos not in ``videos`` are untouched. ``timeout``:
        the merge is cancelled once it has run that long, its first attempt included (Lance's own
        default bounds only its conflict retries), so it can't commit after that.

        Raises:
            ValueError: a video appears twice, or the rows can't be written (``arrow_rows``).
        """
        if not videos:
            return
        ids = [v.video_id for v in videos]
        if len(set(ids)) != len(ids):
            raise ValueError("a video appears twice in one grouped write")
        written = [v for v in videos if v.rows]
        data = self.arrow_rows(written) if written else None
        table = self.opened(None if data is None else data.schema)
        if table is None:
            return  # removals from a table never written: nothing to remove
        if data is None:
            # Removals only: the same merge with no source rows (a plain delete can't take a timeout), in
            # the table's own layout (a table of an older layout refuses rows of the current one).
            data = table.schema.empty_table()
        scope = f"video_id IN ({', '.join(sql_quote(i) for i in ids)})"
        (
            merge_on(table, self.id_column)
            .when_matched_update_all()
            .when_not_matched_insert_all()
            .when_not_matched_by_source_delete(scope)
            .execute(data, timeout=timeout)
        )
        if written:
            self.after_write()

    @write_errors_are_transient
    def delete(self, video_id: str) -> None:
        table = self.opened()
        if table is not None:
            table.delete(f"video_id = {sql_quote(video_id)}")

    # -- reads ------------------------------------------------------------------------------------
    @read_errors_are_transient
    def count(self, video_id: str | None = None) -> int:
        table = self.opened()
        if table is None:
            return 0
        return int(table.count_rows(f"video_id = {sql_quote(video_id)}" if video_id else None))

    @read_errors_are_transient
    def summary(self, video_id: str) -> FrameSummary:
        """One video's rows, fingerprints and repeated row ids."""
        found = FrameSummary()
        table = self.opened()
        if table is None:
            return found
        query = table.search().where(f"video_id = {sql_quote(video_id)}").select([self.id_column, "fingerprint", "uri"])
        seen: set[str] = set()
        for row in query.limit(None).to_list():
            _add(found, seen, row[self.id_column], row["fingerprint"], row["uri"])
        return found

    @read_errors_are_transient
    def summaries_in(self, uri_from: str, uri_to: str, *, include_from: bool) -> dict[str, FrameSummary]:
        """The summaries of the videos whose rows' ``uri`` lies in (``uri_from``, ``uri_to``] (``[``
        with ``include_from``): one filtered scan of four small columns, memory bounded by the range."""
        found: dict[str, FrameSummary] = {}
        table = self.opened()
        if table is None:
            return found
        lower = ">=" if include_from else ">"
        where = f"uri {lower} {sql_quote(uri_from)} AND uri <= {sql_quote(uri_to)}"
        seen: dict[str, set[str]] = {}
        for batch in table.search().where(where).select(self._summary_columns()).limit(None).to_batches():
            self._add_batch(found, seen, batch)
        return found

    def summaries(self, batch_rows: int = 65_536) -> Iterator[tuple[str, FrameSummary]]:
        """Every video's summary, from one streamed scan of four small columns. Memory grows with the
        number of row ids (to find repeats), not with the rows' other columns."""
        table = self.opened()
        if table is None:
            return
        by_video: dict[str, FrameSummary] = {}
        seen: dict[str, set[str]] = {}
        for batch in table.search().select(self._summary_columns()).limit(None).to_batches(batch_rows):
            self._add_batch(by_video, seen, batch)
        yield from by_video.items()

    def _summary_columns(self) -> list[str]:
        return ["video_id", self.id_column, "fingerprint", "uri"]

    def _add_batch(self, found: dict[str, FrameSummary], seen: dict[str, set[str]], batch: pa.RecordBatch) -> None:
        for vid, row_id, fp, uri in zip(
            batch.column("video_id").to_pylist(),
            batch.column(self.id_column).to_pylist(),
            batch.column("fingerprint").to_pylist(),
            batch.column("uri").to_pylist(),
            strict=True,
        ):
            _add(found.setdefault(vid, FrameSummary()), seen.setdefault(vid, set()), row_id, fp, uri)


def _add(summary: FrameSummary, seen: set[str], row_id: str, fingerprint: str, uri: str) -> None:
    summary.uri = summary.uri or uri
    summary.rows += 1
    summary.fingerprints[fingerprint] += 1
    if row_id in seen:
        summary.duplicate_ids += 1
    seen.add(row_id)


def unique_ids(ids: Sequence[str], column: str) -> None:
    """Check that no two rows of one write share their id (``ids``, the rows' ``column``).

    Raises:
        ValueError: two do.
    """
    if len(set(ids)) != len(ids):
        raise ValueError(f"two rows share a {column} in one write")
