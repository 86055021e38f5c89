"""Query side: embed a text or an image with the same model, find nearest frames, merge moments."""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np
from numpy.typing import NDArray
from PIL import Image, ImageOps, UnidentifiedImageError
from pydantic import BaseModel

from pipeline.metrics import Metrics
from pipeline.query.links import MediaSigner, S3Links, media_signer
from pipeline.query.moments import FrameHit, merge_moments
from pipeline.settings import Settings
from storage.errors import InvalidInput, LimitExceeded
from storage.frames import FRAMES, FrameTable
from storage.models import ModelTable
from storage.tables import IndexStore

#: Frames fetched per requested moment: neighbours of one moment collapse into it.
CANDIDATES_PER_MOMENT = 20
MAX_CANDIDATES = 2000
#: Most matching frame times listed per moment (``hits_s``).
MAX_HITS_PER_MOMENT = 50
#: Image formats a query may use. Pillow's other plugins stay off: some hand the file to outside
#: programs (EPS runs Ghostscript) and rarely used decoders are where parser bugs live.
QUERY_IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")


class QueryEncoder(Protocol):
    async def embed_text(self, text: str, model_id: str | None = None) -> NDArray[np.float32]: ...

    async def embed_image(self, rgb: NDArray[np.uint8], model_id: str | None = None) -> NDArray[np.float32]: ...


class ActiveModel(Protocol):
    """Which model answers searches (``pipeline.reindex.lifecycle.LiveModels``)."""

    def active(self) -> ModelTable: ...


class MomentOut(BaseModel):
    video_id: str
    uri: str
    score: float
    start_s: float
    end_s: float
    ts_s: float
    thumbnail_url: str
    video_url: str
    #: The video's length when the catalog knows it, and the times of its frames among the search's
    #: candidates (best first): where else in the video the query matches (the page's timeline strip).
    duration_s: float | None = None
    hits_s: list[float] = []


class SearchResponse(BaseModel):
    results: list[MomentOut]
    took_ms: float
    #: The model that embedded the query and whose table was searched.
    model: str


def decode_query_image(data: bytes, max_bytes: int, max_pixels: int, max_side: int | None = None) -> NDArray[np.uint8]:
    """Decode a query image to upright RGB (turned by its EXIF orientation, as viewers show it: phone
    photos are stored sideways); its size is checked from the header before any pixel is decoded.
    With ``max_side`` it is scaled down to that longest side (a JPEG is decoded at a reduced size
    already), so what goes to the Encoder is small whatever was sent. CPU-bound: call it on a thread.

    Raises:
        LimitExceeded: over the byte or pixel limit (a small file can declare a huge picture).
        InvalidInput: not an image in one of ``QUERY_IMAGE_FORMATS``.
    """
    if len(data) > max_bytes:
        raise LimitExceeded(f"image exceeds max bytes {max_bytes}")
    try:
        image = Image.open(io.BytesIO(data), formats=QUERY_IMAGE_FORMATS)
        # Image.open reads only the header: the pixel count is known before decoding.
        if image.width * image.height > max_pixels:
            raise LimitExceeded(f"image exceeds max pixels {max_pixels} ({image.width}x{image.height})")
        if max_side is not None:
            image.draft("RGB", (max_side, max_side))  # JPEG: decode at 1/2, 1/4 or 1/8 size
        upright = ImageOps.exif_transpose(image)
        if max_side is not None and max(upright.size) > max_side:
            upright.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
        rgb = np.asarray(upright.convert("RGB"), dtype=np.uint8)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise LimitExceeded(f"image exceeds max pixels {max_pixels}") from exc
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as exc:
        raise InvalidInput(f"not a readable image ({', '.join(QUERY_IMAGE_FORMATS)}): {type(exc).__name__}") from exc
    return rgb


