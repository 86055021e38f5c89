"""The index job, without Ray: read the video's row, HEAD the object, then remove its rows, confirm
them, or fetch, decode, embed and replace them — each catalog change a compare-and-set through
``pipeline.jobs.videostate``. docs/design/state-machine.md explains why every interleaving converges.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from events.jobs import IndexJob, JobOp, JobSource
from pipeline.index.clock import StageClock
from pipeline.index.extract import Embedded, Embedders, EmbedStage, FrameEmbedder, OneEmbedder
from pipeline.index.joblog import log_job
from pipeline.index.objects import ObjectSource, S3ObjectSource
from pipeline.index.plan import IndexPlan, Step, claims, count_crashes, plan_index, plan_removal, stale_words
from pipeline.index.result import ConsumerKilled, JobResult, Outcome
from pipeline.index.settle import MAX_CONVERGE_ROUNDS, RowLost, RowSettling
from pipeline.index.words import WordReader
from pipeline.jobs.videostate import Attempt, JobRows, VideoStates, settling
from pipeline.metrics import Metrics
from pipeline.settings import Settings
from pipeline.text.settings import pipeline_may_read
from storage.catalog import VideoRecord
from storage.commits.catalog import CatalogWrites, PendingWrite
from storage.commits.frames import FrameWriter
from storage.errors import PermanentError, TransientError
from storage.frames import FRAMES, FrameRow, VideoFrames
from storage.models import TEXT_MODEL_PREFIX, ModelIndex, ModelTable
from storage.s3 import ObjectHead
from storage.tables import IndexStore
from storage.texts import TextRow, VideoText

log = logging.getLogger(__name__)

#: A step boundary of a job and the job: ``hooks(step, job)`` runs there (tests pause jobs at them).
StepHook = Callable[[str, IndexJob], None]

#: The boundaries, in the order one job can pass them.
STEPS = ("read", "head", "claim", "fetch", "recheck", "write", "written", "finish", "settled", "remove", "removed")


def _no_hook(step: str, job: IndexJob) -> None:
    return None


class Indexer(RowSettling):
    """Runs index and delete jobs against the object store and the index tables."""

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
        hooks: StepHook = _no_hook,
        metrics: Metrics | None = None,
        models: Callable[[], list[ModelTable]] | None = None,
        models_now: Callable[[], list[ModelTable]] | None = None,
        embedders: Embedders | None = None,
        writer_for: Callable[[str], FrameWriter] | None = None,
        text_table: Callable[[], ModelTable | None] | None = None,
        words: WordReader | None = None,
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
        once the video's frames are in at the object's version."""
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
        self._embedding = EmbedStage(
            settings, self._objects, self._embedders, self._metrics, s.consumer_cpu_slots or s.consumer_concurrency
        )

    @property
    def holder(self) -> str:
        return self._holder

    def run(self, job: IndexJob, task_id: str | None = None, attempt: int = 0) -> JobResult:
        """Bring the index of ``job``'s object in line with the object. ``attempt``: the task queue's
        retry count of this start of ``task_id`` (kept in the claim; see ``count_crashes``).

        Raises:
            PermanentError: the object can't be indexed (the catalog says why), or ``ConsumerKilled``.
            TransientError: worth retrying; the catalog still says ``indexing`` (or what it said before).
        """
        started = time.monotonic()
        clock = StageClock()
        started_as = Attempt(task_id, self._holder, attempt) if task_id is not None else None
        dirty = JobRows()
        try:
            for _ in range(MAX_CONVERGE_ROUNDS):
                try:
                    result = self._round(job, started_as, clock, dirty)
                except RowLost as lost:
                    log.info("%s: %s; looking again", job.uri, lost)
                    continue
                break
            else:
                raise TransientError(f"{job.uri} kept changing under the job ({MAX_CONVERGE_ROUNDS} rounds)")
        except Exception as exc:
            if dirty.rows_changed:
                self._unsettle(job, frozenset(dirty.tables), dirty.settle_in_doubt)
            self._metrics.stages(clock.seconds)
            log_job(job, task_id, clock, time.monotonic() - started, error=exc)
            raise
        self._metrics.stages(clock.seconds)
        log_job(job, task_id, clock, time.monotonic() - started, outcome=result.outcome.value, frames=result.frames)
        return replace(result, stages=dict(clock.seconds))

    # -- one round: read, HEAD, plan, act ---------------------------------------------------------
    def _round(self, job: IndexJob, attempt: Attempt | None, clock: StageClock, dirty: JobRows) -> JobResult:
        self._hooks("read", job)
        with clock.stage("catalog"):
            seen = self._states.read(job.video_id)
        self._hooks("head", job)
        with clock.stage("head"):
            head = self._objects.head(job.bucket, job.key)
        if head is None:
            return self._remove(job, seen, clock, dirty)
        if job.op is JobOp.DELETE:
            log.info("delete event for %s but the object exists: indexing it", job.uri)
        return self._index(job, seen, head, attempt, clock, dirty)

    def _remove(self, job: IndexJob, seen: VideoRecord | None, clock: StageClock, dirty: JobRows) -> JobResult:
        with clock.stage("catalog"):
            text = self._text_table()
            live = [*self._models(), *([text] if text is not None else [])]
            rows = sum(self._store.table_for(t.table).count(job.video_id) for t in live)
        step = plan_removal(seen, rows, settle=job.settle)
        if step is not Step.REMOVE:
            if step is Step.SETTLE_REMOVED:
                with clock.stage("catalog"):
                    if self._states.removed(job, seen) is None:
                        raise RowLost("the row changed while it was settled")
            return JobResult(job.video_id, Outcome.UNCHANGED)
        self._hooks("remove", job)
        dirty.rows_changed = True  # from here on (the write may land even if the call fails)
        self._clear_rows(job, live, clock, dirty)
        self._hooks("removed", job)
        with clock.stage("catalog"), settling(dirty):
            if self._states.removed(job, self._states.read(job.video_id)) is None:
                raise RowLost("the row changed while its rows were removed")
        self._hooks("settled", job)
        # A backfill may have begun since ``live`` was read, and a job of it written the video into
        # the new table meanwhile (its claim came before the re-read above, so before this read).
        self._clear_rows(job, [t for t in self._models_now() if t not in live], clock, dirty)
        # An upload may have landed (and its job finished) while the rows were being removed.
        with clock.stage("head"):
            if self._objects.head(job.bucket, job.key) is not None:
                raise RowLost("uploaded again while its rows were removed")
        dirty.rows_changed = False
        return JobResult(job.video_id, Outcome.DELETED)

    def _clear_rows(self, job: IndexJob, tables: Sequence[ModelTable], clock: StageClock, dirty: JobRows) -> None:
        """Remove the video's rows from each of ``tables``."""
        dirty.tables.update(t.table for t in tables)
        with clock.stage("write"):
            for table in tables:
                self._writer_for(table.table).replace(_no_rows(job, table))

    def _index(
        self,
        job: IndexJob,
        seen: VideoRecord | None,
        head: ObjectHead,
        attempt: Attempt | None,
        clock: StageClock,
        dirty: JobRows,
    ) -> JobResult:
        sampling = self._settings.sampling.spec
        # A backfill job reads the lifecycle afresh: on a cache from before the backfill began it
        # would find nothing to add and hold a slot of the backfill's window until resubmitted.
        live = self._models_now() if job.source is JobSource.REINDEX else self._models()
        text = self._text_table()
        words = job.source is JobSource.TEXT
        if words and (text is None or self._words is None):
            # Before any claim: a text job this process can't run (no source on here) leaves the row alone.
            log.info("%s: text job, but this process reads no words (no text source on): nothing to do", job.uri)
            return JobResult(job.video_id, Outcome.UNCHANGED)
        tables = [*live, *([text] if text is not None else [])]
        # An index job leaves the words to a text job; a text job leaves the frames to the index job.
        deferred = {t.table for t in live} if words else {text.table} if text is not None else set()
        holding = self._look(job.video_id, claims(seen, head.version, tables, sampling), clock)
        text_due = text is not None and text.table not in holding
        if words and live[0].table not in holding:
            # The frames are not in at this version (yet): the index job that settles them asks for the
            # words then (their rows follow the frames' version, never run ahead of it).
            return JobResult(job.video_id, Outcome.UNCHANGED)
        plan = plan_index(seen, head.version, tables, sampling, holding=holding, settle=job.settle, deferred=deferred)
        if plan.step is not Step.EMBED:
            if plan.step is Step.CONFIRM and seen is not None:
                self._confirm(seen, plan, clock)
            return JobResult(
                job.video_id, Outcome.UNCHANGED, frames=plan.kept[0].frames, text_due=text_due and not words
            )
        claim, give_up = self._claim(job, seen, plan, attempt, clock)
        # The claim commits (shared with other jobs' writes) while the object is fetched and embedded;
        # its outcome is in before any row is written or the failure recorded.
        self._hooks("fetch", job)
        embedded: dict[str, list[FrameRow]] | dict[str, list[TextRow]]
        wordless = False  # an index job's video that no text source on may read (no text job follows)
        if words and give_up:
            none_found: list[TextRow] = []
            embedded, duration_s = {plan.need[0].table: none_found}, None
        elif words:
            embedded, duration_s = self._read_words(job, head, plan, claim, clock, dirty), None
        else:
            found = self._embed(job, head, plan, claim, clock, dirty)
            embedded, duration_s = found.rows, found.duration_s
            tracks = found.info.audio_tracks, found.info.subtitle_tracks
            wordless = text is not None and text_due and not pipeline_may_read(text.pipeline or "", *tracks)
        if self._claimed(claim, clock, job) is None:
            raise RowLost("the row changed before it was claimed")
        # Overlapping jobs of one key: only one that saw the current version writes.
        self._hooks("recheck", job)
        self._still_at(job, head.version, clock, "the object changed while it was embedded")
        self._hooks("write", job)
        # A new version's frames make the words of the old one stale: they go with this write (the
        # text job reads the new version's), as do words a text job wrote and did not settle.
        due = text is not None and not words and text_due and stale_words(seen, text, plan.version, wordless)
        stale = [text] if due and text is not None else []
        written = self._write(job, head, plan, embedded, clock, dirty, clear=stale)
        if wordless and text is not None:
            # Its words settle as none found with its frames: a text job would fetch it for nothing.
            written = (*written, plan.entry(text, rows=0))
        self._hooks("written", job)
        with settling(dirty):
            self._finish(job, plan, written, duration_s, clock)
        dirty.rows_changed = False
        self._hooks("settled", job)
        # The object may have changed between the check above and the commit, and the job for the
        # new version may already have finished: look once more, so the last writer converges.
        self._still_at(job, head.version, clock, "the object changed while its rows were written")
        frames = plan.kept[0].frames if words else written[0].frames
        return JobResult(job.video_id, Outcome.INDEXED, frames=frames, text_due=text_due and not words and not wordless)

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
        self, job: IndexJob, seen: VideoRecord | None, plan: IndexPlan, attempt: Attempt | None, clock: StageClock
    ) -> tuple[PendingWrite, bool]:
        """Start the claim (``indexing`` this version), unless the consumer keeps dying on the video;
        with it, whether a text job is to give up reading this video's words (its consumer died
        ``max_crashes`` times on them: it settles them as none found, so no job reads them again).

        Raises:
            ConsumerKilled: ``max_crashes`` reached by an index job.
        """
        self._hooks("claim", job)
        with clock.stage("catalog"):
            crashes = count_crashes(seen, attempt, self._holder, self._holder_alive)
            give_up = crashes >= self._settings.serve.max_crashes
            if give_up and job.source is JobSource.TEXT:
                log.warning(
                    "%s: the consumer died %d times reading this video's words: settled as none found", job.uri, crashes
                )
            elif give_up:
                raise ConsumerKilled(
                    f"the consumer died {crashes} times while indexing this video (killed, out of memory or crashed)"
                )
            model, label = plan.live[0].model, plan.sampling.label
            claim = self._states.claim_async(
                job, seen, version=plan.version, model=model, sampling=label, attempt=attempt, crashes=crashes
            )
            return claim, give_up

    def _embed(
        self, job: IndexJob, head: ObjectHead, plan: IndexPlan, claim: PendingWrite, clock: StageClock, dirty: JobRows
    ) -> Embedded:
        """Each needed table's rows (a failing optional one left out), the duration and the stream facts. On a failure
        the claim's outcome is taken first: a permanent one is recorded, and a job that only had to
        add another model's rows puts the row back (``_release``)."""
        try:
            return self._embedding.rows(head, job.video_id, plan.need, clock, plan.optional)
        except PermanentError as exc:
            self._claimed(claim, clock, job, best_effort=True)
            self.record_failure(job, exc.reason, version=head.version)
            raise
        except BaseException:
            claimed = self._claimed(claim, clock, job, best_effort=True)
            if claimed is not None and plan.searchable and not dirty.rows_changed:
                self._release(claimed, plan, clock)
            raise

    def _read_words(
        self, job: IndexJob, head: ObjectHead, plan: IndexPlan, claim: PendingWrite, clock: StageClock, dirty: JobRows
    ) -> dict[str, list[TextRow]]:
        """The text table's rows of the object's words. On a failure the row goes back as it was
        (``_release``): the video stays searchable by its frames, and a text job never fails a video."""
        assert self._words is not None  # a text job without a reader returned before its claim
        table = plan.need[0].table
        try:
            return {table: self._words.rows(head, job.video_id, clock)}
        except BaseException:
            claimed = self._claimed(claim, clock, job, best_effort=True)
            if claimed is not None and not dirty.rows_changed:
                self._release(claimed, plan, clock)
            raise

    def _still_at(self, job: IndexJob, version: str, clock: StageClock, lost: str) -> None:
        with clock.stage("head"):
            current = self._objects.head(job.bucket, job.key)
        if current is None or current.version != version:
            raise RowLost(lost)

    def _write(
        self,
        job: IndexJob,
        head: ObjectHead,
        plan: IndexPlan,
        embedded: dict[str, list[FrameRow]] | dict[str, list[TextRow]],
        clock: StageClock,
        dirty: JobRows,
        clear: Sequence[ModelTable] = (),
    ) -> tuple[ModelIndex, ...]:
        """Replace the video's rows in each embedded table (and remove them from ``clear``); returns
        once the commits holding them succeeded (possibly shared with other jobs), with their entries."""
        written = plan.written({table: len(rows) for table, rows in embedded.items()})
        dirty.rows_changed = True  # from here on (the write may land even if the call fails)
        dirty.tables.update(e.table for e in written)
        dirty.tables.update(t.table for t in clear)
        with clock.stage("write"):
            for e in written:
                rows = embedded[e.table]
                if e.model.startswith(TEXT_MODEL_PREFIX):
                    pipeline = e.model.removeprefix(TEXT_MODEL_PREFIX)
                    texts = [r for r in rows if isinstance(r, TextRow)]
                    video = VideoText(job.video_id, job.uri, head.version, e.fingerprint, pipeline, texts)
                    self._writer_for(e.table).replace(video)
                else:
                    frames = [r for r in rows if isinstance(r, FrameRow)]
                    self._writer_for(e.table).replace(
                        VideoFrames(job.video_id, job.uri, head.version, e.fingerprint, e.model, frames)
                    )
            for table in clear:
                self._writer_for(table.table).replace(_no_rows(job, table))
        return written


def _no_rows(job: IndexJob, table: ModelTable) -> VideoFrames | VideoText:
    """What removes the video's rows from ``table``."""
    if table.pipeline is not None:
        return VideoText(job.video_id, job.uri, "", "", table.pipeline, rows=[])
    return VideoFrames(job.video_id, job.uri, "", "", "", rows=[])
