"""What an index job must do for one video, decided from what it read; no storage here.

``plan_index`` for an object that exists, ``plan_removal`` for one that is gone. The indexer
(``pipeline.index.indexer``) carries a plan out and re-reads before every settling write, so a plan
is only ever acted on through the compare-and-set transitions of ``pipeline.jobs.videostate``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from pipeline.jobs.videostate import Attempt
from storage.catalog import VideoRecord, VideoStatus
from storage.ids import fingerprint, text_fingerprint
from storage.models import ModelIndex, ModelTable
from storage.sampling import Sampling


class Step(enum.StrEnum):
    """What a job does about its video."""

    #: Nothing to change or rewrite: the row already says what the tables hold.
    LEAVE = "leave"
    #: Every live table holds this content already: settle the row ``indexed`` (``confirm``).
    CONFIRM = "confirm"
    #: Claim the row, fetch, decode and embed for the tables in ``need``, write them, settle ``indexed``.
    EMBED = "embed"
    #: No rows and a row that says ``deleted`` (or none): rewrite it ``deleted``, so a `queued` mark loses.
    SETTLE_REMOVED = "settle_removed"
    #: Remove the video's rows from every live table, then settle ``deleted``.
    REMOVE = "remove"


@dataclass(frozen=True, slots=True)
class IndexPlan:
    """The plan for an object that exists at ``version``: ``live`` are the tables it must end up in
    (the active model's first), ``kept`` what they already hold (looked at), ``need`` the rest."""

    step: Step
    version: str
    live: tuple[ModelTable, ...]
    sampling: Sampling
    #: What each live table's rows of this version must carry, by table.
    fingerprints: dict[str, str] = field(hash=False)
    kept: tuple[ModelIndex, ...] = ()
    need: tuple[ModelTable, ...] = ()

    @property
    def searchable(self) -> bool:
        """Whether the active model's rows hold this version already (only other tables are needed)."""
        return all(t.table != self.live[0].table for t in self.need)

    @property
    def optional(self) -> frozenset[str]:
        """Tables whose model may fail to embed without failing the job: the active model's rows never
        wait on a target's (the backfill comes back for it). None when the active one isn't needed."""
        if self.searchable:
            return frozenset()
        return frozenset(t.table for t in self.need if t.table != self.live[0].table)

    def holds(self, table: ModelTable) -> bool:
        """Whether live ``table`` holds this content already (its rows looked at: among ``kept``)."""
        return any(k.table == table.table for k in self.kept)

    def written(self, rows: Mapping[str, int]) -> tuple[ModelIndex, ...]:
        """The entries of the needed tables among ``rows`` (those embedded or read), with their row counts."""
        return tuple(self.entry(t, rows[t.table]) for t in self.need if t.table in rows)

    def entry(self, table: ModelTable, rows: int) -> ModelIndex:
        """The entry saying live ``table`` holds ``rows`` rows of this version."""
        return ModelIndex(table.table, table.model, self.fingerprints[table.table], rows, self.sampling)

    def models_moved(self, fresh: Sequence[ModelTable], held: Collection[str]) -> bool:
        """Whether the live tables read afresh (``fresh``) forbid settling with entries for ``held``: a
        table added since ``live`` was read and not held (a backfill begun meanwhile, which waits for
        this claimed row), or an active table not held (a switch may have made a left-out target active)."""
        return any(t not in self.live for t in fresh if t.table not in held) or fresh[0].table not in held

    @staticmethod
    def twin_finished(now: VideoRecord | None, written: Sequence[ModelIndex]) -> bool:
        """Whether ``now`` is indexed and says each table of ``written`` holds those rows: a job of the
        same content settled first (its rows equal these)."""
        if now is None or now.status is not VideoStatus.INDEXED:
            return False
        return all((e := now.index_in(i.table)) is not None and e.fingerprint == i.fingerprint for i in written)

    def indexes(self, written: Sequence[ModelIndex]) -> tuple[ModelIndex, ...]:
        """The row's entries once ``written`` are in: the kept ones and those, in the order of ``live``."""
        order = [t.table for t in self.live]
        return tuple(sorted([*self.kept, *written], key=lambda i: order.index(i.table)))


def fingerprints(version: str, live: Sequence[ModelTable], sampling: Sampling) -> dict[str, str]:
    """What each live table's rows of ``version`` carry, by table (a text table's: its pipeline's)."""
    return {t.table: _fingerprint(version, t, sampling) for t in live}


def _fingerprint(version: str, table: ModelTable, sampling: Sampling) -> str:
    if table.pipeline is not None:
        return text_fingerprint(version, table.pipeline)
    return fingerprint(version, table.model, sampling)


def claims(
    seen: VideoRecord | None, version: str, live: Sequence[ModelTable], sampling: Sampling
) -> tuple[ModelIndex, ...]:
    """The entries of ``seen`` saying a live table holds exactly this content, model and sampling:
    trusted only once the rows are looked at (a job that lost a race may have written over them)."""
    if seen is None:
        return ()
    fps = fingerprints(version, live, sampling)
    entries = (seen.index_in(t.table) for t in live)
    return tuple(e for e in entries if e is not None and e.fingerprint == fps[e.table])


def plan_index(
    seen: VideoRecord | None,
    version: str,
    live: Sequence[ModelTable],
    sampling: Sampling,
    *,
    holding: Collection[str],
    settle: bool,
    deferred: Collection[str] = (),
) -> IndexPlan:
    """The plan for an object at ``version``, from the row as read (``seen``), the live tables (the
    active model's first) and the tables among ``claims`` whose rows were looked at and hold them.
    ``settle``: the job must write the row even when nothing changed (a `queued` mark may be in flight).
    ``deferred``: live tables another job fills (an index job leaves the text table to the text job,
    a text job the frames tables to the index job): kept when they hold this content, never needed.

    Raises:
        ValueError: no live table.
    """
    if not live:
        raise ValueError("a video is indexed into at least one table")
    kept = tuple(e for e in claims(seen, version, live, sampling) if e.table in holding)
    need = tuple(t for t in live if t.table not in {k.table for k in kept} and t.table not in deferred)
    fps = fingerprints(version, live, sampling)
    base = IndexPlan(Step.EMBED, version, tuple(live), sampling, fps, kept, need)
    if seen is None or need:
        return base
    settled = seen.status is VideoStatus.INDEXED and seen.version == version
    return IndexPlan(Step.CONFIRM if settle or not settled else Step.LEAVE, version, tuple(live), sampling, fps, kept)


def plan_removal(seen: VideoRecord | None, rows: int, *, settle: bool) -> Step:
    """The plan for an object that is gone, from the row as read and the video's ``rows`` in the live tables."""
    if rows == 0 and (seen is None or seen.status is VideoStatus.DELETED):
        return Step.SETTLE_REMOVED if settle else Step.LEAVE
    return Step.REMOVE


def count_crashes(seen: VideoRecord | None, attempt: Attempt | None, holder: str, alive: Callable[[str], bool]) -> int:
    """Times this task's consumer died while holding the video, this start included: a claim of this
    task left ``indexing`` by a process that no longer runs (``alive`` says) is one more, unless it was
    an earlier attempt (that start ended in a retry, and its process may have been scaled down since).
    ``holder`` is this process."""
    if attempt is None or seen is None or seen.task_id != attempt.task_id:
        return 0
    if seen.status is not VideoStatus.INDEXING or seen.holder is None:
        return seen.crashes
    if seen.attempt is not None and seen.attempt < attempt.number:
        return seen.crashes  # that start raised and the task queue retried it: not a death
    if seen.holder == holder:
        return seen.crashes  # this process is alive: a retry or a redelivery, not a crash
    return seen.crashes if alive(seen.holder) else seen.crashes + 1


def stale_words(seen: VideoRecord | None, text: ModelTable, version: str, wordless: bool) -> bool:
    """Whether an index job's write must clear the video's words from the text table: the row names some
    (of another version), or the row is of another version (a text job of it may have written words it
    never settled); and for a video no source may read (``wordless``: it settles "no words" itself), any
    row a start of this version claimed before (its write failed after a claim that kept the old words).
    A first index of a video has none."""
    if seen is None:
        return False
    other = seen.index_in(text.table) is not None or (seen.version is not None and seen.version != version)
    return other or (wordless and seen.version is not None)
