"""A frames job, one round of it: fetch, decode and embed the object's sampled frames for each live model's
table that needs them. A table another kind of job fills once the frames are in (``DeferredTable``) is
planned over but never filled here: this job says whether it is due, settles it empty when nothing could
fill it, and clears its rows of the video when they have gone stale. ``pipeline.index.indexer`` runs the
round (read, HEAD, plan, claim, act, settle) and picks the kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from events.jobs import IndexJob
from pipeline.index.clock import StageClock
from pipeline.index.extract import Embedded, EmbedStage
from pipeline.index.plan import IndexPlan
from pipeline.index.result import ConsumerKilled
from pipeline.index.settle import Acted, Batch, Claim, RowSettler
from pipeline.jobs.videostate import JobRows
from pipeline.media.probe import VideoInfo
from storage.catalog import VideoRecord
from storage.errors import PermanentError
from storage.frames import VideoFrames
from storage.models import ModelTable
from storage.s3 import ObjectHead


class DeferredTable(Protocol):
    """A live table another kind of job fills once this job's rows are in, as a frames job sees it."""

    @property
    def table(self) -> ModelTable: ...

    def empty(self, info: VideoInfo) -> bool:
        """Whether nothing on here could fill it for a video of these streams (it settles as none found)."""
        ...

    def stale(self, seen: VideoRecord | None, version: str, empty: bool) -> bool:
        """Whether the write of ``version``'s frames must clear the video's rows from it."""
        ...

    def cleared(self, job: IndexJob) -> Batch:
        """What removes the video's rows from it."""
        ...


def no_frames(job: IndexJob) -> VideoFrames:
    """What removes the video's rows from a frames table."""
    return VideoFrames(job.video_id, job.uri, "", "", "", rows=[])


class FramesJob:
    """One round of a frames job of ``job``: ``live`` the models' tables it fills (the active model's
    first), ``deferred`` the table a later job fills (None: none is on)."""

    #: Its entries never join a row another job settled over its claim: it goes round again.
    joins = False

    def __init__(
        self,
        job: IndexJob,
        live: Sequence[ModelTable],
        deferred: DeferredTable | None,
        embedding: EmbedStage,
        settler: RowSettler,
    ) -> None:
        self._job = job
        self._live = tuple(live)
        self._deferred = deferred
        self._embedding = embedding
        self._settler = settler

    @property
    def tables(self) -> tuple[ModelTable, ...]:
        """The live tables it plans over, the active model's first."""
        return self._live if self._deferred is None else (*self._live, self._deferred.table)

    @property
    def deferred(self) -> frozenset[str]:
        """The tables among ``tables`` another job fills: kept when they hold this content, never needed."""
        return frozenset() if self._deferred is None else frozenset({self._deferred.table.table})

    def ready(self, plan: IndexPlan) -> bool:
        """A frames job waits for no other job."""
        return True

    def due_later(self, plan: IndexPlan) -> bool:
        """Whether the deferred table does not hold this content: a later job is to fill it."""
        return self._deferred is not None and not plan.holds(self._deferred.table)

    def give_up(self, crashes: int) -> None:
        """Raises:
        ConsumerKilled: always; the consumer died ``crashes`` times on this video.
        """
        raise ConsumerKilled(
            f"the consumer died {crashes} times while indexing this video (killed, out of memory or crashed)"
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
        """The needed tables' frames of ``head``'s version, and what goes with them into the deferred table:
        the video's rows cleared when stale (a new version's frames make the old version's stale: the later
        job fills the new one's), an entry of none when nothing could fill it."""
        found = self._embedded(head, plan, claim, clock, dirty)
        written = plan.written({table: len(frames) for table, frames in found.rows.items()})
        job = self._job
        batches: dict[str, Batch] = {
            e.table: VideoFrames(job.video_id, job.uri, head.version, e.fingerprint, e.model, found.rows[e.table])
            for e in written
        }
        deferred, due, empty, entries = self._deferred, self.due_later(plan), False, written
        if deferred is not None and due:
            empty = deferred.empty(found.info)
            if deferred.stale(seen, plan.version, empty):
                batches[deferred.table.table] = deferred.cleared(job)
            if empty:
                # It settles as none found with the frames: a later job would fetch the video for nothing.
                entries = (*written, plan.entry(deferred.table, rows=0))
        return Acted(batches, entries, found.duration_s, frames=written[0].frames, due_later=due and not empty)

    def _embedded(self, head: ObjectHead, plan: IndexPlan, claim: Claim, clock: StageClock, dirty: JobRows) -> Embedded:
        """Each needed table's rows (a failing optional one left out), the duration and the stream facts. On
        a failure the claim's outcome is taken first: a permanent one is recorded, and a job that only had to
        add another model's rows puts the row back (``RowSettler.release``)."""
        job = self._job
        try:
            return self._embedding.rows(head, job.video_id, plan.need, clock, plan.optional)
        except PermanentError as exc:
            self._settler.claimed(claim, clock, job, best_effort=True)
            self._settler.record_failure(job, exc.reason, version=head.version, claim=claim)
            raise
        except BaseException:
            claimed = self._settler.releasable(claim, clock, job)
            if claimed is not None and plan.searchable and not dirty.rows_changed:
                self._settler.release(claimed, plan, clock)
            raise
