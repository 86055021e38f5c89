"""A text job (``JobSource.TEXT``), one round of it: read the object's words into the text table once the
video's frames are in at the object's version (``WordsJob``); and the text table as a frames job sees it,
deferred to the text job (``DeferredWords``). ``pipeline.index.indexer`` runs the round (read, HEAD,
plan, claim, act, settle) and picks the kind; docs/design/text.md says why words follow the frames.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from events.jobs import IndexJob
from pipeline.index.clock import StageClock
from pipeline.index.plan import IndexPlan, stale_words
from pipeline.index.settle import Acted, Claim, RowSettler
from pipeline.index.words import WordReader
from pipeline.jobs.videostate import JobRows
from pipeline.media.probe import VideoInfo
from pipeline.text.settings import pipeline_may_read
from storage.catalog import VideoRecord
from storage.models import ModelTable
from storage.s3 import ObjectHead
from storage.texts import TextRow, VideoText

log = logging.getLogger(__name__)


def no_words(job: IndexJob, table: ModelTable) -> VideoText:
    """What removes the video's rows from the text table ``table``."""
    return VideoText(job.video_id, job.uri, "", "", _pipeline(table), rows=[])


def _pipeline(table: ModelTable) -> str:
    """The text pipeline whose words ``table`` holds."""
    return table.pipeline or ""


class DeferredWords:
    """The text table as a frames job sees it (``frames_job.DeferredTable``): the text job fills it."""

    def __init__(self, table: ModelTable) -> None:
        self._table = table

    @property
    def table(self) -> ModelTable:
        return self._table

    def empty(self, info: VideoInfo) -> bool:
        """Whether no text source on here may read a video of these streams."""
        return not pipeline_may_read(_pipeline(self._table), info.audio_tracks, info.subtitle_tracks)

    def stale(self, seen: VideoRecord | None, version: str, empty: bool) -> bool:
        """Whether the frames of ``version`` clear the video's words (``plan.stale_words`` says when)."""
        return stale_words(seen, self._table, version, empty)

    def cleared(self, job: IndexJob) -> VideoText:
        """What removes the video's words from the text table."""
        return no_words(job, self._table)


class WordsJob:
    """One round of the text job of ``job``: ``live`` the models' tables (the active model's first),
    whose rows it leaves to the index job, ``table`` the text table it fills with what ``reader`` reads."""

    #: Its words may join a row another job of its version settled over its claim (``RowSettler.finish``).
    joins = True

    def __init__(
        self, job: IndexJob, live: Sequence[ModelTable], table: ModelTable, reader: WordReader, settler: RowSettler
    ) -> None:
        self._job = job
        self._live = tuple(live)
        self._table = table
        self._reader = reader
        self._settler = settler

    @property
    def tables(self) -> tuple[ModelTable, ...]:
        """The live tables it plans over, the active model's first."""
        return (*self._live, self._table)

    @property
    def deferred(self) -> frozenset[str]:
        """The models' tables: the index job fills them (kept when they hold this content, never needed)."""
        return frozenset(t.table for t in self._live)

    def ready(self, plan: IndexPlan) -> bool:
        """Whether the active model's rows hold the object's version: until they do, the index job that
        settles them asks for the words then (their rows follow the frames' version, never run ahead of it)."""
        return plan.holds(self._live[0])

    def due_later(self, plan: IndexPlan) -> bool:
        """No job follows a text job."""
        return False

    def give_up(self, crashes: int) -> None:
        """The consumer died ``crashes`` times reading this video's words: they settle as none found, so no
        job reads them again at this version."""
        log.warning(
            "%s: the consumer died %d times reading this video's words: settled as none found", self._job.uri, crashes
        )

    def act(
        self,
        head: ObjectHead,
        seen: VideoRecord | None,
        plan: IndexPlan,
        claim: Claim,
        clock: StageClock,
        dirty: JobRows,
    ) -> Acted:
        """The text table's rows of the object's words (none found when the job gave up on them). The row's
        frames and duration stay as the index job settled them."""
        job = self._job
        rows = [] if claim.gave_up else self._read(head, plan, claim, clock, dirty)
        written = plan.written({plan.need[0].table: len(rows)})
        batches = {
            e.table: VideoText(job.video_id, job.uri, head.version, e.fingerprint, _pipeline(self._table), rows)
            for e in written
        }
        return Acted(batches, written, None, frames=plan.kept[0].frames)

    def _read(
        self, head: ObjectHead, plan: IndexPlan, claim: Claim, clock: StageClock, dirty: JobRows
    ) -> list[TextRow]:
        """The object's words as the text table's rows. On a failure the row goes back as it was
        (``RowSettler.release``): the video stays searchable by its frames, and a text job never fails a video."""
        try:
            return self._reader.rows(head, self._job.video_id, clock)
        except BaseException:
            claimed = self._settler.releasable(claim, clock, self._job)
            if claimed is not None and not dirty.rows_changed:
                self._settler.release(claimed, plan, clock)
            raise