class SearchService:
    """Searches the frames table and shapes results as moments with playable links."""

    def __init__(
        self,
        settings: Settings,
        store: IndexStore,
        encoder: QueryEncoder,
        links: S3Links | None = None,
        metrics: Metrics | None = None,
        models: ActiveModel | None = None,
    ) -> None:
        """``models`` says which model answers (by default the configured model's ``frames`` table)."""
        self._settings = settings
        self._decodes = ThreadPoolExecutor(settings.limits.image_decodes_in_flight, thread_name_prefix="image-decode")
        self._models = models
        self._metrics = metrics or Metrics()
        self._store = store
        self._encoder = encoder
        self.links = links or S3Links(settings.s3)
        self._thumbnails: MediaSigner = media_signer(settings)

    async def aclose(self) -> None:
        """Close the signing client (it is reopened if the service is used again)."""
        await self.links.aclose()

    def check_k(self, k: int) -> int:
        if not 1 <= k <= self._settings.limits.max_k:
            raise InvalidInput(f"k must be between 1 and {self._settings.limits.max_k}")
        return k

    @contextlib.asynccontextmanager
    async def _timed(self, kind: str) -> AsyncIterator[float]:
        """Records the search's latency whatever its end: ok, a refused query, or an error."""
        started = time.perf_counter()
        outcome = "error"
        try:
            yield started
            outcome = "ok"
        except (InvalidInput, LimitExceeded):
            outcome = "bad_request"
            raise
        finally:
            self._metrics.search(kind, time.perf_counter() - started, outcome)

    async def search_text(self, q: str, k: int, base_url: str) -> SearchResponse:
        async with self._timed("text") as started:
            return await self._search_text(q, k, base_url, started)

    async def search_image(self, data: bytes, k: int, base_url: str) -> SearchResponse:
        async with self._timed("image") as started:
            return await self._search_image(data, k, base_url, started)

    async def _search_text(self, q: str, k: int, base_url: str, started: float) -> SearchResponse:
        q = q.strip()
        if not q:
            raise InvalidInput("q must not be empty")
        if len(q) > self._settings.limits.max_query_chars:
            raise LimitExceeded(f"q exceeds max length {self._settings.limits.max_query_chars}")
        k = self.check_k(k)
        model = await self._active()
        vector = await self._encoder.embed_text(q, model.model)
        return await self._respond(model, vector, k, base_url, started)

    async def _search_image(self, data: bytes, k: int, base_url: str, started: float) -> SearchResponse:
        limits = self._settings.limits
        k = self.check_k(k)
        # Off the event loop (a 7000x7000 PNG takes about a second), on a pool of a few threads of its
        # own: a decode whose request was cancelled still holds its thread, never another pool's.
        rgb = await asyncio.get_running_loop().run_in_executor(
            self._decodes,
            decode_query_image,
            data,
            limits.max_image_bytes,
            limits.max_image_pixels,
            limits.query_image_max_side,
        )
        model = await self._active()
        vector = await self._encoder.embed_image(rgb, model.model)
        return await self._respond(model, vector, k, base_url, started)

    async def _active(self) -> ModelTable:
        if self._models is None:
            return ModelTable(self._settings.model.id, 0, FRAMES)
        return await asyncio.to_thread(self._models.active)

    def frames(self, model: ModelTable) -> FrameTable:
        return self._store.frames_table(model.table)

    async def _respond(
        self, model: ModelTable, vector: NDArray[np.float32], k: int, base_url: str, started: float
    ) -> SearchResponse:
        limit = min(k * CANDIDATES_PER_MOMENT, MAX_CANDIDATES)
        rows = await asyncio.to_thread(self.frames(model).search, vector, limit, self._settings.index)
        hits = [
            FrameHit(
                frame_id=r["frame_id"],
                video_id=r["video_id"],
                uri=r["uri"],
                ts_s=float(r["ts_s"]),
                score=round(1.0 - float(r["_distance"]), 6),
            )
            for r in rows
        ]
        versions = {r["frame_id"]: r["version"] for r in rows}
        hits_s: dict[str, list[float]] = {}
        for hit in hits:  # best first
            hits_s.setdefault(hit.video_id, []).append(hit.ts_s)
        records = await asyncio.to_thread(self._store.catalog.get_many, {h.video_id for h in hits}) if hits else {}
        durations_s = {vid: r.duration_s for vid, r in records.items() if r.duration_s is not None}
        # Each video's frames were sampled at its own interval (the setting may have changed since).
        samplings = {vid: e.sampling for vid, r in records.items() if (e := r.index_in(model.table)) is not None}
        moments = merge_moments(
            hits, self._settings.sampling.spec, k, durations_s=durations_s, sampling_by_video=samplings
        )
        results: list[MomentOut] = []
        base = base_url.rstrip("/")
        for m in moments:
            bucket, _, key = m.uri.removeprefix("s3://").partition("/")
            link = await self.links.presign_get(bucket, key)
            # The content version is in the link: a video overwritten gets new thumbnail links.
            thumbnail = self._thumbnails.sign(f"/v1/frames/{m.frame_id}/thumbnail", {"v": versions[m.frame_id]})
            results.append(
                MomentOut(
                    video_id=m.video_id,
                    uri=m.uri,
                    score=m.score,
                    start_s=m.start_s,
                    end_s=m.end_s,
                    ts_s=m.ts_s,
                    thumbnail_url=base + thumbnail,
                    # A media fragment makes players start at the best frame.
                    video_url=f"{link}#t={m.ts_s:g}",
                    duration_s=durations_s.get(m.video_id),
                    hits_s=hits_s[m.video_id][:MAX_HITS_PER_MOMENT],
                )
            )
        took_ms = round((time.perf_counter() - started) * 1000, 2)
        return SearchResponse(results=results, took_ms=took_ms, model=model.model)
