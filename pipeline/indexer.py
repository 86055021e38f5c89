"""The index job, without Ray: reconcile with the object's current state, fetch, decode, embed, write.

Events are hints: the object is HEADed at processing time. Gone -> its rows are removed. Present with
an index fingerprint (version, model, sampling) already indexed -> no-op. Otherwise its rows are
replaced in one commit. Every outcome is recorded in the catalog.
"""

from __future__ import annotations

import enum
import io
import logging
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np
from numpy.typing import NDArray
from PIL import Image

from pipeline.decode import SampledFrame, probe, sample_frames
from pipeline.errors import PermanentError, TransientError
from pipeline.ids import fingerprint, frame_id
from pipeline.jobs import IndexJob, JobOp
from pipeline.settings import LimitSettings, Settings
from storage.config import S3Settings
from storage.s3 import BlockingObjectStore, ObjectHead
from storage.tables import FrameRow, IndexStore, VideoRecord, VideoStatus
from storage.writer import FrameWriter

log = logging.getLogger(__name__)

T = TypeVar("T")


#: Times one job follows an object that keeps changing under it before retrying later.
MAX_CONVERGE_ROUNDS = 3


class FrameEmbedder(Protocol):
    """Anything that turns RGB frames into L2-normalised vectors (the Encoder, or its handle)."""

    @property
    def model_id(self) -> str: ...

    def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]: ...


class ObjectSource(Protocol):
    """The object store as the indexer sees it (synchronous: jobs run in worker threads)."""

    def head(self, bucket: str, key: str) -> ObjectHead | None: ...

    def download(self, head: ObjectHead, dest: Path) -> int: ...


class S3ObjectSource:
    """``ObjectSource`` over one long-lived aiobotocore client (``BlockingObjectStore``). At most
    ``limits.max_concurrent_downloads`` downloads run at once through one source (one per consumer
    process), each bounded by ``limits.max_bytes``."""

    def __init__(self, s3: S3Settings, limits: LimitSettings) -> None:
        self._store = BlockingObjectStore(s3)
        self._limits = limits
        self._download_slots = threading.BoundedSemaphore(limits.max_concurrent_downloads)

    def head(self, bucket: str, key: str) -> ObjectHead | None:
        return self._store.head(bucket, key)

    def download(self, head: ObjectHead, dest: Path) -> int:
        """Download ``head``'s version to ``dest`` once a download slot is free.

        Raises:
            TransientError: no slot within ``download_slot_wait_s``, or the store's transient errors.
            LimitExceeded: the object is larger than ``max_bytes``.
            PermanentError.
        """
        limits = self._limits
        if not self._download_slots.acquire(timeout=limits.download_slot_wait_s):
            raise TransientError(
                f"no download slot within {limits.download_slot_wait_s:g}s "
                f"(max concurrent downloads {limits.max_concurrent_downloads})"
            )
        try:
            return self._store.download(head, dest, limits.max_bytes)
        finally:
            self._download_slots.release()


class Outcome(enum.StrEnum):
    INDEXED = "indexed"
    UNCHANGED = "unchanged"
    DELETED = "deleted"
    FAILED = "failed"
    SUPERSEDED = "superseded"


@dataclass(frozen=True, slots=True)
class JobResult:
    video_id: str
    outcome: Outcome
    frames: int = 0
    reason: str | None = None
    #: Seconds spent per stage (head, catalog, fetch, decode, embed, thumbnails, write).
    stages: dict[str, float] = field(default_factory=dict, compare=False)


