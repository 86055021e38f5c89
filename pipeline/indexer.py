"""The index job, without Ray: read the video's row, HEAD the object, then remove its rows, confirm
them, or fetch, decode, embed and replace them — each catalog change a compare-and-set through
``pipeline.videostate``. docs/architecture.md explains why every interleaving converges.
"""

from __future__ import annotations

import enum
import logging
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from events.jobs import IndexJob, JobOp
from pipeline.decode import open_sampled
from pipeline.joblog import log_job
from pipeline.metrics import Metrics
from pipeline.objects import ObjectSource, S3ObjectSource
from pipeline.settings import Settings
from pipeline.stages import StageClock, chunks, thumbnail_jpeg
from pipeline.videostate import Attempt, VideoStates
from storage.catalog import IN_FLIGHT, VideoRecord, VideoStatus
from storage.catalog_writer import CatalogWrites, PendingWrite
from storage.errors import PermanentError, TransientError
from storage.frames import FrameRow, VideoFrames
from storage.ids import fingerprint, frame_id
from storage.s3 import ObjectHead
from storage.tables import IndexStore
from storage.writer import FrameWriter

log = logging.getLogger(__name__)

#: Rounds one job goes (read, HEAD, act) while other writers keep changing the video under it.
MAX_CONVERGE_ROUNDS = 5

#: Longest a job waits for a decode slot (``serve.consumer_cpu_slots``); then it is retried.
CPU_SLOT_WAIT_S = 600.0

#: A step boundary of a job and the job: ``hooks(step, job)`` runs there (tests pause jobs at them).
StepHook = Callable[[str, IndexJob], None]

#: The boundaries, in the order one job can pass them.
STEPS = ("read", "head", "claim", "fetch", "recheck", "write", "written", "finish", "settled", "remove", "removed")


def _no_hook(step: str, job: IndexJob) -> None:
    return None


class ConsumerKilled(PermanentError):
    """Raised when a job's consumer died while holding it ``max_crashes`` times: the video itself
    (a decoder crash, memory) is the likely cause, so it is failed instead of tried forever."""


class FrameEmbedder(Protocol):
    """Anything that turns RGB frames into L2-normalised vectors (the Encoder, or its handle)."""

    @property
    def model_id(self) -> str: ...

    def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]: ...


class Outcome(enum.StrEnum):
    INDEXED = "indexed"
    UNCHANGED = "unchanged"
    DELETED = "deleted"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class JobResult:
    video_id: str
    outcome: Outcome
    frames: int = 0
    reason: str | None = None
    #: Seconds spent per stage (head, catalog, fetch, decode, embed, thumbnails, write).
    stages: dict[str, float] = field(default_factory=dict, compare=False)


@dataclass(slots=True)
class _Dirty:
    """Whether this job changed the video's rows since it last settled the row."""

    rows_changed: bool = False


class _Lost(Exception):
    """Another writer changed the video's row (or the object) under this round: go around again."""


