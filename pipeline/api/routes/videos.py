"""``GET /v1/videos/{video_id}`` and ``GET /v1/videos``: the catalog's records, one by id, one by
URI, or listed newest first a page at a time behind an opaque cursor."""

from __future__ import annotations

import asyncio
import base64
import json
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel

from storage.catalog import VideoRecord, VideoStatus
from storage.errors import InvalidInput
from storage.ids import parse_s3_uri, video_id
from storage.tables import IndexStore


class VideoOut(BaseModel):
    video_id: str
    uri: str
    status: str
    error: str | None
    frames: int
    duration_s: float | None
    model: str | None
    updated_at: datetime
    #: Every model the video is indexed with: the table, the frames it holds and their sampling.
    models: list[dict[str, Any]] = []

    @classmethod
    def of(cls, r: VideoRecord) -> VideoOut:
        return cls(
            video_id=r.video_id,
            uri=r.uri,
            status=r.status.value,
            error=r.error,
            frames=r.frames,
            duration_s=r.duration_s,
            model=r.model,
            updated_at=r.updated_at,
            models=[{k: v for k, v in i.to_json().items() if k != "fingerprint"} for i in r.indexes],
        )


class VideoList(BaseModel):
    videos: list[VideoOut]
    #: Pass as ``cursor`` for the next page (newest first); null on the last page.
    next_cursor: str | None = None


def encode_cursor(position: tuple[datetime, str] | None) -> str | None:
    """The opaque cursor of a listing position (the last row's ``updated_at`` and ``video_id``)."""
    if position is None:
        return None
    raw = json.dumps([position[0].isoformat(), position[1]]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """Raises:
    InvalidInput: not a cursor this API handed out.
    """
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        at, vid = json.loads(raw)
        when = datetime.fromisoformat(at)
        if when.tzinfo is None or not isinstance(vid, str):
            raise ValueError("not a position")
        return when, vid
    except (ValueError, TypeError) as exc:
        raise InvalidInput("cursor is not one this API handed out (pass next_cursor as it came)") from exc


def videos_router(buckets: list[str], store: IndexStore) -> APIRouter:
    """The video routes over ``store``'s catalog; a ``uri`` must name an object in ``buckets``."""
    router = APIRouter()

    @router.get("/v1/videos/{video_id}")
    async def get_video(video_id: str) -> VideoOut:
        record = await asyncio.to_thread(store.catalog.get, video_id)
        if record is None:
            raise HTTPException(404, f"no video {video_id}")
        return VideoOut.of(record)

    @router.get("/v1/videos")
    async def list_videos(
        uri: str | None = None,
        status: VideoStatus | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        cursor: str | None = None,
    ) -> VideoList:
        """Newest first, ``limit`` at a time; ``cursor`` (a page's ``next_cursor``) gives the next page."""
        if uri is not None:
            bucket, key = parse_s3_uri(uri, buckets)
            record = await asyncio.to_thread(store.catalog.get, video_id(bucket, key))
            return VideoList(videos=[VideoOut.of(record)] if record else [])
        after = decode_cursor(cursor) if cursor else None
        records, position = await asyncio.to_thread(store.catalog.page, status=status, limit=limit, after=after)
        return VideoList(videos=[VideoOut.of(r) for r in records], next_cursor=encode_cursor(position))

    return router