class StageClock:
    """Adds up wall time per pipeline stage of one job."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def timed(self, name: str, items: Iterator[T]) -> Iterator[T]:
        """``items``, with the time spent producing each one counted under ``name``."""
        while True:
            with self.stage(name):
                item = next(items, None)
            if item is None:
                return
            yield item

    def summary(self) -> str:
        return " ".join(f"{k}={v:.2f}s" for k, v in self.seconds.items())


def _chunks(frames: Iterator[SampledFrame], size: int) -> Iterator[list[SampledFrame]]:
    while chunk := list(islice(frames, size)):
        yield chunk


def thumbnail_jpeg(rgb: NDArray[np.uint8], max_side: int) -> bytes:
    image = Image.fromarray(rgb)
    image.thumbnail((max_side, max_side))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=75)
    return out.getvalue()


def mark_queued(store: IndexStore, job: IndexJob) -> None:
    """Record that a job for this object is on the queue, unless that version is already indexed."""
    old = store.get_video(job.video_id)
    if old is None:
        store.insert_video_if_absent(VideoRecord(video_id=job.video_id, uri=job.uri, status=VideoStatus.QUEUED))
    elif not (old.status is VideoStatus.INDEXED and old.version == job.hint_version):
        # Status only: the consumer may be writing this row's version and fingerprint right now.
        store.set_status(job.video_id, VideoStatus.QUEUED)


class Indexer:
    """Runs index and delete jobs against the object store and the index tables."""

    def __init__(
        self,
        settings: Settings,
        embedder: FrameEmbedder,
        store: IndexStore | None = None,
        objects: ObjectSource | None = None,
        writer: FrameWriter | None = None,
    ) -> None:
        """``writer`` replaces a video's frames (a ``GroupedFrameWriter`` shares commits between the
        jobs of one process); by default the store itself, one commit per video."""
        self._settings = settings
        self._embedder = embedder
        self._store = store or IndexStore(settings.s3)
        self._objects = objects or S3ObjectSource(settings.s3, settings.limits)
        self._writer: FrameWriter = writer or self._store

    @property
    def sampling_label(self) -> str:
        return f"every_s={self._settings.sampling.every_s:g}"

    def run(self, job: IndexJob) -> JobResult:
        """Bring the index of ``job``'s object in line with the object.

        Raises:
            PermanentError: the object can't be indexed; the catalog already says why.
            TransientError: worth retrying; the catalog still says ``indexing``.
        """
        started = time.monotonic()
        clock = StageClock()
        with clock.stage("head"):
            head = self._objects.head(job.bucket, job.key)
        if head is not None and job.op is JobOp.DELETE:
            log.info("delete event for %s but the object exists: indexing it", job.uri)
        for _ in range(MAX_CONVERGE_ROUNDS):
            if head is None:
                result = self._remove(job, clock)
                # An upload may have landed (and its job finished) while the rows were being removed.
                with clock.stage("head"):
                    head = self._objects.head(job.bucket, job.key)
                if head is None:
                    break
                log.info("%s was uploaded again while its rows were removed: indexing it", job.uri)
                continue
            result, head = self._index(job, head, clock)
            if result.outcome is not Outcome.SUPERSEDED:
                break
            log.info("%s changed while it was indexed: indexing the new version", job.uri)
        else:
            raise TransientError(f"{job.uri} kept changing while it was indexed")
        log.info(
            "job %s %s -> %s (%d frames) in %.2fs: %s",
            job.op.value,
            job.uri,
            result.outcome.value,
            result.frames,
            time.monotonic() - started,
            clock.summary(),
        )
        return replace(result, stages=dict(clock.seconds))

    def record_failure(self, job: IndexJob, reason: str, version: str | None = None) -> None:
        """Mark ``job``'s video failed with ``reason`` (its old rows, if any, stay searchable), unless
        the catalog already holds a settled outcome (indexed, deleted) of another or unknown version."""
        # A failure of an unknown version (the consumer gave up without reaching the object) never
        # overwrites a settled outcome: another job may have indexed it meanwhile; reconcile finds
        # the video stale if it isn't current.
        self._store.mark_failed(job.video_id, job.uri, reason, version)

    def _remove(self, job: IndexJob, clock: StageClock) -> JobResult:
        with clock.stage("catalog"):
            old = self._store.get_video(job.video_id)
        if old is None or (old.status is VideoStatus.DELETED and old.frames == 0):
            # Never indexed, or already removed: no commit at all.
            return JobResult(job.video_id, Outcome.UNCHANGED)
        with clock.stage("write"):
            self._store.delete_frames(job.video_id)
        old.status = VideoStatus.DELETED
        old.frames = 0
        old.fingerprint = None
        old.error = None
        with clock.stage("catalog"):
            self._store.put_video(old)
        return JobResult(job.video_id, Outcome.DELETED)

    def _index(self, job: IndexJob, head: ObjectHead, clock: StageClock) -> tuple[JobResult, ObjectHead | None]:
        """Index ``head``'s version. SUPERSEDED (with the object's current head) when the object
        changed while it was being embedded: nothing is written then, and the caller goes again."""
        settings = self._settings
        fp = fingerprint(head.version, self._embedder.model_id, settings.sampling.every_s)
        with clock.stage("catalog"):
            old = self._store.get_video(job.video_id)
        if old is not None and old.fingerprint == fp:
            # The rows for this exact content, model and sampling are already written. Status only,
            # and only while the row still holds this fingerprint: a newer version may land meanwhile.
            if old.status is not VideoStatus.INDEXED:
                with clock.stage("catalog"):
                    self._store.set_status(job.video_id, VideoStatus.INDEXED, only_if_fingerprint=fp)
            return JobResult(job.video_id, Outcome.UNCHANGED, frames=old.frames), head
        record = VideoRecord(
            video_id=job.video_id,
            uri=job.uri,
            status=VideoStatus.INDEXING,
            version=head.version,
            model=self._embedder.model_id,
            sampling=self.sampling_label,
            fingerprint=old.fingerprint if old else None,
            frames=old.frames if old else 0,
        )
        with clock.stage("catalog"):
            # Status only: the version and fingerprint are written together once the rows are, so a
            # job that loses a race never leaves its version next to another version's fingerprint.
            if old is None:
                self._store.insert_video_if_absent(record)
            else:
                self._store.set_status(job.video_id, VideoStatus.INDEXING)
        try:
            rows, duration_s = self._embed_object(head, job.video_id, clock)
        except PermanentError as exc:
            self.record_failure(job, exc.reason, version=head.version)
            raise
        # Two jobs for one key may overlap: only the one that saw the current version writes.
        with clock.stage("head"):
            current = self._objects.head(job.bucket, job.key)
        if current is None or current.version != head.version:
            return JobResult(job.video_id, Outcome.SUPERSEDED), current
        # Returns once the commit holding these rows succeeded (possibly shared with other jobs).
        with clock.stage("write"):
            self._writer.replace_frames(
                video_id=job.video_id, uri=job.uri, version=head.version, model=self._embedder.model_id, rows=rows
            )
        record.status = VideoStatus.INDEXED
        record.frames = len(rows)
        record.duration_s = duration_s
        record.fingerprint = fp
        record.error = None
        with clock.stage("catalog"):
            self._store.put_video(record)
        # The object may have changed between the check above and the commit, and the job for the
        # new version may already have finished: look once more, so the last writer converges.
        with clock.stage("head"):
            after = self._objects.head(job.bucket, job.key)
        if after is None or after.version != head.version:
            return JobResult(job.video_id, Outcome.SUPERSEDED), after
        return JobResult(job.video_id, Outcome.INDEXED, frames=len(rows)), head

    def _embed_object(self, head: ObjectHead, video_id: str, clock: StageClock) -> tuple[list[FrameRow], float | None]:
        settings = self._settings
        with tempfile.TemporaryDirectory(prefix="vidx-") as tmp:
            path = Path(tmp) / "video"
            with clock.stage("fetch"):
                self._objects.download(head, path)
            with clock.stage("decode"):
                info = probe(path, settings.limits)
            frames = clock.timed(
                "decode",
                sample_frames(
                    path,
                    settings.sampling.every_s,
                    settings.limits,
                    max_side=settings.sampling.decode_max_side,
                    strategy=settings.sampling.decode_strategy,
                    threads=settings.sampling.decode_threads,
                ),
            )
            rows: list[FrameRow] = []
            for chunk in _chunks(frames, settings.sampling.embed_chunk):
                with clock.stage("embed"):
                    vectors = self._embedder.embed_images([f.rgb for f in chunk])
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
