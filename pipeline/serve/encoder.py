"""The Encoder deployment: Serve's batching in front of one ``BatchEncoder``."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray
from ray import serve

from pipeline.embedding.encoders import Answer, BatchEncoder
from pipeline.metrics import Metrics, RayBackend
from pipeline.serve.logs import route_logs_to_replica
from pipeline.settings import ModelSettings
from storage.config import S3Settings


@serve.deployment(name="Encoder", max_ongoing_requests=256)
class Encoder:
    """Gathers concurrent calls into batches for its ``BatchEncoder``.

    Every embedding method takes the model id as its second argument (None: the configured model).
    Serve's batching hands the callers' arguments to the batch as lists, zipped position by
    position, and fails a batch whose callers passed different numbers of arguments: callers pass
    the model id always (``None`` for the default), positionally or as ``model_id=``.
    """

    def __init__(self, model: ModelSettings, s3: S3Settings | None = None) -> None:
        """``s3``: the index, read once for its active model (``BatchEncoder.loaded``)."""
        route_logs_to_replica()
        self.models = BatchEncoder.loaded(model, s3, Metrics(RayBackend()))
        batched: list[tuple[Any, int]] = [
            (self.embed_image, model.max_batch_size),
            (self.embed_text, model.max_batch_size),
            (self.embed_chunk, model.max_batch_chunks),
        ]
        for method, size in batched:  # serve.batch methods are untyped
            method.set_max_batch_size(size)
            method.set_batch_wait_timeout_s(model.batch_wait_timeout_s)

    async def info(self, model_id: str | None = None) -> dict[str, Any]:
        """Raises:
        ModelUnavailable: the model can't be loaded.
        """
        return await self.models.info(model_id)

    async def load(self, model_id: str) -> int:
        """Raises:
        ModelUnavailable: the model can't be loaded.
        """
        return await self.models.load(model_id)

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=0.02)
    async def embed_chunk(
        self, chunks: list[list[NDArray[np.uint8]]], model_id: list[str | None] | None = None
    ) -> list[Answer]:
        return await self.models.embed_chunks(chunks, model_id)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.02)
    async def embed_image(
        self, images: list[NDArray[np.uint8]], model_id: list[str | None] | None = None
    ) -> list[Answer]:
        return await self.models.embed_images(images, model_id)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.02)
    async def embed_text(self, texts: list[str], model_id: list[str | None] | None = None) -> list[Answer]:
        return await self.models.embed_texts(texts, model_id)
