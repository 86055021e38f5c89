"""What the Encoder deployment holds (``BatchEncoder``: SigLIP models answering batches of images,
texts and frame chunks) and the ways callers reach it: ``HandleEmbedder(s)`` (consumers' threads),
``HandleQueryEncoder`` (the async API), ``PoolEmbedders`` and ``SerialEmbedder`` (a consumer's own
models in the ``fused`` layout). Every way takes a model id: during a model switch frames are
embedded with both models."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from pipeline.embedding.pool import ModelPool, preload
from pipeline.metrics import Metrics
from pipeline.settings import ModelSettings
from storage.config import S3Settings
from storage.errors import EncoderUnavailable, ModelUnavailable

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from pipeline.embedding.siglip import SiglipEncoder


#: Longest the Encoder's start waits to read which model the index answers with.
ACTIVE_READ_TIMEOUT_S = 10.0


def answers_with(s3: S3Settings | None, model_id: str, timeout_s: float = ACTIVE_READ_TIMEOUT_S) -> bool:
    """Whether the index in ``s3`` answers searches with ``model_id``, or has no model yet. True
    when it can't be read within ``timeout_s``: the configured model is then taken to be the one
    that answers (the read goes on, on a daemon thread, and its answer is dropped)."""
    if s3 is None:
        return True
    from storage.tables import IndexStore

    read: dict[str, Any] = {}

    def active() -> None:
        try:
            read["active"] = IndexStore(s3).models.read().active
        except Exception as exc:  # the store unreachable or the row unreadable
            read["error"] = exc

    thread = threading.Thread(target=active, name="encoder-active-model", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "active" not in read:
        why = read.get("error", f"no answer within {timeout_s:g}s")
        log.warning("could not read the index's active model (%s): the configured model must load", why)
        return True
    return read["active"] is None or read["active"].model == model_id


class BatchEncoder:
    """SigLIP image and text towers of one or more models (the configured one, and during a model
    switch the other), answering batches of callers: each method takes the batch's inputs and, per
    caller, the model id (None: the configured model), and answers each caller in order. The
    Encoder deployment (``pipeline.serve.encoder``) gathers concurrent calls into these batches."""

    def __init__(self, pool: ModelPool, metrics: Metrics) -> None:
        self._pool = pool
        self._metrics = metrics

    @classmethod
    def loaded(cls, model: ModelSettings, s3: S3Settings | None, metrics: Metrics) -> BatchEncoder:
        """The configured model loaded; ``s3``: the index, read once for its active model. The
        configured model must load only if the index answers with it (or has no model yet); another
        one (a backfill's target, a model switched away from) is loaded best effort (``pool.preload``).

        Raises:
            ModelUnavailable: the configured model is required and can't be loaded.
        """
        pool = ModelPool(model)
        preload(pool, model.id, required=answers_with(s3, model.id))
        return cls(pool, metrics)

    @property
    def default(self) -> SiglipEncoder:
        """The configured model (loaded again if the pool dropped it)."""
        return self._pool.get()

    async def info(self, model_id: str | None = None) -> dict[str, Any]:
        """``{"model_id", "dim"}`` of ``model_id`` (None: the configured model), loading it if needed.

        Raises:
            ModelUnavailable: the model can't be loaded.
        """
        encoder = await asyncio.to_thread(self._pool.get, model_id)
        return {"model_id": encoder.model_id, "dim": encoder.dim}

    async def load(self, model_id: str) -> int:
        """Load ``model_id`` ahead of its first embedding; returns its dimension.

        Raises:
            ModelUnavailable: the model can't be loaded.
        """
        encoder = await asyncio.to_thread(self._pool.get, model_id)
        return encoder.dim

    async def embed_chunks(
        self, chunks: list[list[NDArray[np.uint8]]], model_ids: list[str | None] | None = None
    ) -> list[Answer]:
        """Whole chunks of frames, one per caller: one run per model over all its callers' frames (the
        encoder cuts it into batches of ``max_batch_size``), each caller gets its own rows back in order."""
        answers: dict[int, Answer] = {}
        for encoder, callers in await self._groups(model_ids, len(chunks), answers):
            frames = [frame for i in callers for frame in chunks[i]]
            self._metrics.encoder_batch("frames", len(frames))
            vectors = await asyncio.to_thread(encoder.embed_images, frames)
            answers.update(zip(callers, split_rows(vectors, [len(chunks[i]) for i in callers]), strict=True))
        return [answers[i] for i in range(len(chunks))]

    async def embed_images(
        self, images: list[NDArray[np.uint8]], model_ids: list[str | None] | None = None
    ) -> list[Answer]:
        """One image per caller, one run per model."""
        answers: dict[int, Answer] = {}
        for encoder, callers in await self._groups(model_ids, len(images), answers):
            self._metrics.encoder_batch("image", len(callers))
            vectors = await asyncio.to_thread(encoder.embed_images, [images[i] for i in callers])
            answers.update(zip(callers, vectors, strict=True))
        return [answers[i] for i in range(len(images))]

    async def embed_texts(self, texts: list[str], model_ids: list[str | None] | None = None) -> list[Answer]:
        """One text per caller, one run per model."""
        answers: dict[int, Answer] = {}
        for encoder, callers in await self._groups(model_ids, len(texts), answers):
            self._metrics.encoder_batch("text", len(callers))
            vectors = await asyncio.to_thread(encoder.embed_texts, [texts[i] for i in callers])
            answers.update(zip(callers, vectors, strict=True))
        return [answers[i] for i in range(len(texts))]

    async def _groups(
        self, model_ids: list[str | None] | None, n: int, answers: dict[int, Answer]
    ) -> list[tuple[SiglipEncoder, list[int]]]:
        """The batch's callers (indices) grouped by model, with each model loaded. ``model_ids`` is
        None when the batch's callers passed no model id (all of them, or Serve fails the batch).
        The callers of a model that can't be loaded get an ``EmbedFailure`` in ``answers`` (Serve
        would fail every caller of the batch if the body raised: the other model's callers too)."""
        groups: dict[str, list[int]] = {}
        for i, model_id in enumerate(model_ids if model_ids is not None else [None] * n):
            groups.setdefault(model_id or self._pool.default, []).append(i)
        loaded = []
        for model_id, callers in groups.items():
            try:
                loaded.append((await asyncio.to_thread(self._pool.get, model_id), callers))
            except Exception as exc:  # ModelUnavailable, or the load itself failing (memory, files)
                log.warning("model %s can't be loaded: %s", model_id, exc)
                answers.update(dict.fromkeys(callers, EmbedFailure(model_id, f"{type(exc).__name__}: {exc}"[:500])))
        return loaded


