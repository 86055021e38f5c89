"""How a job writes the video's row around its rows: ``RowSettler`` settles it ``indexed`` on the row as it
stands after the rows were committed (``finish``), confirms rows that already hold (``confirm``), puts it back as it was
when a job that only adds a table fails (``release``), puts it back in flight after a job changed the rows
and left (``unsettle``), records a failure and takes a claim's outcome — every write a compare-and-set
through ``pipeline.jobs.videostate``. Both kinds of job (``pipeline.index.frames_job``,
``pipeline.index.words_job``) and the round that runs them (``pipeline.index.indexer``) share one.
``Fence`` says how long a job that must write the row (``IndexJob.settle``) has to."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from events.jobs import IndexJob
from pipeline.index.clock import StageClock
from pipeline.index.plan import IndexPlan
from pipeline.jobs.videostate import VideoStates
from storage.catalog import IN_FLIGHT, VideoRecord, VideoStatus
from storage.commits.catalog import PendingWrite
from storage.errors import TransientError
from storage.frames import VideoFrames
from storage.models import ModelIndex, ModelTable
from storage.texts import VideoText

log = logging.getLogger(__name__)

#: Rounds one job goes (read, HEAD, act) while other writers keep changing the video under it.
MAX_CONVERGE_ROUNDS = 5

#: What replaces one video's rows in one table (no rows: removes them).
Batch: TypeAlias = VideoFrames | VideoText


class RowLost(Exception):
    """Another writer changed the video's row (or the object) under this round: go around again."""


class Claim:
    """A job's claim of the row (``indexing`` its version) and whether the job gave up on the video (its
    consumer died ``max_crashes`` times on it). The claim is written at once (``after_s`` 0), or once the
    job has run ``after_s`` seconds, or never: a job that reaches its first write sooner skips it
    (``skip``) and settles with one compare-and-set on the row it read (``record`` is what the claim would
    have written, on that row's revision; docs/design/state-machine.md, "The lazy claim"). Written, it
    commits while the job acts."""

    def __init__(
        self,
        write: Callable[[VideoRecord], PendingWrite],
        record: VideoRecord,
        seen: VideoRecord | None,
        *,
        after_s: float = 0.0,
        gave_up: bool = False,
    ) -> None:
        self.record = record
        #: The row as the job read it (None: there was none), which ``record`` was made from.
        self.seen = seen
        self.gave_up = gave_up
        self._write = write
        self._lock = threading.Lock()
        self._pending: PendingWrite | None = None
        self._error: BaseException | None = None
        self._started = self._skipped = False
        self._timer: threading.Timer | None = None
        if after_s <= 0:
            self._started = True
            self._pending = write(record)  # its failure fails the round at once
        else:
            self._timer = threading.Timer(after_s, self._start)
            self._timer.daemon = True
            self._timer.start()

    def _start(self) -> None:
        with self._lock:
            if self._started or self._skipped:
                return
            self._started = True
            try:
                self._pending = self._write(self.record)
            except BaseException as exc:  # on the timer's thread: kept for the job to take (``outcome``)
                self._error = exc

    def skip(self) -> bool:
        """Whether the claim is never written: it had not started, and now never will."""
        with self._lock:
            if not self._started:
                self._skipped = True
                if self._timer is not None:
                    self._timer.cancel()
            return self._skipped

    @property
    def skipped(self) -> bool:
        """Whether ``skip`` was called before the claim was written."""
        with self._lock:
            return self._skipped

    def outcome(self, wait: Callable[[PendingWrite], VideoRecord | None]) -> VideoRecord | None:
        """The written claim's outcome (``skip`` said it was written).

        Raises:
            TransientError: its write could not be started.
        """
        if self._error is not None or self._pending is None:
            if isinstance(self._error, TransientError):
                raise self._error
            raise TransientError(f"the claim could not be written: {type(self._error).__name__}") from self._error
        return wait(self._pending)


