"""The ``videos`` table (the catalog): one row per video, changed only by compare-and-set.

Every write names the revision it read (``expected_rev``) and lands only if the row still holds it,
so of two racing writers exactly one wins and the loser learns it lost. The transitions themselves
(who may move a video from which state to which) live in ``pipeline.jobs.videostate``; docs/design/state-machine.md
draws them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa

from storage.db import (
    NEXT_REVISION,
    FreshTable,
    IndexDatabase,
    SharedLookups,
    compare_and_set,
    merge_on,
    read_errors_are_transient,
    sql_quote,
    write_errors_are_transient,
)
from storage.errors import TransientError
from storage.video_record import IN_FLIGHT as IN_FLIGHT
from storage.video_record import VIDEOS_SCHEMA as VIDEOS_SCHEMA
from storage.video_record import VideoRecord as VideoRecord
from storage.video_record import VideoStatus as VideoStatus

log = logging.getLogger(__name__)

VIDEOS = "videos"


#: Columns added after the first catalogs were made, with the SQL that fills them in old rows.
_ADDED_COLUMNS = {
    "indexes": "CAST(NULL AS STRING)",
    "write_id": "CAST(NULL AS STRING)",
    "attempt": "CAST(NULL AS BIGINT)",
}


class Catalog:
    """The ``videos`` table of one index database."""

    def __init__(self, db: IndexDatabase) -> None:
        self._db = db
        self._table: Any = None
        self._fresh: FreshTable | None = None
        self._at_lock = threading.Lock()
        self._at_table: Any = None
        # A job reads its video's row at each step: the jobs of one process that read at once share a query.
        self._lookups: SharedLookups[str, VideoRecord] = SharedLookups(self.get_many)

    def _videos(self) -> Any:
        """The handle writes go through (it re-checks the manifest on every call)."""
        if self._table is None:
            try:
                table = self._db.create(VIDEOS, VIDEOS_SCHEMA)
            except ValueError:  # made by an earlier release: an older schema, without some columns
                table = self._db.open(VIDEOS)
                if table is None:
                    raise
            for name, fill in _ADDED_COLUMNS.items():
                if name not in table.schema.names:
                    _add_column(table, name, fill)
            self._table = table
        return self._table

    def _read(self) -> Any:
        """A handle for lookups, at a version no older than the latest when the call began (one
        manifest check shared by concurrent readers, see ``FreshTable``)."""
        if self._fresh is None:
            self._videos()  # the table exists from here on
            self._fresh = self._db.fresh(VIDEOS)
        return self._fresh.table()

    # -- reads ------------------------------------------------------------------------------------
    def get(self, video_id: str) -> VideoRecord | None:
        """The video's row as of a version no older than the latest when the call began (None: none);
        concurrent calls share one query (``SharedLookups``).

        Raises:
            TransientError: the table could not be read.
        """
        return self._lookups.get(video_id)

    @read_errors_are_transient
    def find(self, *, uri: str | None = None, status: VideoStatus | None = None, limit: int = 100) -> list[VideoRecord]:
        """The newest ``limit`` rows matching (the first page of ``page``)."""
        return self.page(uri=uri, status=status, limit=limit)[0]

    @read_errors_are_transient
    def page(
        self,
        *,
        uri: str | None = None,
        status: VideoStatus | None = None,
        limit: int = 100,
        after: tuple[datetime, str] | None = None,
    ) -> tuple[list[VideoRecord], tuple[datetime, str] | None]:
        """One page of rows matching, newest first (by ``updated_at``, then ``video_id``), starting
        after the position ``after`` (the previous page's last row); and the position to pass for the
        next page (None: this was the last). The filters and the position go into the table query;
        only the two ordering columns of the matches are read to order them, then the page's rows."""
        clauses = []
        if uri is not None:
            clauses.append(f"uri = {sql_quote(uri)}")
        if status is not None:
            clauses.append(f"status = {sql_quote(status.value)}")
        if after is not None:
            at = f"timestamp '{after[0].astimezone(UTC).replace(tzinfo=None).isoformat()}'"
            clauses.append(f"(updated_at < {at} OR (updated_at = {at} AND video_id < {sql_quote(after[1])}))")
        query = self._read().search().select(["video_id", "updated_at"]).limit(None)
        if clauses:
            query = query.where(" AND ".join(clauses))
        keys = query.to_arrow()
        order = sorted(
            zip(keys.column("updated_at").to_pylist(), keys.column("video_id").to_pylist(), strict=True), reverse=True
        )
        picked = order[:limit]
        rows = _by_ids(self._read, [vid for _, vid in picked])
        records = [rows[vid] for _, vid in picked if vid in rows]
        more = len(order) > limit and bool(picked)
        return records, (picked[-1][0], picked[-1][1]) if more else None

    @read_errors_are_transient
    def counts(self) -> dict[str, int]:
        table = self._read().search().select(["status"]).limit(None).to_arrow()
        counts: dict[str, int] = {s.value: 0 for s in VideoStatus}
        for value in table.column("status").to_pylist():
            counts[value] = counts.get(value, 0) + 1
        return counts

    def scan(self, uri_from: str, uri_to: str, *, include_from: bool, batch_rows: int = 4096) -> Iterator[VideoRecord]:
        """Catalog rows whose ``uri`` lies in (``uri_from``, ``uri_to``] (``[`` with ``include_from``),
        streamed in batches: memory stays bounded however many rows match. Byte order of UTF-8, the
        order S3 lists keys in."""
        lower = ">=" if include_from else ">"
        where = f"uri {lower} {sql_quote(uri_from)} AND uri <= {sql_quote(uri_to)}"
        reader = self._videos().search().where(where).limit(None).to_batches(batch_rows)
        for batch in reader:
            for row in batch.to_pylist():
                yield VideoRecord.from_row(row)

    def scan_all(self, batch_rows: int = 4096) -> Iterator[VideoRecord]:
        for batch in self._videos().search().limit(None).to_batches(batch_rows):
            for row in batch.to_pylist():
                yield VideoRecord.from_row(row)

    @read_errors_are_transient
    def in_flight_since(self, before: datetime, limit: int = 10_000) -> list[VideoRecord]:
        """Rows queued or indexing whose last write is older than ``before`` (their job may be dead)."""
        states = ", ".join(sql_quote(s.value) for s in IN_FLIGHT)
        bound = before.astimezone(UTC).replace(tzinfo=None).isoformat()
        where = f"status IN ({states}) AND updated_at < timestamp '{bound}'"
        return [VideoRecord.from_row(r) for r in self._read().search().where(where).limit(limit).to_list()]

    # -- the one write ----------------------------------------------------------------------------
    @write_errors_are_transient
    def write(self, record: VideoRecord, expected_rev: int) -> VideoRecord | None:
        """Write ``record`` if the row still holds revision ``expected_rev`` (0: the row must not exist).

        Returns the row as written (revision ``expected_rev + 1``), or None when another writer got
        there first — the caller reads again and decides anew.

        Raises:
            TransientError: the store did not take the write.
        """
        written = record.evolve(rev=expected_rev + 1, updated_at=datetime.now(UTC))
        data = pa.Table.from_pylist([written.to_row()], schema=VIDEOS_SCHEMA)
        return written if compare_and_set(self._videos(), "video_id", data, expected_rev) else None

    @write_errors_are_transient
    def write_many(self, writes: Sequence[tuple[VideoRecord, int]]) -> list[VideoRecord | None]:
        """``write`` for several videos in one commit: each lands only if its row still holds its
        ``expected_rev``, independently of the others. Returns, in order, each row as written or None
        where another writer got there first. At most one write per video.

        Raises:
            ValueError: a video appears twice.
            TransientError: the store did not take the commit, or its outcome could not be read back
                (some writes may have landed: callers treat it like any failed write).
        """
        if not writes:
            return []
        ids = [record.video_id for record, _ in writes]
        if len(set(ids)) != len(ids):
            raise ValueError("write_many takes at most one write per video")
        now = datetime.now(UTC)
        written = [record.evolve(rev=expected + 1, updated_at=now) for record, expected in writes]
        data = pa.Table.from_pylist([record.to_row() for record in written], schema=VIDEOS_SCHEMA)
        # A write of revision 1 inserts (a row holding revision 0 never exists); any other updates the
        # row only where it holds the revision before. Rows are never deleted, so a write of a later
        # revision always finds its row.
        result = (
            merge_on(self._videos(), "video_id")
            .when_matched_update_all(where=NEXT_REVISION)
            .when_not_matched_insert_all()
            .execute(data)
        )
        inserted = int(result.num_inserted_rows)
        if inserted > sum(1 for _, expected in writes if expected == 0):
            # An update found no row and inserted one: the catalog broke its own rule (rows are never
            # deleted, this handle reads the latest version). Loud, so it is never taken for a win.
            log.error("catalog commit inserted %d rows for updates of existing rows", inserted)
            raise TransientError("catalog commit inserted rows for updates of existing rows")
        landed = int(result.num_updated_rows) + inserted
        if landed == len(written):
            return list(written)
        if landed == 0:
            return [None] * len(written)
        # Some lost: the table as this commit left it says which (later commits may have moved on).
        at = self.get_many_at(ids, int(result.version))
        return [
            w if (r := at.get(w.video_id)) and (r.rev, r.updated_at) == (w.rev, w.updated_at) else None for w in written
        ]

    def version(self) -> int:
        """The table's current version (one more per commit: benchmarks count commits with it)."""
        return int(self._videos().version)

    @read_errors_are_transient
    def get_many_at(self, video_ids: Sequence[str], version: int) -> dict[str, VideoRecord]:
        """The rows of those of ``video_ids`` that had one at table version ``version``, by id. Calls
        take turns on one handle kept for this."""
        with self._at_lock:
            if self._at_table is None:
                self._videos()
                self._at_table = self._db.connect(None).open_table(VIDEOS)
            try:
                self._at_table.checkout(version)
            except ValueError as exc:  # the version was cleaned up (``optimize``'s cleanup_older_than)
                raise TransientError(f"catalog version {version} is no longer available") from exc
            return _by_ids(lambda: self._at_table, video_ids)

    def optimize(self, keep_versions_s: float, min_fragments: int = 1) -> bool:
        """Compact the table and drop its versions older than ``keep_versions_s``, if it has at least
        ``min_fragments`` fragments (compacted, it has one; each commit adds one). Whether it did."""
        table = self._videos()
        if min_fragments > 1 and len(table.to_lance().get_fragments()) < min_fragments:
            return False
        table.optimize(cleanup_older_than=timedelta(seconds=keep_versions_s))
        return True

    @read_errors_are_transient
    def get_many(self, video_ids: Iterable[str]) -> dict[str, VideoRecord]:
        """The rows of those of ``video_ids`` that have one, by id (one filtered query)."""
        return _by_ids(self._read, video_ids)


def _add_column(table: Any, name: str, fill: str) -> None:
    """A catalog made by an earlier release gets a column added since (``indexes`` null: its rows
    are read as speaking of the ``frames`` table; ``write_id`` null: no write of it is awaited). Two
    processes may race to add it: one wins."""
    try:
        table.add_columns({name: fill})
    except Exception:  # another process added it first; anything else shows on the next write
        table.checkout_latest()
        if name not in table.schema.names:
            raise
    log.info("catalog: added the %s column", name)


def _by_ids(table: Callable[[], Any], video_ids: Iterable[str]) -> dict[str, VideoRecord]:
    """The rows of those of ``video_ids`` that ``table()`` holds, by id (one filtered query)."""
    ids = sorted(set(video_ids))
    if not ids:
        return {}
    where = f"video_id IN ({', '.join(sql_quote(i) for i in ids)})"
    rows = table().search().where(where).limit(len(ids)).to_list()
    return {record.video_id: record for record in map(VideoRecord.from_row, rows)}
