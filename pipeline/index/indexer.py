"""The jobs of an index consumer, without Ray: one round reads the video's row, HEADs the object, then
removes its rows, or plans, claims the row, acts and settles it — each catalog change a compare-and-set
through ``pipeline.jobs.videostate`` (``RowSettler``). What a job makes is its kind's: a text job reads
words (``WordsJob``), any other job embeds frames (``FramesJob``). docs/design/state-machine.md explains
why every interleaving converges.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from events.jobs import IndexJob, JobOp, JobSource
from pipeline.index.clock import StageClock
from pipeline.index.extract import CpuSlots, Embedders, EmbedStage, FrameEmbedder, OneEmbedder
from pipeline.index.frames_job import FramesJob, no_frames
from pipeline.index.joblog import log_job
from pipeline.index.objects import ObjectSource, S3ObjectSource
from pipeline.index.plan import IndexPlan, Step, claims, count_crashes, plan_index, plan_removal
from pipeline.index.result import STEPS, JobKind, JobResult, Outcome, StepHook, no_hook
from pipeline.index.settle import MAX_CONVERGE_ROUNDS, Acted, Batch, Claim, Fence, RowLost, RowSettler
from pipeline.index.words import WordReader
from pipeline.index.words_job import DeferredWords, WordsJob, no_words
from pipeline.jobs.videostate import Attempt, JobRows, VideoStates, claim_record, settling
from pipeline.metrics import Metrics
from pipeline.settings import Settings
from storage.catalog import VideoRecord
from storage.commits.catalog import CatalogWrites
from storage.commits.frames import FrameWriter
from storage.errors import TransientError
from storage.frames import FRAMES
from storage.models import ModelIndex, ModelTable
from storage.s3 import ObjectHead
from storage.s3_errors import ObjectGone
from storage.tables import IndexStore

log = logging.getLogger(__name__)

__all__ = ["STEPS", "Indexer", "JobResult", "Outcome"]


class Indexer:
    """Runs index, text and delete jobs against the object store and the index tables."""

    def __init__(
        self,
        settings: Settings,
        embedder: FrameEmbedder,
        store: IndexStore | None = None,
        objects: ObjectSource | None = None,
        writer: FrameWriter | None = None,
        *,
        catalog_writes: CatalogWrites | None = None,
        holder: str = "local",
        holder_alive: Callable[[str], bool] = lambda holder: True,
        hooks: StepHook = no_hook,
        metrics: Metrics | None = None,
        models: Callable[[], list[ModelTable]] | None = None,
        models_now: Callable[[], list[ModelTable]] | None = None,
        embedders: Embedders | None = None,
        writer_for: Callable[[str], FrameWriter] | None = None,
        text_table: Callable[[], ModelTable | None] | None = None,
        words: WordReader | None = None,
        cpu_slots: CpuSlots | None = None,
    ) -> None:
        """``writer`` replaces a video's frames (a ``GroupedFrameWriter`` shares commits between the
        jobs of one process; default: one commit per video); ``catalog_writes`` takes the catalog's
        writes (default: one commit each). ``holder`` names this process in the started-marker;
        ``holder_alive`` tells whether another holder's process still runs (a claim it left behind
        while dead counts as a crash). ``models`` gives the frames tables a job writes (the active
        model's, and during a backfill the target's: ``LiveModels.live``; default: ``frames``),
        ``models_now`` the same read afresh before a job settles; ``embedders`` embeds with each
        and ``writer_for`` gives each table's writer (default: ``writer`` for ``frames``). ``text_table``
        gives the text table (None: no text source is on); an index job leaves it to a text job
        (``JobResult.text_due``), and a text job (``JobSource.TEXT``) fills it with what ``words`` reads
        once the video's frames are in at the object's version. ``cpu_slots``: the process's decode slots
        (shared with its frame writers, which wait for company only while some are taken; default: its own,
        ``serve.consumer_cpu_slots``)."""
        self._settings = settings
        self._embedders: Embedders = embedders or OneEmbedder(embedder)
        self._models = models or (lambda: [ModelTable(embedder.model_id, 0, FRAMES)])
        self._models_now = models_now or self._models
        self._store = store or IndexStore(settings.s3)
        self._states = VideoStates(
            self._store.catalog, catalog_writes, write_timeout_s=settings.writer.catalog_write_timeout_s
        )
        self._objects = objects or S3ObjectSource(settings.s3, settings.limits)
        default_writer: FrameWriter = writer or self._store.frames

        def store_writer(name: str) -> FrameWriter:
            return default_writer if name == FRAMES else self._store.table_for(name)

        self._writer_for = writer_for or store_writer
        self._text_table = text_table or (lambda: None)
        self._words = words
        self._holder = holder
        self._holder_alive = holder_alive
        self._hooks = hooks
        self._metrics = metrics or Metrics()
        s = settings.serve
        slots = cpu_slots or CpuSlots(s.consumer_cpu_slots or s.consumer_concurrency)
        self._embedding = EmbedStage(settings, self._objects, self._embedders, self._metrics, slots)
        self._settler = RowSettler(self._states, self._models_now, hooks)

    @property
    def holder(self) -> str:
        return self._holder

    def record_failure(self, job: IndexJob, reason: str, version: str | None = None) -> None:
        """``RowSettler.record_failure``.

        Raises:
            TransientError: the catalog could not be written (the scheduled check finds the row later).
        """
        self._settler.record_failure(job, reason, version)

    def run(
        self, job: IndexJob, task_id: str | None = None, attempt: int = 0, *, redelivered: bool = False
    ) -> JobResult:
        """Bring the index of ``job``'s object in line with the object. ``attempt``: the task queue's
        retry count of this start of ``task_id`` (kept in the claim; see ``count_crashes``);
        ``redelivered``: the broker delivered the task before (an earlier start may have died with it).
        A first start claims the row only if it runs longer than ``serve.claim_after_s``; a retry, a
        redelivery and a second round claim it at once.

        Raises:
            PermanentError: the object can't be indexed (the catalog says why), or ``ConsumerKilled``.
            TransientError: worth retrying; the catalog still says ``indexing`` (or what it said before).
        """
        started = time.monotonic()
        clock = StageClock()
        started_as = Attempt(task_id, self._holder, attempt) if task_id is not None else None
        dirty = JobRows()
        fence = Fence()
        try:
            for n in range(MAX_CONVERGE_ROUNDS):
                at_once = redelivered or attempt > 0 or n > 0
                try:
                    result = self._round(
                        job, started_as, clock, dirty, fence, claim_at_once=at_once, hinted=not at_once
                    )
                except RowLost as lost:
                    log.info("%s: %s; looking again", job.uri, lost)
                    continue
                break
            else:
                raise TransientError(f"{job.uri} kept changing under the job ({MAX_CONVERGE_ROUNDS} rounds)")
        except Exception as exc:
            if dirty.rows_changed:
                self._settler.unsettle(job, frozenset(dirty.tables), dirty.settle_in_doubt)
            self._metrics.stages(clock.seconds)
            log_job(job, task_id, clock, time.monotonic() - started, error=exc)
            raise
        self._metrics.stages(clock.seconds)
        log_job(job, task_id, clock, time.monotonic() - started, outcome=result.outcome.value, frames=result.frames)
        return replace(result, stages=dict(clock.seconds))

    # -- one round: read, HEAD, then remove, or plan, claim, act and settle ----------------------
    def _round(
        self,
        job: IndexJob,
        attempt: Attempt | None,
        clock: StageClock,
        dirty: JobRows,
        fence: Fence,
        *,
        claim_at_once: bool,
        hinted: bool,
    ) -> JobResult:
        """``hinted``: the round may take the object to be at the event's ETag (``IndexJob.hint_etag``) and
        check that with the fetch instead of a HEAD (a first start's first round: a retry, a redelivery or a
        second round HEADs, so a stale hint costs one failed fetch, once)."""
        self._hooks("read", job)
        with clock.stage("catalog"):
            seen = self._states.read(job.video_id)
        job = fence.passed(job, seen)
        self._hooks("head", job)
        head = self._hinted_head(job) if hinted else None
        hinted = head is not None
        if head is None:
            head = self._head(job, clock)
        if head is None:
            return self._remove(job, seen, clock, dirty)
        if job.op is JobOp.DELETE:
            log.info("delete event for %s but the object exists: indexing it", job.uri)
        kind = self._kind(job)
        if kind is None:
            return JobResult(job.video_id, Outcome.UNCHANGED)
        plan = self._plan(kind, job, seen, head.version, clock)
        if hinted and plan.step is not Step.EMBED:
            # Nothing will be fetched to check the event's ETag: look at the object before trusting it.
            self._still_at(job, head.version, clock, "the object is no longer at the event's version")
        if not kind.ready(plan):
            return JobResult(job.video_id, Outcome.UNCHANGED)
        if plan.step is not Step.EMBED:
            if plan.step is Step.CONFIRM and seen is not None:
                self._settler.confirm(seen, plan, clock)
            return JobResult(job.video_id, Outcome.UNCHANGED, frames=plan.kept[0].frames, text_due=kind.due_later(plan))
        claim = self._claim(kind, job, seen, plan, attempt, clock, at_once=claim_at_once)
        # The claim commits (shared with other jobs' writes) while the object is fetched and embedded (or
        # its words read); its outcome is in before any row is written or the failure recorded.
        try:
            self._hooks("fetch", job)
            try:
                acted = kind.act(head, seen, plan, claim, clock, dirty)
            except ObjectGone as exc:
                if not hinted:
                    raise
                # The fetch on the event's ETag found another version, or none: look, and act on that.
                raise RowLost("the object is no longer at the event's version (its fetch said so)") from exc
            self._settle(kind, job, head.version, plan, claim, acted, clock, dirty, hinted=hinted)
        finally:
            # A round that leaves early leaves no claim timer behind: a claim landing after the job left
            # (on a row nothing else changed since) would say ``indexing`` with no job alive.
            claim.skip()
        return JobResult(job.video_id, Outcome.INDEXED, frames=acted.frames, text_due=acted.due_later)

    @staticmethod
    def _hinted_head(job: IndexJob) -> ObjectHead | None:
        """The object as its bucket event described it (ETag and size), when the event gave an ETag to fetch
        on (an upload to an unversioned bucket): the download refuses a size over the limit before it asks,
        and the GET is conditional on the ETag, so the size is that version's."""
        if job.source is not JobSource.EVENT or job.op is not JobOp.INDEX or not job.hint_etag:
            return None
        if job.hint_size is None:
            return None
        return ObjectHead(job.bucket, job.key, job.hint_size, job.hint_etag, None, None, None)

    def _kind(self, job: IndexJob) -> JobKind | None:
        """The round of ``job``'s kind, over the live tables as read now: a text job reads words, any other
        embeds frames (and leaves the words to a text job). None: a text job this process can't run."""
        if job.source is JobSource.TEXT:
            live, text = self._models(), self._text_table()
            if text is None or self._words is None:
                # Before any claim: a text job this process can't run (no source on here) leaves the row alone.
                log.info("%s: text job, but this process reads no words (no text source on): nothing to do", job.uri)
                return None
            return WordsJob(job, live, text, self._words, self._settler)
        # A backfill job reads the lifecycle afresh: on a cache from before the backfill began it
        # would find nothing to add and hold a slot of the backfill's window until resubmitted.
        live = self._models_now() if job.source is JobSource.REINDEX else self._models()
        text = self._text_table()
        return FramesJob(job, live, DeferredWords(text) if text is not None else None, self._embedding, self._settler)

    def _plan(
        self, kind: JobKind, job: IndexJob, seen: VideoRecord | None, version: str, clock: StageClock
    ) -> IndexPlan:
        """The plan over the kind's tables, from the row as read and the rows looked at."""
        sampling = self._settings.sampling.spec
        holding = self._look(job.video_id, claims(seen, version, kind.tables, sampling), clock)
        return plan_index(
            seen, version, kind.tables, sampling, holding=holding, settle=job.settle, deferred=kind.deferred
        )

    def _look(self, video_id: str, entries: Sequence[ModelIndex], clock: StageClock) -> frozenset[str]:
        """The tables of ``entries`` that hold exactly the rows their entry says (looked at, not trusted)."""
        with clock.stage("catalog"):
            return frozenset(e.table for e in entries if self._rows_hold(e, video_id))

    def _rows_hold(self, entry: ModelIndex, video_id: str) -> bool:
        """Whether the entry's table holds exactly its ``frames`` rows of the video, all of its fingerprint."""
        summary = self._store.table_for(entry.table).summary(video_id)
        fps = set(summary.fingerprints)
        return summary.rows == entry.frames and summary.duplicate_ids == 0 and fps <= {entry.fingerprint}

    def _claim(
        self,
        kind: JobKind,
        job: IndexJob,
        seen: VideoRecord | None,
        plan: IndexPlan,
        attempt: Attempt | None,
        clock: StageClock,
        *,
        at_once: bool,
    ) -> Claim:
        """The claim (``indexing`` this version), started now (``at_once``) or once the job has run
        ``serve.claim_after_s`` (``Claim``); once the consumer died ``max_crashes`` times on the video the
        kind gives up first (``JobKind.give_up``: it raises, or the claim says so)."""
        self._hooks("claim", job)
        with clock.stage("catalog"):
            crashes = count_crashes(seen, attempt, self._holder, self._holder_alive)
            gave_up = crashes >= self._settings.serve.max_crashes
            if gave_up:
                kind.give_up(crashes)
            model, label = plan.live[0].model, plan.sampling.label
            record = claim_record(
                job, seen, version=plan.version, model=model, sampling=label, attempt=attempt, crashes=crashes
            )
            # At once where a start of this task may have died holding the video (the crash accounting
            # needs the marker: a retry, a redelivery, a marker of this task on the row), when giving up,
            # and on a round after a lost one (a job without a claim loses to any change of the row).
            mine = seen is not None and attempt is not None and seen.task_id == attempt.task_id
            after_s = 0.0 if at_once or gave_up or mine else self._settings.serve.claim_after_s
            return Claim(self._states.submit_claim, record, seen, after_s=after_s, gave_up=gave_up)

    def _settle(
        self,
        kind: JobKind,
        job: IndexJob,
        version: str,
        plan: IndexPlan,
        claim: Claim,
        acted: Acted,
        clock: StageClock,
        dirty: JobRows,
        *,
        hinted: bool,
    ) -> None:
        """Once the claim landed and the object is still at ``version`` (looked at again, unless the round
        fetched on the event's ETag: ``hinted``), write what the job made and settle the row on it; then
        look at the object once more."""
        # A job this far within ``claim_after_s`` writes no claim: it settles on the row it read.
        claimed = None if claim.skip() else self._settler.claimed(claim, clock, job)
        if claimed is None and not claim.skipped:
            raise RowLost("the row changed before it was claimed")
        self._hooks("embedded", job)
        if not hinted:
            # Overlapping jobs of one key: only one that saw the current version writes.
            self._still_at(job, version, clock, "the object changed while it was embedded")
        # A round on the event's ETag (``hinted``) looks no more before its write: its fetch, conditional on
        # the ETag, was the look. A version written since is found by the look after the settle, and the
        # job goes round (its settle, if it landed, is overwritten by the next round's).
        self._hooks("write", job)
        self._write(acted.batches, clock, dirty)
        self._hooks("written", job)
        with settling(dirty):
            self._settler.finish(job, plan, acted, clock, claim, joins=kind.joins, claimed=claimed)
        dirty.rows_changed = False
        self._hooks("settled", job)
        # The object may have changed between the last look and the commit, and the job for the new version
        # may already have finished: look once more, so the last writer converges.
        self._still_at(job, version, clock, "the object changed while its rows were written")

    def _head(self, job: IndexJob, clock: StageClock) -> ObjectHead | None:
        with clock.stage("head"):
            return self._objects.head(job.bucket, job.key)

    def _still_at(self, job: IndexJob, version: str, clock: StageClock, lost: str) -> None:
        current = self._head(job, clock)
        if current is None or current.version != version:
            raise RowLost(lost)

    def _write(self, batches: Mapping[str, Batch], clock: StageClock, dirty: JobRows) -> None:
        """Replace the video's rows in each table of ``batches``; returns once the commits holding them
        succeeded (possibly shared with other jobs)."""
        dirty.rows_changed = True  # from here on (the write may land even if the call fails)
        dirty.tables.update(batches)
        with clock.stage("write"):
            for table, batch in batches.items():
                self._writer_for(table).replace(batch)

    # -- the object is gone: remove its rows from every live table --------------------------------
    def _remove(self, job: IndexJob, seen: VideoRecord | None, clock: StageClock, dirty: JobRows) -> JobResult:
        with clock.stage("catalog"):
            text = self._text_table()
            models = self._models()
            live = [*models, *([text] if text is not None else [])]
            rows = sum(self._store.table_for(t.table).count(job.video_id) for t in live)
        step = plan_removal(seen, rows, settle=job.settle)
        if step is not Step.REMOVE:
            if step is Step.SETTLE_REMOVED:
                with clock.stage("catalog"):
                    if self._states.removed(job, seen) is None:
                        raise RowLost("the row changed while it was settled")
            return JobResult(job.video_id, Outcome.UNCHANGED)
        self._hooks("remove", job)
        gone: dict[str, Batch] = {t.table: no_frames(job) for t in models}
        if text is not None:
            gone[text.table] = no_words(job, text)
        self._write(gone, clock, dirty)
        self._hooks("removed", job)
        with clock.stage("catalog"), settling(dirty):
            if self._states.removed(job, self._states.read(job.video_id)) is None:
                raise RowLost("the row changed while its rows were removed")
        self._hooks("settled", job)
        # A backfill may have begun since ``live`` was read, and a job of it written the video into
        # the new table meanwhile (its claim came before the re-read above, so before this read).
        self._write({t.table: no_frames(job) for t in self._models_now() if t not in live}, clock, dirty)
        # An upload may have landed (and its job finished) while the rows were being removed.
        with clock.stage("head"):
            if self._objects.head(job.bucket, job.key) is not None:
                raise RowLost("uploaded again while its rows were removed")
        dirty.rows_changed = False
        return JobResult(job.video_id, Outcome.DELETED)
