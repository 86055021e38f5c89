"""Query side: embed a text or an image with the same model, find nearest frames, merge moments; a text
query also searches the videos' words (the text table's full-text index) and the two lists are fused
(``pipeline.query.hybrid``, ``pipeline.query.terms``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel

from pipeline.metrics import Metrics
from pipeline.query.hybrid import Fused, Ranked, TextMatch, fuse
from pipeline.query.images import decode_query_image
from pipeline.query.links import MediaSigner, S3Links, media_signer
from pipeline.query.moments import FrameHit, Moment, merge_moments
from pipeline.query.terms import VISUAL, TextQuery, parse_query, parse_sources
from pipeline.query.words import MAX_CANDIDATES, current_matches, search_words
from pipeline.settings import Settings
from storage.catalog import VideoRecord
from storage.errors import InvalidInput, LimitExceeded
from storage.frames import FRAMES, FrameTable
from storage.ids import frame_id
from storage.models import ModelTable
from storage.tables import IndexStore
from storage.texts import SOURCES as TEXT_SOURCES
from storage.texts import TextHit

#: Frames fetched per requested moment: neighbours of one moment collapse into it.
CANDIDATES_PER_MOMENT = 20
#: Most matching frame times listed per moment (``hits_s``).
MAX_HITS_PER_MOMENT = 50
#: Segments fetched per requested moment from the words, and moments from the frames, before fusion.
TEXT_CANDIDATES_PER_MOMENT = 3
FUSION_MOMENTS_PER_MOMENT = 3


class QueryEncoder(Protocol):
    async def embed_text(self, text: str, model_id: str | None = None) -> NDArray[np.float32]: ...

    async def embed_image(self, rgb: NDArray[np.uint8], model_id: str | None = None) -> NDArray[np.float32]: ...


class ActiveModel(Protocol):
    """Which model answers searches (``pipeline.reindex.lifecycle.LiveModels``)."""

    def active(self) -> ModelTable: ...

    def text(self) -> ModelTable | None: ...


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
    #: What found the moment: ``visual`` (the frames), and the text sources whose words matched
    #: (``subtitle``, ``ocr``, ``speech``). A search the words took part in scores by reciprocal rank
    #: fusion; one of the frames alone by the best frame's similarity.
    sources: list[str] = [VISUAL]
    #: The matched words: the segment's text, which source it came from, and the [start, end) character
    #: spans of the query's words in it (what the page and the CLI mark).
    text: str | None = None
    text_source: str | None = None
    text_marks: list[tuple[int, int]] = []


class SearchResponse(BaseModel):
    results: list[MomentOut]
    took_ms: float
    #: The model that embedded the query and whose table was searched.
    model: str


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

    async def search_text(self, q: str, k: int, base_url: str, sources: str | None = None) -> SearchResponse:
        """``sources``: ``?sources=`` (comma separated ``visual``, ``subtitle``, ``ocr``, ``speech``; none: all)."""
        async with self._timed("text") as started:
            return await self._search_text(q, k, base_url, started, sources)

    async def search_image(self, data: bytes, k: int, base_url: str) -> SearchResponse:
        async with self._timed("image") as started:
            return await self._search_image(data, k, base_url, started)

    async def _search_text(
        self, q: str, k: int, base_url: str, started: float, sources: str | None = None
    ) -> SearchResponse:
        q = q.strip()
        if not q:
            raise InvalidInput("q must not be empty")
        if len(q) > self._settings.limits.max_query_chars:
            raise LimitExceeded(f"q exceeds max length {self._settings.limits.max_query_chars}")
        k = self.check_k(k)
        try:
            wanted = parse_sources(sources)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc
        query = parse_query(q).bounded(self._settings.limits.max_query_words)
        model = await self._active()
        text = await self._text_table()
        words = sorted(wanted & set(TEXT_SOURCES))
        if text is None or not words or not query.terms:
            if VISUAL not in wanted:
                # Only text sources asked for, and no words are indexed (or the query has none).
                return SearchResponse(results=[], took_ms=_took_ms(started), model=model.model)
            vector = await self._encoder.embed_text(q, model.model)  # as typed: the words take no part
            return await self._respond(model, vector, k, base_url, started)
        visual = await self._encoder.embed_text(query.visual, model.model) if VISUAL in wanted else None
        return await self._respond(model, visual, k, base_url, started, words=(text, query, words))

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

    async def _text_table(self) -> ModelTable | None:
        if not self._settings.text.on or self._models is None or not hasattr(self._models, "text"):
            return None
        return await asyncio.to_thread(self._models.text)

    async def _active(self) -> ModelTable:
        if self._models is None:
            return ModelTable(self._settings.model.id, 0, FRAMES)
        return await asyncio.to_thread(self._models.active)

    def frames(self, model: ModelTable) -> FrameTable:
        return self._store.frames_table(model.table)

    async def _respond(
        self,
        model: ModelTable,
        vector: NDArray[np.float32] | None,
        k: int,
        base_url: str,
        started: float,
        words: tuple[ModelTable, TextQuery, list[str]] | None = None,
    ) -> SearchResponse:
        """The moments of the frames nearest ``vector`` (None: the frames are not searched); with
        ``words`` (the text table, the query, the text sources), fused with the segments that match."""
        moments_k = k if words is None else k * FUSION_MOMENTS_PER_MOMENT
        hits, versions = await self._nearest_frames(model, vector, k)
        text_hits = await self._matching_words(words, k) if words is not None else []
        wanted = {h.video_id for h in hits} | {r.hit.video_id for r in text_hits}
        records = await asyncio.to_thread(self._store.catalog.get_many, wanted) if wanted else {}
        durations_s = {vid: r.duration_s for vid, r in records.items() if r.duration_s is not None}
        # Each video's frames were sampled at its own interval (the setting may have changed since).
        samplings = {vid: e.sampling for vid, r in records.items() if (e := r.index_in(model.table)) is not None}
        moments = merge_moments(
            hits, self._settings.sampling.spec, moments_k, durations_s=durations_s, sampling_by_video=samplings
        )
        hits_s: dict[str, list[float]] = {}
        for hit in hits:  # best first
            hits_s.setdefault(hit.video_id, []).append(hit.ts_s)
        results: list[MomentOut] = []
        base = base_url.rstrip("/")
        # With words, off the loop: the matching reads each hit's words (bounded, but a search's worth of CPU);
        # a search without them (every image search) takes the visual moments as they are, with no thread hop.
        fused_of = (moments, text_hits, records, words, k)
        fused = await asyncio.to_thread(self._fused, *fused_of) if words is not None else self._fused(*fused_of)
        for f in fused:
            shown = self._shown_frame(f, model, records, versions)
            if shown is None:
                continue
            results.append(
                await self._moment_out(f, shown, base, durations_s.get(f.video_id), hits_s.get(f.video_id, []))
            )
        return SearchResponse(results=results, took_ms=_took_ms(started), model=model.model)

    async def _nearest_frames(
        self, model: ModelTable, vector: NDArray[np.float32] | None, k: int
    ) -> tuple[list[FrameHit], dict[str, str]]:
        """The candidate frames nearest ``vector``, best first, and each one's content version by frame id
        (none when ``vector`` is None)."""
        if vector is None:
            return [], {}
        limit = min(k * CANDIDATES_PER_MOMENT, MAX_CANDIDATES)  # as many frames as a visual search reads
        rows: list[dict[str, object]] = await asyncio.to_thread(
            self.frames(model).search, vector, limit, self._settings.index
        )
        hits = [
            FrameHit(
                frame_id=str(r["frame_id"]),
                video_id=str(r["video_id"]),
                uri=str(r["uri"]),
                ts_s=float(r["ts_s"]),  # type: ignore[arg-type]
                score=round(1.0 - float(r["_distance"]), 6),  # type: ignore[arg-type]
            )
            for r in rows
        ]
        return hits, {str(r["frame_id"]): str(r["version"]) for r in rows}

    async def _matching_words(self, words: tuple[ModelTable, TextQuery, list[str]], k: int) -> list[Ranked[TextHit]]:
        """The candidate segments of the text table whose words match the query, in the given sources."""
        text, query, sources = words
        table = self._store.text_table(text.table)
        limit = min(k * TEXT_CANDIDATES_PER_MOMENT, MAX_CANDIDATES)
        fuzzy = self._settings.text.search_fuzzy
        max_chars = self._settings.limits.max_segment_chars
        return await asyncio.to_thread(search_words, table, query, limit, sources, fuzzy, max_chars)

    def _fused(
        self,
        moments: list[Moment],
        text_hits: list[Ranked[TextHit]],
        records: dict[str, VideoRecord],
        words: tuple[ModelTable, TextQuery, list[str]] | None,
        k: int,
    ) -> list[Fused]:
        """The ``k`` moments answered: the visual moments fused with the words that still match the
        catalog's current version of their video, or the visual moments alone when no words do."""
        matches: list[TextMatch] = []
        if words is not None:
            text, query, _ = words
            matches = current_matches(text_hits, records, text, query, self._settings.text.search_fuzzy)
        if matches:
            return [_rounded(f) for f in fuse(moments, matches, k)]
        # The words took no part: the visual moments, scored by their best frame's similarity.
        return [Fused(m.video_id, m.uri, m.start_s, m.end_s, m.ts_s, m.score, (VISUAL,), m) for m in moments[:k]]

    async def _moment_out(
        self, f: Fused, shown: tuple[str, str], base: str, duration_s: float | None, hits_s: list[float]
    ) -> MomentOut:
        """One answered moment with its links: ``shown`` is the frame its thumbnail shows and that
        frame's content version, ``hits_s`` the video's candidate frame times, best first."""
        frame, version = shown
        bucket, _, key = f.uri.removeprefix("s3://").partition("/")
        link = await self.links.presign_get(bucket, key)
        # The content version is in the link: a video overwritten gets new thumbnail links.
        thumbnail = self._thumbnails.sign(f"/v1/frames/{frame}/thumbnail", {"v": version})
        return MomentOut(
            video_id=f.video_id,
            uri=f.uri,
            score=f.score,
            start_s=f.start_s,
            end_s=f.end_s,
            ts_s=f.ts_s,
            thumbnail_url=base + thumbnail,
            # A media fragment makes players start at the best frame (or the matched words).
            video_url=f"{link}#t={f.ts_s:g}",
            duration_s=duration_s,
            hits_s=hits_s[:MAX_HITS_PER_MOMENT],
            sources=list(f.sources),
            text=f.text.text if f.text else None,
            text_source=f.text.source if f.text else None,
            text_marks=list(f.text.marks) if f.text else [],
        )

    def _shown_frame(
        self, f: Fused, model: ModelTable, records: dict[str, VideoRecord], versions: dict[str, str]
    ) -> tuple[str, str] | None:
        """The frame whose thumbnail shows the moment, and its content version: the best frame of its
        visual match, else the frame sampled at (or just before) the matched words (None: the video has
        no frames in the active table, so nothing to show)."""
        if f.visual is not None:
            return f.visual.frame_id, versions[f.visual.frame_id]
        record = records.get(f.video_id)
        entry = record.index_in(model.table) if record is not None else None
        if record is None or entry is None or entry.frames <= 0 or record.version is None:
            return None
        index = min(max(int(f.ts_s / entry.sampling.every_s + 1e-6), 0), entry.frames - 1)
        return frame_id(f.video_id, index), record.version


def _rounded(f: Fused) -> Fused:
    """A fused score as the response shows it."""
    return Fused(
        f.video_id, f.uri, f.start_s, f.end_s, f.ts_s, round(f.score, 6), f.sources, visual=f.visual, text=f.text
    )


def _took_ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)