@dataclass(frozen=True, slots=True)
class EmbedFailure:
    """The answer to a caller whose model could not be loaded (its handle raises ``EncoderUnavailable``)."""

    model_id: str
    reason: str


#: What an embedding method hands each caller.
Answer = NDArray[np.float32] | EmbedFailure


def _vectors(answer: Any, what: str) -> NDArray[np.float32]:
    """Raises:
    EncoderUnavailable: the Encoder could not load the caller's model.
    """
    if isinstance(answer, EmbedFailure):
        raise EncoderUnavailable(f"the encoder could not load model {answer.model_id!r} for {what}: {answer.reason}")
    vectors: NDArray[np.float32] = answer
    return vectors


def split_rows(vectors: NDArray[np.float32], sizes: Sequence[int]) -> list[NDArray[np.float32]]:
    """``vectors`` cut into consecutive blocks of ``sizes`` rows (a size may be 0)."""
    ends = np.cumsum(sizes)
    return [vectors[end - size : end] for size, end in zip(sizes, ends, strict=True)]


class HandleEmbedder:
    """``FrameEmbedder`` of one model over the Encoder deployment, for synchronous callers (Celery
    threads): one call per chunk, with one deadline; the Encoder batches chunks of other videos with it."""

    def __init__(self, encoder: DeploymentHandle, model_id: str, timeout_s: float = 300.0) -> None:
        self._encoder = encoder
        self._model_id = model_id
        self._timeout_s = timeout_s

    @property
    def model_id(self) -> str:
        return self._model_id

    def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]:
        """Raises:
        EncoderUnavailable: no answer within the deadline, or the Encoder failed.
        """
        response = self._encoder.embed_chunk.remote(list(images), self._model_id)
        try:
            answer = response.result(timeout_s=self._timeout_s)
        except Exception as exc:  # Ray raises actor/timeout errors of many types here
            response.cancel()
            raise EncoderUnavailable(
                f"encoder call failed: {type(exc).__name__} ({len(images)} frames, deadline {self._timeout_s:g}s)"
            ) from exc
        return _vectors(answer, f"{len(images)} frames")


