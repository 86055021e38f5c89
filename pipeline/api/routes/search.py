"""``GET /v1/search`` (by text), ``POST /v1/search/image`` (by an example picture) and the
thumbnails of the moments they find (``GET /v1/frames/{frame_id}/thumbnail``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, File, HTTPException, Request, UploadFile
from fastapi.responses import Response

from pipeline.api.guards import IMAGE_SEARCH_PATH
from pipeline.query.search import SearchResponse, SearchService
from pipeline.settings import Settings
from storage.tables import IndexStore


def search_router(
    settings: Settings,
    search: SearchService,
    store: IndexStore,
    active_table: Callable[[], str] | None = None,
) -> APIRouter:
    """The searches over ``search``, and thumbnails read from ``store``'s frames: the active model's
    table (``active_table``), by default ``frames``."""
    router = APIRouter()

    @router.get("/v1/search")
    async def search_text(request: Request, q: str, k: int = 10, sources: str | None = None) -> SearchResponse:
        return await search.search_text(q, k, str(request.base_url), sources)

    @router.post(IMAGE_SEARCH_PATH)
    async def search_image(request: Request, image: Annotated[UploadFile, File()], k: int = 10) -> SearchResponse:
        # The body was bounded while it was read (BodyLimit); the part itself is bounded here.
        data = await image.read(settings.limits.max_image_bytes + 1)
        return await search.search_image(data, k, str(request.base_url))

    @router.get("/v1/frames/{frame_id}/thumbnail")
    async def thumbnail(frame_id: str, v: str | None = None) -> Response:
        """The frame's JPEG; ``v`` (the content version, in the links search hands out) makes the
        link one picture's: it is cached as such, and finds nothing once the video is overwritten."""

        def read() -> bytes | None:
            frames = store.frames if active_table is None else store.frames_table(active_table())
            return frames.thumbnail(frame_id, v)

        data = await asyncio.to_thread(read)
        if not data:
            raise HTTPException(404, f"no thumbnail for {frame_id}" + (f" at version {v}" if v else ""))
        cache = f"private, max-age={settings.s3.presign_ttl_s}, immutable" if v else "private, no-cache"
        return Response(content=data, media_type="image/jpeg", headers={"Cache-Control": cache})

    return router
