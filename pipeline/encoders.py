"""The Encoder deployment (SigLIP behind ``@serve.batch`` for images, texts and frame chunks) and the
ways callers reach it: ``HandleEmbedder`` (consumers' threads), ``HandleQueryEncoder`` (the async
API), ``SerialEmbedder`` (a consumer's own model in the ``fused`` layout)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray
from ray import serve
from ray.serve.handle import DeploymentHandle

from pipeline.metrics import Metrics, RayBackend
from pipeline.replica_logs import route_logs_to_replica
from pipeline.settings import ModelSettings
from storage.errors import EncoderUnavailable

if TYPE_CHECKING:
    from pipeline.indexer import FrameEmbedder


@serve.deployment(name="Encoder", max_ongoing_requests=256)
class Encoder:
    """SigLIP image and text towers; concurrent calls are gathered into batches."""

    def __init__(self, model: ModelSettings) -> None:
        from pipeline.embed import SiglipEncoder  # torch is imported only where the model runs

        route_logs_to_replica()
        self._metrics = Metrics(RayBackend())
        self._encoder = SiglipEncoder(model)
        batched: list[tuple[Any, int]] = [
            (self.embed_image, model.max_batch_size),
            (self.embed_text, model.max_batch_size),
            (self.embed_chunk, model.max_batch_chunks),
        ]
        for method, size in batched:  # serve.batch methods are untyped
            method.set_max_batch_size(size)
            method.set_batch_wait_timeout_s(model.batch_wait_timeout_s)

    def info(self) -> dict[str, Any]:
        return {"model_id": self._encoder.model_id, "dim": self._encoder.dim}

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=0.02)
    async def embed_chunk(self, chunks: list[list[NDArray[np.uint8]]]) -> list[NDArray[np.float32]]:
        """Whole chunks of frames, one per caller: one run over all their frames (the encoder cuts
        it into batches of ``max_batch_size``), each caller gets its own rows back in order."""
        frames = [frame for chunk in chunks for frame in chunk]
        self._metrics.encoder_batch("frames", len(frames))
        vectors = await asyncio.to_thread(self._encoder.embed_images, frames)
        return split_rows(vectors, [len(chunk) for chunk in chunks])

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.02)
    async def embed_image(self, images: list[NDArray[np.uint8]]) -> list[NDArray[np.float32]]:
        self._metrics.encoder_batch("image", len(images))
        vectors = await asyncio.to_thread(self._encoder.embed_images, images)
        return list(vectors)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.02)
    async def embed_text(self, texts: list[str]) -> list[NDArray[np.float32]]:
        self._metrics.encoder_batch("text", len(texts))
        vectors = await asyncio.to_thread(self._encoder.embed_texts, texts)
        return list(vectors)


def split_rows(vectors: NDArray[np.float32], sizes: Sequence[int]) -> list[NDArray[np.float32]]:
    """``vectors`` cut into consecutive blocks of ``sizes`` rows (a size may be 0)."""
    ends = np.cumsum(sizes)
    return [vectors[end - size : end] for size, end in zip(sizes, ends, strict=True)]


class HandleEmbedder:
    """``FrameEmbedder`` over the Encoder deployment, for synchronous callers (Celery threads): one
    call per chunk, with one deadline; the Encoder batches chunks of other videos with it."""

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
        response = self._encoder.embed_chunk.remote(list(images))
        try:
            vectors: NDArray[np.float32] = response.result(timeout_s=self._timeout_s)
            return vectors
        except Exception as exc:  # Ray raises actor/timeout errors of many types here
            response.cancel()
            raise EncoderUnavailable(
                f"encoder call failed: {type(exc).__name__} ({len(images)} frames, deadline {self._timeout_s:g}s)"
            ) from exc


class HandleQueryEncoder:
    """``QueryEncoder`` over the Encoder deployment, for the async API; each call bounded in time."""

    def __init__(self, encoder: DeploymentHandle, timeout_s: float) -> None:
        self._encoder = encoder
        self._timeout_s = timeout_s

    async def _call(self, response: Any) -> NDArray[np.float32]:
        try:
            vector: NDArray[np.float32] = await asyncio.wait_for(response, self._timeout_s)
        except Exception as exc:  # timeouts and Ray's actor/replica errors alike: the encoder is not serving
            raise EncoderUnavailable(f"encoder did not answer: {type(exc).__name__}") from exc
        return vector

    async def embed_text(self, text: str) -> NDArray[np.float32]:
        return await self._call(self._encoder.embed_text.remote(text))

    async def embed_image(self, rgb: NDArray[np.uint8]) -> NDArray[np.float32]:
        return await self._call(self._encoder.embed_image.remote(rgb))


class SerialEmbedder:
    """A ``FrameEmbedder`` the consumer's threads take turns on (the ``fused`` layout's in-process
    model): one forward pass at a time, so threads don't fight over the cores or the GPU."""

    def __init__(self, embedder: FrameEmbedder) -> None:
        self._embedder = embedder
        self._lock = threading.Lock()

    @property
    def model_id(self) -> str:
        return self._embedder.model_id

    def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]:
        with self._lock:
            return self._embedder.embed_images(images)
