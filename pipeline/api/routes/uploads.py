"""``POST /v1/uploads``: a presigned PUT for one file into the upload bucket. Uploads go from the
client (the web page) straight to the bucket, so indexing still starts from the bucket event,
exactly as for any other client."""

from __future__ import annotations

import asyncio
import posixpath
import re
import unicodedata
from datetime import datetime

from fastapi import APIRouter
from pydantic import BaseModel, Field

from pipeline.query.links import S3Links
from pipeline.settings import Settings
from storage.errors import InvalidInput, LimitExceeded
from storage.ids import video_id
from storage.tables import IndexStore

#: Longest object key an upload may choose (S3's own limit is 1024 bytes).
MAX_KEY_BYTES = 1024
#: Content types an upload may declare (it is signed into the PUT and stored with the object).
UPLOAD_CONTENT_TYPE = re.compile(r"video/[A-Za-z0-9][A-Za-z0-9.+-]*|application/octet-stream")


class UploadRequest(BaseModel):
    #: The file's name; it becomes the object's key in the upload bucket.
    name: str = Field(min_length=1)
    size_bytes: int = Field(ge=0)
    content_type: str = "application/octet-stream"


class UploadLink(BaseModel):
    uri: str
    video_id: str
    url: str
    method: str
    headers: dict[str, str]
    expires_in_s: int
    #: ``updated_at`` of the video's record when the link was made (None: no record): an upload
    #: over an existing object is settled only by a newer record.
    previous_updated_at: datetime | None


def upload_key(name: str) -> str:
    """The object key for an uploaded file: its base name (a browser sends no directories).

    Raises:
        InvalidInput: empty, a control or format character (bidi overrides), or over ``MAX_KEY_BYTES``.
    """
    base = posixpath.basename(name.replace("\\", "/")).strip()
    if not base or base in (".", ".."):
        raise InvalidInput("name must be a file name")
    if any(unicodedata.category(c) in ("Cc", "Cf") for c in base):
        raise InvalidInput("name must not contain control or format characters")
    if len(base.encode()) > MAX_KEY_BYTES:
        raise InvalidInput(f"name exceeds {MAX_KEY_BYTES} bytes")
    return base


def uploads_router(settings: Settings, links: S3Links, store: IndexStore) -> APIRouter:
    """``POST /v1/uploads`` (a user key, like any other API call); ``links`` signs the PUTs."""
    router = APIRouter()

    @router.post("/v1/uploads")
    async def upload(body: UploadRequest) -> UploadLink:
        """A presigned PUT for one file into the upload bucket; its bucket event starts the indexing."""
        key = upload_key(body.name)
        if body.size_bytes > settings.limits.max_bytes:
            raise LimitExceeded(f"file exceeds max bytes {settings.limits.max_bytes}")
        content_type = body.content_type.strip() or "application/octet-stream"
        if not UPLOAD_CONTENT_TYPE.fullmatch(content_type):
            raise InvalidInput("content_type must be video/* or application/octet-stream")
        if not settings.videos.matches(key, content_type):
            raise InvalidInput(f"not a video by name or type: {key!r} ({content_type}); see VIDX_VIDEOS__EXTENSIONS")
        bucket = settings.s3.upload_bucket
        vid = video_id(bucket, key)
        previous = await asyncio.to_thread(store.catalog.get, vid)
        url = await links.presign_put(bucket, key, content_type, body.size_bytes)
        return UploadLink(
            uri=f"s3://{bucket}/{key}",
            video_id=vid,
            url=url,
            method="PUT",
            headers={"Content-Type": content_type},
            expires_in_s=links.ttl_s,
            previous_updated_at=previous.updated_at if previous else None,
        )

    return router