class Indexer:
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
    ) -> None:
        """``writer`` replaces a video's frames (a ``GroupedFrameWriter`` shares commits between the
        jobs of one process); by default the frames table itself, one commit per video;
        ``catalog_writes`` takes the catalog's writes (by default one commit each). ``holder``
        names this consumer process in the started-marker; ``holder_alive`` tells whether another
        holder's process still runs (a claim it left behind while dead counts as a crash); ``metrics``
        gets each job's stage times and the frames embedded."""
        self._settings = settings
        self._embedder = embedder
        self._store = store or IndexStore(settings.s3)
        self._states = VideoStates(
            self._store.catalog, catalog_writes, write_timeout_s=settings.writer.catalog_write_timeout_s
        )
        self._objects = objects or S3ObjectSource(settings.s3, settings.limits)
        self._writer: FrameWriter = writer or self._store.frames
        self._holder = holder
        self._holder_alive = holder_alive
        self._hooks = hooks
        self._metrics = metrics or Metrics()
        s = settings.serve
        self._cpu_slots = threading.BoundedSemaphore(s.consumer_cpu_slots or s.consumer_concurrency)

    @property
    def sampling_label(self) -> str:
        return f"every_s={self._settings.sampling.every_s:g}"

    @property
    def holder(self) -> str:
        return self._holder

    def run(self, job: IndexJob, task_id: str | None = None) -> JobResult:
        """Bring the index of ``job``'s object in line with the object.

        Raises:
            PermanentError: the object can't be indexed (the catalog says why), or ``ConsumerKilled``.
            TransientError: worth retrying; the catalog still says ``indexing`` (or what it said before).
        """
        started = time.monotonic()
        clock = StageClock()
        attempt = Attempt(task_id, self._holder) if task_id is not None else None
        dirty = _Dirty()
        try:
            for _ in range(MAX_CONVERGE_ROUNDS):
                try:
                    result = self._round(job, attempt, clock, dirty)
                except _Lost as lost:
                    log.info("%s: %s; looking again", job.uri, lost)
                    continue
                break
            else:
                raise TransientError(f"{job.uri} kept changing under the job ({MAX_CONVERGE_ROUNDS} rounds)")
        except Exception as exc:
            if dirty.rows_changed:
                self._unsettle(job)
            self._metrics.stages(clock.seconds)
            log_job(job, task_id, clock, time.monotonic() - started, error=exc)
            raise
        self._metrics.stages(clock.seconds)
        log_job(job, task_id, clock, time.monotonic() - started, outcome=result.outcome.value, frames=result.frames)
        return replace(result, stages=dict(clock.seconds))

    def record_failure(self, job: IndexJob, reason: str, version: str | None = None) -> None:
        """Mark ``job``'s video failed with ``reason`` (its old rows, if any, stay searchable), unless
        the catalog holds a settled outcome (indexed, deleted) of another or unknown version.

        Raises:
            TransientError: the catalog could not be written (the scheduled check finds the row later).
        """
        for _ in range(MAX_CONVERGE_ROUNDS):
            if self._states.fail(job, self._states.read(job.video_id), reason, version) is not None:
                return
        raise TransientError(f"could not record the failure of {job.uri}: the row kept changing")

    def _unsettle(self, job: IndexJob) -> None:
        """This job changed the video's rows and is leaving before it settled the row: the row may
        now disagree with the rows, and a settled row is trusted by nobody but is left alone by a
        failure record. Put it back in flight (best effort), so a retry of this task, or the scheduled
        check once the grace has passed, redoes the video; if even this write fails, the check's walk
        finds the rows' mismatch."""
        try:
            seen = self._states.read(job.video_id)
            self._states.unsettle(job, seen)
        except TransientError as exc:
            log.warning("%s: could not mark the row unsettled (%s); the scheduled check will find it", job.uri, exc)

    # -- one round: read, HEAD, act ---------------------------------------------------------------
    def _round(self, job: IndexJob, attempt: Attempt | None, clock: StageClock, dirty: _Dirty) -> JobResult:
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

    def _remove(self, job: IndexJob, seen: VideoRecord | None, clock: StageClock, dirty: _Dirty) -> JobResult:
        with clock.stage("catalog"):
            rows = self._store.frames.count(job.video_id)
        if rows == 0 and (seen is None or seen.status is VideoStatus.DELETED):
            if job.settle:  # a `queued` mark may be in flight: this write makes it lose
                with clock.stage("catalog"):
                    if self._states.removed(job, seen) is None:
                        raise _Lost("the row changed while it was settled")
            return JobResult(job.video_id, Outcome.UNCHANGED)
        self._hooks("remove", job)
        dirty.rows_changed = True  # from here on (the write may land even if the call fails)
        with clock.stage("write"):
            self._writer.replace(VideoFrames(job.video_id, job.uri, "", "", "", rows=[]))
        self._hooks("removed", job)
        with clock.stage("catalog"):
            now = self._states.read(job.video_id)
            if self._states.removed(job, now) is None:
                raise _Lost("the row changed while its rows were removed")
        dirty.rows_changed = False
        self._hooks("settled", job)
        # An upload may have landed (and its job finished) while the rows were being removed.
        with clock.stage("head"):
            if self._objects.head(job.bucket, job.key) is not None:
                raise _Lost("uploaded again while its rows were removed")
        return JobResult(job.video_id, Outcome.DELETED)

    def _rows_hold(self, video_id: str, fp: str, frames: int) -> bool:
        """Whether ``frames`` holds exactly ``frames`` rows of ``video_id``, all of fingerprint ``fp``."""
        summary = self._store.frames.summary(video_id)
        return summary.rows == frames and summary.duplicate_ids == 0 and set(summary.fingerprints) <= {fp}

    def _index(
        self,
        job: IndexJob,
        seen: VideoRecord | None,
        head: ObjectHead,
        attempt: Attempt | None,
        clock: StageClock,
        dirty: _Dirty,
    ) -> JobResult:
        model = self._embedder.model_id
        fp = fingerprint(head.version, model, self._settings.sampling.every_s)
        if seen is not None and seen.fingerprint == fp:
            # The catalog says the rows of this exact content, model and sampling are written: trust
            # it only after looking (a job that lost a race may have written over them).
            with clock.stage("catalog"):
                holds = self._rows_hold(job.video_id, fp, seen.frames)
            if holds:
                settled = seen.status is VideoStatus.INDEXED and seen.version == head.version
                if job.settle or not settled:  # settle: a `queued` mark may be in flight
                    with clock.stage("catalog"):
                        if self._states.confirm(seen, head.version) is None:
                            raise _Lost("the row changed while it was confirmed")
                return JobResult(job.video_id, Outcome.UNCHANGED, frames=seen.frames)
        self._hooks("claim", job)
        with clock.stage("catalog"):
            crashes = self._crashes(seen, attempt)
            if crashes >= self._settings.serve.max_crashes:
                raise ConsumerKilled(
                    f"the consumer died {crashes} times while indexing this video (killed, out of memory or crashed)"
                )
            claim = self._states.claim_async(
                job,
                seen,
                version=head.version,
                model=model,
                sampling=self.sampling_label,
                attempt=attempt,
                crashes=crashes,
            )
        # The claim commits (shared with other jobs' writes) while the object is fetched and embedded;
        # its outcome is in before any row is written or the failure recorded.
        self._hooks("fetch", job)
        try:
            rows, duration_s = self._embed_object(head, job.video_id, clock)
        except PermanentError as exc:
            self._claimed(claim, clock, job, best_effort=True)
            self.record_failure(job, exc.reason, version=head.version)
            raise
        except BaseException:
            self._claimed(claim, clock, job, best_effort=True)
            raise
        if self._claimed(claim, clock, job) is None:
            raise _Lost("the row changed before it was claimed")
        # Overlapping jobs of one key: only one that saw the current version writes.
        self._hooks("recheck", job)
        with clock.stage("head"):
            current = self._objects.head(job.bucket, job.key)
        if current is None or current.version != head.version:
            raise _Lost("the object changed while it was embedded")
        self._hooks("write", job)
        # Returns once the commit holding these rows succeeded (possibly shared with other jobs).
        dirty.rows_changed = True  # from here on (the write may land even if the call fails)
        with clock.stage("write"):
            self._writer.replace(VideoFrames(job.video_id, job.uri, head.version, fp, model, rows))
        self._hooks("written", job)
        with clock.stage("catalog"):
            now = self._states.read(job.video_id)
            if now is not None and now.fingerprint == fp and now.status is VideoStatus.INDEXED:
                pass  # a twin job of the same content finished first: its rows equal these
            elif now is None or now.status not in IN_FLIGHT or now.version not in (head.version, None):
                raise _Lost(f"another job moved the row to {now.status.value if now else 'nothing'} meanwhile")
            else:
                self._hooks("finish", job)
                if (
                    self._states.finish(
                        now, version=head.version, fingerprint=fp, frames=len(rows), duration_s=duration_s
                    )
                    is None
                ):
                    raise _Lost("the row changed while it was finished")
        dirty.rows_changed = False
        self._hooks("settled", job)
        # The object may have changed between the check above and the commit, and the job for the
        # new version may already have finished: look once more, so the last writer converges.
        with clock.stage("head"):
            after = self._objects.head(job.bucket, job.key)
        if after is None or after.version != head.version:
            raise _Lost("the object changed while its rows were written")
        return JobResult(job.video_id, Outcome.INDEXED, frames=len(rows))

    def _claimed(
        self, claim: PendingWrite, clock: StageClock, job: IndexJob, *, best_effort: bool = False
    ) -> VideoRecord | None:
        """The claim's outcome. ``best_effort`` (the job is leaving anyway): a failed claim write is
        only logged."""
        with clock.stage("catalog"):
            try:
                return self._states.wait(claim)
            except TransientError as exc:
                if not best_effort:
                    raise
                log.warning("%s: the claim's write failed (%s)", job.uri, exc)
                return None

    def _crashes(self, seen: VideoRecord | None, attempt: Attempt | None) -> int:
        """Times this task's consumer died while holding the video, this start included: a claim of
        this task left ``indexing`` by a process that no longer runs is one more."""
        if attempt is None or seen is None or seen.task_id != attempt.task_id:
            return 0
        if seen.status is not VideoStatus.INDEXING or seen.holder is None:
            return seen.crashes
        if seen.holder == self._holder:
            return seen.crashes  # this process is alive: a retry or a redelivery, not a crash
        return seen.crashes if self._holder_alive(seen.holder) else seen.crashes + 1

    def _embed_object(self, head: ObjectHead, video_id: str, clock: StageClock) -> tuple[list[FrameRow], float | None]:
        with tempfile.TemporaryDirectory(prefix="vidx-") as tmp:
            path = Path(tmp) / "video"
            with clock.stage("fetch"):
                self._objects.download(head, path)
            with self._cpu_slot(clock):
                return self._decode_embed(path, video_id, clock)

    @contextmanager
    def _cpu_slot(self, clock: StageClock) -> Iterator[None]:
        """One of the process's ``consumer_cpu_slots`` while decoding and embedding (bounded wait)."""
        with clock.stage("cpu_wait"):
            if not self._cpu_slots.acquire(timeout=CPU_SLOT_WAIT_S):
                raise TransientError(f"no decode slot within {CPU_SLOT_WAIT_S:g}s")
        try:
            yield
        finally:
            self._cpu_slots.release()

    def _decode_embed(self, path: Path, video_id: str, clock: StageClock) -> tuple[list[FrameRow], float | None]:
        settings = self._settings
        with clock.stage("decode"):
            info, sampled = open_sampled(
                path,
                settings.sampling.every_s,
                settings.limits,
                max_side=settings.sampling.decode_max_side,
                strategy=settings.sampling.decode_strategy,
                threads=settings.sampling.decode_threads,
            )
        frames = clock.timed("decode", sampled)
        rows: list[FrameRow] = []
        for chunk in chunks(frames, settings.sampling.embed_chunk):
            with clock.stage("embed"):
                vectors = self._embedder.embed_images([f.rgb for f in chunk])
            self._metrics.frames_embedded(len(chunk))
            with clock.stage("thumbnails"):
                rows.extend(
                    FrameRow(
                        frame_id=frame_id(video_id, f.index),
                        ts_s=f.ts_s,
                        vector=vectors[i],
                        thumbnail=thumbnail_jpeg(f.rgb, settings.sampling.thumbnail_max_side),
                    )
                    for i, f in enumerate(chunk)
                )
        duration_s = info.duration_s if info.duration_s is not None else (rows[-1].ts_s if rows else None)
        return rows, duration_s