@dataclass(frozen=True, slots=True)
class Acted:
    """What a job made of the object: the batches to write, by table, in the order they are written; the
    entries the row is settled with (a table may have an entry and no batch); the video's duration when
    known; the row count its result reports; and whether a table it left to a later job is due."""

    batches: Mapping[str, Batch]
    entries: tuple[ModelIndex, ...]
    duration_s: float | None
    frames: int
    due_later: bool = False


@dataclass(slots=True)
class Fence:
    """What a job that must write the row (``IndexJob.settle``: a redelivery, a retry, a job behind a
    `queued` mark) writes it for: the mark (made from a row read, or a catalog version taken, before the
    submit) and any write an earlier start gave up on before this one first read the row are
    compare-and-sets on a revision no newer than the one the job's first round read (a read sees a
    version no older than the latest when it began; revisions only grow). Once a later round reads a
    newer revision, the row has moved past them all and none can land any more: the job then treats
    the row like any other job, and leaves one it finds settled as it is (docs/design/state-machine.md
    says what this gives up). Without this every redelivery of a video (a dropped broker connection
    hands each unacknowledged task out again) rewrites the row at once, one wins a round, the others go
    round again, and they run out of rounds (the nemesis saw 42 s of such rounds, then retries)."""

    #: The revision the first round read (0: no row); None before it.
    first_rev: int | None = None

    def passed(self, job: IndexJob, seen: VideoRecord | None) -> IndexJob:
        """``job`` as this round runs it, from the row it read (``seen``)."""
        rev = seen.rev if seen is not None else 0
        if self.first_rev is None:
            self.first_rev = rev
        elif job.settle and rev > self.first_rev:
            return job.model_copy(update={"settle": False})
        return job


