"""Index maintenance: builds the ANN index on ``frames.vector`` once the table is big enough and runs
``optimize`` (compaction, new rows folded into the index, old versions pruned) on both tables.

It runs from one worker at a time. Several are harmless but wasteful (compactions conflict with each
other and with writers, and are retried), so a round first takes the ``maintenance`` lease in the
index database: another process's loop waits until the holder stops renewing it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lancedb.index import BTree, IvfHnswSq, IvfPq, IvfRq, IvfSq

from pipeline.upkeep.leased_loop import LeasedLoop, LeasedService
from storage.config import IndexSettings
from storage.frames import FRAMES, FrameTable
from storage.tables import IndexStore

log = logging.getLogger(__name__)

LEASE = "maintenance"
#: Columns looked up by id, per table: a BTREE index each, so a lookup or a merge on the key reads
#: the index instead of scanning every fragment.
SCALAR_INDEXES = {"videos": ("video_id",), "frames": ("video_id", "frame_id")}
#: A text table's: a video's words are read, replaced and removed by these.
TEXT_SCALAR_INDEXES = ("video_id", "segment_id")
#: Name LanceDB gives the index on ``frames.vector``.
VECTOR_INDEX = "vector_idx"


class Action(enum.StrEnum):
    SKIPPED_NOT_LEADER = "skipped_not_leader"
    NO_TABLE = "no_table"
    FLAT = "flat"  # below the row threshold: exact scans, no index
    INDEX_CREATED = "index_created"
    INDEX_REBUILT = "index_rebuilt"  # the table outgrew the partitions it was trained for
    OPTIMIZED = "optimized"
    UP_TO_DATE = "up_to_date"


@dataclass(frozen=True, slots=True)
class RoundResult:
    action: Action
    rows: int = 0
    unindexed_rows: int = 0
    took_s: float = 0.0


@dataclass(frozen=True, slots=True)
class VectorIndexState:
    """How much of ``frames`` the ANN index covers."""

    rows: int
    indexed_rows: int
    unindexed_rows: int
    has_index: bool


def vector_index_state(store: IndexStore, frames: FrameTable | None = None) -> VectorIndexState | None:
    """Rows of a frames table (by default ``frames``) and how many the ANN index covers; None before
    the table exists."""
    table = (frames or store.frames).table()
    if table is None:
        return None
    rows = int(table.count_rows())
    has_index = any(getattr(i, "name", None) == VECTOR_INDEX for i in table.list_indices())
    stats = table.index_stats(VECTOR_INDEX) if has_index else None
    if stats is None:
        return VectorIndexState(rows=rows, indexed_rows=0, unindexed_rows=rows, has_index=False)
    return VectorIndexState(
        rows=rows,
        indexed_rows=int(stats.num_indexed_rows),
        unindexed_rows=int(stats.num_unindexed_rows),
        has_index=True,
    )


def create_vector_index(store: IndexStore, settings: IndexSettings, frames: FrameTable | None = None) -> None:
    """(Re)build the cosine ANN index on a frames table's ``vector``; IVF partitions scale with the row count."""
    table = (frames or store.frames).table()
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


def ensure_scalar_indexes(
    store: IndexStore, frames_tables: Sequence[str] = (), text_tables: Sequence[str] = ()
) -> list[str]:
    """Create the ``SCALAR_INDEXES`` a table lacks (new rows are folded in by ``optimize``; every
    table of ``frames_tables`` gets those of ``frames``, every one of ``text_tables`` ``TEXT_SCALAR_INDEXES``);
    returns the ``table.column`` names created."""
    created = []
    wanted = {
        **SCALAR_INDEXES,
        **{name: SCALAR_INDEXES[FRAMES] for name in frames_tables},
        **{name: TEXT_SCALAR_INDEXES for name in text_tables},
    }
    for name, columns in wanted.items():
        table = store.db.open(name)
        if table is None:
            continue
        have = {tuple(getattr(i, "columns", ())) for i in table.list_indices()}
        for column in columns:
            if (column,) not in have:
                table.create_index(column, config=BTree(), name=f"{column}_idx")
                created.append(f"{name}.{column}")
    if created:
        log.info("scalar indexes created: %s", ", ".join(created))
    return created


