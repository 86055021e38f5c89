"""The middle of an index job: fetch the object, decode its sampled frames once, and embed them with
each model a job writes (``pipeline.index.indexer``), holding one of the process's decode slots."""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from pipeline.index.clock import StageClock
from pipeline.index.objects import ObjectSource
from pipeline.media.decode import open_sampled
from pipeline.media.frames import chunks, thumbnail_jpeg
from pipeline.media.probe import VideoInfo
from pipeline.metrics import Metrics
from pipeline.settings import Settings
from storage.errors import EncoderUnavailable, ModelUnavailable, TransientError
from storage.frames import FrameRow
from storage.ids import frame_id
from storage.models import ModelTable
from storage.s3 import ObjectHead


class FrameEmbedder(Protocol):
    """Anything that turns RGB frames into L2-normalised vectors (the Encoder, or its handle)."""

    @property
    def model_id(self) -> str: ...

    def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]: ...


class Embedders(Protocol):
    """The embedder of each model (the Encoder's handles, or the consumer's own models)."""

    def for_model(self, model_id: str) -> FrameEmbedder: ...


class OneEmbedder:
    """``Embedders`` of a single model (an Indexer built with one embedder)."""

    def __init__(self, embedder: FrameEmbedder) -> None:
        self._embedder = embedder

    def for_model(self, model_id: str) -> FrameEmbedder:
        if model_id != self._embedder.model_id:
            raise TransientError(f"no embedder for model {model_id!r} in this process")
        return self._embedder


log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Embedded:
    """What ``EmbedStage.rows`` read of a video: each table's rows, the duration when known, the stream facts."""

    rows: dict[str, list[FrameRow]]
    duration_s: float | None
    info: VideoInfo


#: Longest a job waits for a decode slot (``serve.consumer_cpu_slots``); then it is retried.
CPU_SLOT_WAIT_S = 600.0


class CpuSlots:
    """The decode-and-embed slots of one process, and how many are taken now: the jobs on their way to
    their frame write (a ``GroupedFrameWriter`` waits for company only while there are some)."""

    def __init__(self, slots: int) -> None:
        self._free = threading.BoundedSemaphore(slots)
        self._lock = threading.Lock()
        self._taken = 0

    @property
    def taken(self) -> int:
        with self._lock:
            return self._taken

    def acquire(self, timeout: float) -> bool:
        if not self._free.acquire(timeout=timeout):
            return False
        with self._lock:
            self._taken += 1
        return True

    def release(self) -> None:
        with self._lock:
            self._taken -= 1
        self._free.release()


class EmbedStage:
    """Fetch, decode and embed for the jobs of one process (``cpu_slots`` decode at once)."""

    def __init__(
        self, settings: Settings, objects: ObjectSource, embedders: Embedders, metrics: Metrics, cpu_slots: CpuSlots
    ) -> None:
        self._settings = settings
        self._objects = objects
        self._embedders = embedders
        self._metrics = metrics
        self._cpu_slots = cpu_slots

    def rows(
        self,
        head: ObjectHead,
        video_id: str,
        tables: Sequence[ModelTable],
        clock: StageClock,
        optional: frozenset[str] = frozenset(),
    ) -> Embedded:
        """Each table's rows of the object's sampled frames (the same frames and thumbnails, each
        model's vectors), the video's duration when known and its stream facts. A table of ``optional`` whose model
        can't embed (the encoder can't load it) is left out instead of failing the job: the model
        being switched to must not hold up the index of the one that answers."""
        with tempfile.TemporaryDirectory(prefix="vidx-") as tmp:
            path = Path(tmp) / "video"
            with clock.stage("fetch"):
                self._objects.download(head, path)
            with self._cpu_slot(clock):
                return self._decode_embed(path, video_id, tables, clock, optional)

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

    def _decode_embed(
        self, path: Path, video_id: str, tables: Sequence[ModelTable], clock: StageClock, optional: frozenset[str]
    ) -> Embedded:
        settings = self._settings
        with clock.stage("decode"):
            info, sampled = open_sampled(
                path,
                settings.sampling.spec,
                settings.limits,
                max_side=settings.sampling.decode_max_side,
                strategy=settings.sampling.decode_strategy,
                threads=settings.sampling.decode_threads,
            )
        frames = clock.timed("decode", sampled)
        embedders = [(t.table, self._embedders.for_model(t.model)) for t in tables]
        rows: dict[str, list[FrameRow]] = {t.table: [] for t in tables}
        last_ts: float | None = None
        for chunk in chunks(frames, settings.sampling.embed_chunk):
            images = [f.rgb for f in chunk]
            vectors = {}
            for table, embedder in list(embedders):
                try:
                    with clock.stage("embed"):
                        vectors[table] = embedder.embed_images(images)
                except (EncoderUnavailable, ModelUnavailable) as exc:
                    if table not in optional:
                        raise
                    log.warning("%s: left out of %s for now (%s); the backfill embeds it later", video_id, table, exc)
                    embedders.remove((table, embedder))
                    del rows[table]
            self._metrics.frames_embedded(len(chunk) * len(embedders))
            with clock.stage("thumbnails"):
                thumbnails = [thumbnail_jpeg(f.rgb, settings.sampling.thumbnail_max_side) for f in chunk]
            for table, _ in embedders:
                rows[table].extend(
                    FrameRow(
                        frame_id=frame_id(video_id, f.index), ts_s=f.ts_s, vector=vectors[table][i], thumbnail=thumb
                    )
                    for i, (f, thumb) in enumerate(zip(chunk, thumbnails, strict=True))
                )
            last_ts = chunk[-1].ts_s
        duration_s = info.duration_s if info.duration_s is not None else last_ts
        return Embedded(rows, duration_s, info)