class RowSettler:
    """The row writes of a job (see the module docstring), over the row states, the live tables read
    afresh (``models_now``) and the jobs' step hooks (``finish`` runs right before a settling write)."""

    def __init__(
        self,
        states: VideoStates,
        models_now: Callable[[], list[ModelTable]],
        hooks: Callable[[str, IndexJob], None],
    ) -> None:
        self._states = states
        self._models_now = models_now
        self._hooks = hooks

    def record_failure(
        self, job: IndexJob, reason: str, version: str | None = None, claim: Claim | None = None
    ) -> None:
        """Mark ``job``'s video failed with ``reason`` (its old rows, if any, stay searchable), unless
        the catalog holds a settled outcome (indexed, deleted) of another or unknown version. A job
        that skipped its ``claim`` fails the row as the claim would have left it (its version's failure
        over an older version's settled row), if the row is still as the job read it.

        Raises:
            TransientError: the catalog could not be written (the scheduled check finds the row later).
        """
        if claim is not None and claim.skipped and self._states.fail(job, claim.record, reason, version) is not None:
            return
        for _ in range(MAX_CONVERGE_ROUNDS):
            if self._states.fail(job, self._states.read(job.video_id), reason, version) is not None:
                return
        raise TransientError(f"could not record the failure of {job.uri}: the row kept changing")

    def unsettle(self, job: IndexJob, touched: frozenset[str], in_doubt: str | None = None) -> None:
        """This job changed the video's rows and is leaving before it settled the row, which may now
        disagree with them: put it back in flight (best effort), so a retry, or the scheduled check
        past its grace, redoes the video (if even this write fails, the check's walk finds the
        mismatch). Only the entries of the tables in ``touched`` go (a failed backfill job keeps the
        active model's entry)."""
        try:
            seen = self._states.read(job.video_id)
            if seen is not None and in_doubt is not None and seen.write_id == in_doubt:
                # The settle whose outcome was in doubt landed after all (a slow or frozen writer):
                # the row says what this job did to the rows; unsettling it would undo a landed write.
                log.info("%s: its settle landed late; the row stays as it wrote it", job.uri)
                return
            self._states.unsettle(job, seen, touched)
        except TransientError as exc:
            log.warning("%s: could not mark the row unsettled (%s); the scheduled check will find it", job.uri, exc)

    def confirm(self, seen: VideoRecord, plan: IndexPlan, clock: StageClock) -> None:
        """Settle ``seen`` ``indexed`` with what the plan kept (looked at: they hold this content)."""
        # The row's own count is the active table's (a row a failed write unsettled says -1).
        # A live table's entry whose rows don't hold this content goes (the text table's, whose words
        # a text job reads next); entries of other tables stay as they were.
        live, held = {t.table for t in plan.live}, {k.table for k in plan.kept}
        indexes = tuple(e for e in seen.indexes if e.table in held or e.table not in live)
        row = seen.evolve(fingerprint=plan.kept[0].fingerprint, frames=plan.kept[0].frames, indexes=indexes)
        with clock.stage("catalog"):
            if self._states.confirm(row, plan.version) is None:
                raise RowLost("the row changed while it was confirmed")

    def finish(
        self,
        job: IndexJob,
        plan: IndexPlan,
        acted: Acted,
        clock: StageClock,
        claim: Claim,
        *,
        joins: bool,
        claimed: VideoRecord | None = None,
    ) -> None:
        """Settle the row ``indexed`` with the entries of every live table, on the row as it stands after
        the rows were committed: the row the claim wrote (``claimed``, its outcome), or, when the job
        skipped its claim, the very row the job read before it (not changed since: the settle is then the
        job's one catalog write). ``joins``: the job's entries may join a row another job of its version settled
        over its claim with the entries the plan kept (a job that fills a deferred table).

        The settle is tried first on the row the job last knew (``claimed``, or the skipped claim's
        ``record``), without reading the row: a compare-and-set on its revision lands only where the row
        has not changed since, and then a read would have found that very row. Only a settle that lost
        reads the row and goes the long way (the row moved: a twin, a join, or lost)."""
        written = acted.entries
        indexes = plan.indexes(written)
        with clock.stage("catalog"):
            # Settle only with the tables live now (``models_moved`` says why).
            if plan.models_moved(self._models_now(), {e.table for e in indexes}):
                raise RowLost("the live models changed while the video was embedded")
            known = claim.record if claim.skipped else claimed
            if known is not None and self._finish_on(job, known, plan, acted, indexes) is not None:
                return
            now = self._states.read(job.video_id)
            if claim.skipped and (now.rev if now is not None else 0) == claim.record.rev:
                # A job that wrote no claim, on the very row it read before it looked at the rows: no
                # shortcut below applies to it (a settled row it found not holding them is rewritten,
                # not trusted). As the claim would have left it (version, model, sampling, marker), settled.
                now = claim.record
            elif plan.twin_finished(now, written):
                return  # a twin job of the same content finished after this one began: its rows equal these
            elif joins and now is not None and _settled_holding(now, plan):
                self._join(job, now, plan, written)  # another job settled it meanwhile, as this one kept it
                return
            elif claim.skipped:
                raise RowLost("the row changed while the job ran (it wrote no claim)")
            elif now is None or now.status not in IN_FLIGHT or now.version not in (plan.version, None):
                raise RowLost(f"another job moved the row to {now.status.value if now else 'nothing'} meanwhile")
            if self._finish_on(job, now, plan, acted, indexes) is None:
                raise RowLost("the row changed while it was finished")

    def _finish_on(
        self, job: IndexJob, now: VideoRecord, plan: IndexPlan, acted: Acted, indexes: tuple[ModelIndex, ...]
    ) -> VideoRecord | None:
        """``indexed`` with ``indexes``, compare-and-set on ``now``; None when another write got there first."""
        self._hooks("finish", job)
        first = indexes[0]
        duration_s = acted.duration_s
        if duration_s is None:
            duration_s = now.duration_s  # a job that measured none: the one that settled the frames did
        return self._states.finish(
            now,
            version=plan.version,
            fingerprint=first.fingerprint,
            frames=first.frames,
            duration_s=duration_s,
            indexes=indexes,
        )

    def _join(self, job: IndexJob, now: VideoRecord, plan: IndexPlan, written: Sequence[ModelIndex]) -> None:
        """Another job of this version settled the row over this one's claim (a redelivered index job's
        confirm, a backfill job), leaving the entries this job read: its entries join them rather than
        the table being read again."""
        self._hooks("finish", job)
        merged = _merged(now.indexes, written, plan)
        fp, frames = now.fingerprint or "", now.frames
        joined = self._states.finish(
            now, version=plan.version, fingerprint=fp, frames=frames, duration_s=now.duration_s, indexes=merged
        )
        if joined is None:
            raise RowLost("the row changed while the words joined it")

    def release(self, claimed: VideoRecord, plan: IndexPlan, clock: StageClock) -> None:
        """A job that only had to add another table's rows (a backfill job, a job filling a deferred table)
        failed before writing any: the row goes back to indexed with what the active model's rows hold,
        checked by this job, not left claimed to end up ``failed``; unless a switch made another table
        active meanwhile."""
        active = plan.live[0]
        with clock.stage("catalog"):
            try:
                if self._models_now()[0].table != active.table:
                    return
                entry = next(k for k in plan.kept if k.table == active.table)
                # As ``confirm``: the held live tables' entries, and other tables' as they were.
                live = {t.table for t in plan.live}
                kept = plan.kept + tuple(e for e in claimed.indexes if e.table not in live)
                settled = claimed.evolve(fingerprint=entry.fingerprint, frames=entry.frames, indexes=kept)
                self._states.confirm(settled, plan.version)
            except TransientError as exc:  # left claimed: the retry (or the check past its grace) settles it
                log.warning("%s: could not put the row back to indexed (%s)", claimed.uri, exc)

    def releasable(self, claim: Claim, clock: StageClock, job: IndexJob) -> VideoRecord | None:
        """The row a job leaving on a failure before it wrote any rows may put back (``release``): its
        claim's outcome; or, when it wrote no claim, the row as it read it if an earlier start left that
        in flight (a row the job never changed and found settled stays as it is: None)."""
        claimed = self.claimed(claim, clock, job, best_effort=True)
        if claimed is None and claim.skipped and claim.seen is not None and claim.seen.status in IN_FLIGHT:
            return claim.record
        return claimed

    def claimed(
        self, claim: Claim, clock: StageClock, job: IndexJob, *, best_effort: bool = False
    ) -> VideoRecord | None:
        """The claim's outcome; None when it lost, or was never written (``Claim.skip``: now it never
        will be). ``best_effort`` (the job is leaving anyway): a failed claim write is only logged."""
        if claim.skip():
            return None  # never written: the row is as the job read it
        with clock.stage("catalog"):
            try:
                return claim.outcome(self._states.wait)
            except TransientError as exc:
                if not best_effort:
                    raise
                log.warning("%s: the claim's write failed (%s)", job.uri, exc)
                return None


def _merged(entries: Sequence[ModelIndex], written: Sequence[ModelIndex], plan: IndexPlan) -> tuple[ModelIndex, ...]:
    """``entries`` with those of ``written`` put in (replacing any of their tables), in the order of the
    plan's live tables (the active model's first), other tables' after."""
    order = [t.table for t in plan.live]
    ours = {w.table for w in written}
    both = [*(e for e in entries if e.table not in ours), *written]
    return tuple(sorted(both, key=lambda e: order.index(e.table) if e.table in order else len(order)))


def _settled_holding(now: VideoRecord, plan: IndexPlan) -> bool:
    """Whether ``now`` is settled at the plan's version with every entry the plan kept, as it kept them."""
    if now.status is not VideoStatus.INDEXED or now.version != plan.version:
        return False
    return all(now.index_in(k.table) == k for k in plan.kept)