def compact(
    store: IndexStore,
    target_rows: int,
    keep_versions_s: float,
    frames_tables: Sequence[FrameTable] = (),
    *,
    catalog: bool = True,
) -> None:
    """Merge small fragments: the whole catalog (it is small; ``catalog``), and fragments below
    ``target_rows`` of each frames table (default ``frames``; a full one is not rewritten again). Index
    upkeep waits for the full round."""
    for table in frames_tables or [store.frames]:
        frames = table.table()
        if frames is not None:
            frames.to_lance().optimize.compact_files(target_rows_per_fragment=target_rows)
    if catalog:
        store.catalog.optimize(keep_versions_s)


def optimize(
    store: IndexStore, keep_versions_s: float, frames_table: FrameTable | None = None, *, catalog: bool = True
) -> None:
    """Compact a frames table (default ``frames``) and the catalog, fold new frames into the ANN
    index and drop versions older than ``keep_versions_s``. Concurrent writers keep working (their
    commits are retried on conflict)."""
    frames = (frames_table or store.frames).table()
    if frames is not None:
        frames.optimize(cleanup_older_than=timedelta(seconds=keep_versions_s))
    if catalog:
        store.catalog.optimize(keep_versions_s)


class IndexMaintainer:
    """One maintenance round per call to ``run_once``; its ``service`` repeats it every ``optimize_interval_s``
    (compactions in between), under the ``maintenance`` lease."""

    def __init__(
        self,
        store: IndexStore,
        settings: IndexSettings,
        *,
        holder: str | None = None,
        clock: Callable[[], float] = time.time,
        tables: Callable[[], list[str]] | None = None,
        text_tables: Callable[[], list[str]] | None = None,
    ) -> None:
        """``tables`` names the frames tables to keep up (the live models', active first); by
        default ``frames``. ``text_tables`` the text tables (the live one): each round and each compaction
        tick builds a missing full-text index and, past ``optimize_min_unindexed_rows`` rows it does not
        cover, folds them in."""
        self._store = store
        self._tables = tables or (lambda: [FRAMES])
        self._text_tables = text_tables or (lambda: [])
        self._settings = settings
        #: Ticks from now on, every ``min(compact_interval_s, optimize_interval_s)``: a full round when one
        #: is due, else a compaction; a failed tick is logged and the next one tries again.
        self.service = LeasedService(
            LeasedLoop(
                "index-maintenance",
                store.leases,
                LEASE,
                every_s=min(settings.compact_interval_s, settings.optimize_interval_s),
                ttl_s=settings.lease_ttl_s,
                first_tick_now=True,
                holder=holder,
                clock=clock,
            ),
            self._full_round,
            tick=self._tick,
        )
        #: When the next full round is due (monotonic seconds); compactions until then.
        self._next_full = 0.0
        #: Per table: rows its current index was built on (after a restart: the rows it covered when first seen).
        self._built: dict[str, int] = {}
        #: The catalog's version right after this worker last compacted it.
        self._catalog_compacted: int | None = None

    @property
    def holder(self) -> str:
        return self.service.loop.holder

    def run_once(self) -> RoundResult:
        """Create the index past ``ann_min_rows`` (rebuild it when the table has grown ``rebuild_growth``
        times), else fold new rows in and compact (both tables).

        Library errors propagate (the loop of ``service`` logs them and tries again next round)."""
        result = self.service.run_once()
        return RoundResult(Action.SKIPPED_NOT_LEADER) if result is None else result

    def _full_round(self) -> RoundResult:
        started = time.monotonic()
        names, texts = self._tables(), self._text_tables()
        ensure_scalar_indexes(self._store, [n for n in names if n != FRAMES], texts)
        results = [self._table_round(self._store.frames_table(name), started) for name in names]
        for name in texts:
            self._text_round(name)
        return results[0]

    def _text_round(self, name: str) -> None:
        """A text table's upkeep: its full-text index built if missing, then rows it does not cover
        yet folded in once there are ``optimize_min_unindexed_rows`` of them (a search scans those)."""
        text = self._store.text_table(name)
        if text.table() is None:
            return
        if text.ensure_fts_index():
            log.info("full-text index built on %s", name)
            return
        unindexed = text.unindexed_rows()
        if unindexed is None or unindexed < max(1, self._settings.optimize_min_unindexed_rows):
            return
        started = time.monotonic()
        text.optimize(self._settings.keep_versions_s)
        log.info("optimized %s: %d unindexed rows folded in %.1fs", name, unindexed, time.monotonic() - started)

    def _table_round(self, frames: FrameTable, started: float) -> RoundResult:
        s = self._settings
        state = vector_index_state(self._store, frames)
        if state is None:
            return RoundResult(Action.NO_TABLE)
        if not state.has_index:
            if state.rows < s.ann_min_rows:
                # Still compact: one small fragment per video write slows scans as much as missing the index.
                optimize(self._store, s.keep_versions_s, frames, catalog=False)
                self._compact_catalog()
                return RoundResult(Action.FLAT, state.rows, state.unindexed_rows, time.monotonic() - started)
            return self._build(frames, state.rows, Action.INDEX_CREATED, started)
        built = self._built.setdefault(frames.name, state.indexed_rows)
        if state.rows >= s.rebuild_growth * max(1, built):
            return self._build(frames, state.rows, Action.INDEX_REBUILT, started)
        if state.unindexed_rows < max(1, s.optimize_min_unindexed_rows):
            # No new frames, but the catalog keeps committing status changes (deletes, duplicates).
            self._compact_catalog()
            return RoundResult(Action.UP_TO_DATE, state.rows, state.unindexed_rows)
        optimize(self._store, s.keep_versions_s, frames, catalog=False)
        self._compact_catalog()
        took = time.monotonic() - started
        log.info(
            "optimized %s: %d unindexed of %d rows folded in %.1fs", frames.name, state.unindexed_rows, state.rows, took
        )
        return RoundResult(Action.OPTIMIZED, state.rows, state.unindexed_rows, took)

    def _build(self, frames: FrameTable, rows: int, action: Action, started: float) -> RoundResult:
        create_vector_index(self._store, self._settings, frames)
        self._built[frames.name] = rows
        took = time.monotonic() - started
        log.info(
            "vector index %s of %s: %s over %d rows in %.1fs",
            action.value,
            frames.name,
            self._settings.index_type,
            rows,
            took,
        )
        return RoundResult(action, rows, 0, took)

    def compact_once(self) -> bool:
        """Compact small fragments if this worker holds the lease; returns whether it did."""
        return self.service.loop.once(self._compact) is True

    def _compact_catalog(self, min_fragments: int = 1) -> None:
        """Compact the catalog if anything was written to it since this worker last did (Lance's optimize
        commits versions even with nothing to merge: a quiet catalog gains none) and it has at least
        ``min_fragments`` fragments (each status commit adds one)."""
        catalog = self._store.catalog
        if catalog.version() == self._catalog_compacted:
            return
        if catalog.optimize(self._settings.keep_versions_s, min_fragments):
            self._catalog_compacted = catalog.version()

    def _compact(self) -> bool:
        s = self._settings
        tables = [self._store.frames_table(n) for n in self._tables()]
        compact(self._store, s.compact_target_rows, s.keep_versions_s, tables, catalog=False)
        self._compact_catalog(s.catalog_compact_fragments)
        # Words written since the full-text index was built rank below those in it (and match no near
        # word): they are folded in at every compaction tick, not only at the full round.
        for name in self._text_tables():
            self._text_round(name)
        return True

    def _tick(self) -> None:
        """A full round when one is due (every ``optimize_interval_s``, lease or not), else a compaction."""
        full = time.monotonic() >= self._next_full
        try:
            if full:
                self.run_once()
            else:
                self.compact_once()
        finally:
            if full:
                self._next_full = time.monotonic() + self._settings.optimize_interval_s