class HandleEmbedders:
    """``Embedders`` (``pipeline.index.extract``) over the Encoder deployment: one ``HandleEmbedder``
    per model id, kept."""

    def __init__(self, encoder: DeploymentHandle, timeout_s: float = 300.0) -> None:
        self._encoder = encoder
        self._timeout_s = timeout_s
        self._embedders: dict[str, HandleEmbedder] = {}
        self._lock = threading.Lock()

    def for_model(self, model_id: str) -> HandleEmbedder:
        with self._lock:
            embedder = self._embedders.get(model_id)
            if embedder is None:
                embedder = self._embedders[model_id] = HandleEmbedder(self._encoder, model_id, self._timeout_s)
            return embedder


class HandleQueryEncoder:
    """``QueryEncoder`` over the Encoder deployment, for the async API; each call bounded in time.
    ``model_id`` None embeds with the Encoder's configured model."""

    def __init__(self, encoder: DeploymentHandle, timeout_s: float) -> None:
        self._encoder = encoder
        self._timeout_s = timeout_s

    async def _call(self, response: Any) -> NDArray[np.float32]:
        try:
            answer = await asyncio.wait_for(response, self._timeout_s)
        except Exception as exc:  # timeouts and Ray's actor/replica errors alike: the encoder is not serving
            raise EncoderUnavailable(f"encoder did not answer: {type(exc).__name__}") from exc
        return _vectors(answer, "a query")

    # The model id is passed even when None: the Encoder's batches need every caller's arguments alike.
    async def embed_text(self, text: str, model_id: str | None = None) -> NDArray[np.float32]:
        return await self._call(self._encoder.embed_text.remote(text, model_id))

    async def embed_image(self, rgb: NDArray[np.uint8], model_id: str | None = None) -> NDArray[np.float32]:
        return await self._call(self._encoder.embed_image.remote(rgb, model_id))


class SerialEmbedder:
    """A ``FrameEmbedder`` the consumer's threads take turns on (the ``fused`` layout's in-process
    model): one forward pass at a time, so threads don't fight over the cores or the GPU."""

    def __init__(self, embedder: SiglipEncoder) -> None:
        self._embedder = embedder
        self._lock = threading.Lock()

    @property
    def model_id(self) -> str:
        return self._embedder.model_id

    def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]:
        with self._lock:
            return self._embedder.embed_images(images)


class PoolEmbedders:
    """``Embedders`` (``pipeline.index.extract``) over the consumer's own models (the ``fused`` layout):
    the threads take turns on one lock across all models, one forward pass at a time as with ``SerialEmbedder``; a model
    is loaded on its first chunk."""

    def __init__(self, pool: ModelPool) -> None:
        self._pool = pool
        self._lock = threading.Lock()  # shared by every model's embedder: one pass at a time in all

    def for_model(self, model_id: str) -> PoolEmbedder:
        return PoolEmbedder(self._pool, model_id, self._lock)


class PoolEmbedder:
    """One model of a ``PoolEmbedders``, loaded on its first chunk."""

    def __init__(self, pool: ModelPool, model_id: str, lock: threading.Lock) -> None:
        self._pool = pool
        self._model_id = model_id
        self._lock = lock

    @property
    def model_id(self) -> str:
        return self._model_id

    def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]:
        """Raises:
        EncoderUnavailable: the model can't be loaded (retried, as with the Encoder: a model out
            of memory or its files away is not the video's fault).
        """
        try:
            model = self._pool.get(self._model_id)  # a load doesn't hold up other models' passes
        except ModelUnavailable as exc:
            raise EncoderUnavailable(f"could not load model {self._model_id!r}: {exc}") from exc
        with self._lock:
            return model.embed_images(images)
