"""The HTTP contract (v1): FastAPI routes over plain services. Errors are JSON
``{"error": {"code", "message"}}`` with a 4xx/5xx status, never a traceback."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Annotated, Any, Protocol

from fastapi import FastAPI, File, HTTPException, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.errors import InvalidInput, LimitExceeded, TransientError, VidxError
from pipeline.ids import parse_s3_uri, video_id
from pipeline.indexer import mark_queued
from pipeline.jobs import IndexJob, JobOp, JobSource
from pipeline.search import SearchResponse, SearchService
from pipeline.settings import Settings
from storage.tables import IndexStore, VideoRecord, VideoStatus

log = logging.getLogger(__name__)


class JobSubmitter(Protocol):
    def submit(self, job: IndexJob) -> str: ...


class IndexRequest(BaseModel):
    uri: str


class IndexAccepted(BaseModel):
    video_id: str
    task_id: str
    status: str


class VideoOut(BaseModel):
    video_id: str
    uri: str
    status: str
    error: str | None
    frames: int
    duration_s: float | None
    model: str | None
    updated_at: datetime

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
        )


class VideoList(BaseModel):
    videos: list[VideoOut]


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"code": code, "message": message}})


#: Room for multipart headers around an image when checking a request's declared length.
MULTIPART_OVERHEAD_BYTES = 64 * 1024

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "too_large",
    422: "invalid_request",
    503: "unavailable",
}


def create_app(
    settings: Settings,
    search: SearchService,
    store: IndexStore,
    jobs: JobSubmitter,
    stats: Callable[[], Awaitable[dict[str, Any]]],
) -> FastAPI:
    """Build the API over its services (plain objects: testable without Ray)."""
    app = FastAPI(title="vidx", version="1", docs_url="/docs", redoc_url=None)
    api_key = settings.api_key.get_secret_value() if settings.api_key else None

    @app.middleware("http")
    async def auth(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if api_key and request.url.path != "/healthz":
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                return _error(401, "unauthorized", "a valid bearer API key is required")
        return await call_next(request)

    @app.exception_handler(VidxError)
    async def vidx_error(_: Request, exc: VidxError) -> JSONResponse:
        if isinstance(exc, LimitExceeded):
            return _error(413, "too_large", str(exc))
        if isinstance(exc, InvalidInput):
            return _error(400, "bad_request", str(exc))
        if isinstance(exc, TransientError):
            return _error(503, "unavailable", str(exc))
        return _error(400, "bad_request", exc.reason)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, _HTTP_CODES.get(exc.status_code, "error"), str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return _error(422, "invalid_request", f"{where}: {first.get('msg', 'invalid request')}")

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error(500, "internal", "internal error; see the server log")

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/index", status_code=202)
    async def index(body: IndexRequest) -> IndexAccepted:
        bucket, key = parse_s3_uri(body.uri, settings.s3.buckets)
        job = IndexJob(op=JobOp.INDEX, bucket=bucket, key=key, source=JobSource.API)
        await asyncio.to_thread(mark_queued, store, job)
        task_id = await asyncio.to_thread(jobs.submit, job)
        return IndexAccepted(video_id=job.video_id, task_id=task_id, status=VideoStatus.QUEUED.value)

    @app.get("/v1/videos/{video_id}")
    async def get_video(video_id: str) -> VideoOut:
        record = await asyncio.to_thread(store.get_video, video_id)
        if record is None:
            raise HTTPException(404, f"no video {video_id}")
        return VideoOut.of(record)

    @app.get("/v1/videos")
    async def list_videos(
        uri: str | None = None,
        status: VideoStatus | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> VideoList:
        if uri is not None:
            bucket, key = parse_s3_uri(uri, settings.s3.buckets)
            record = await asyncio.to_thread(store.get_video, video_id(bucket, key))
            return VideoList(videos=[VideoOut.of(record)] if record else [])
        records = await asyncio.to_thread(store.find_videos, status=status, limit=limit)
        return VideoList(videos=[VideoOut.of(r) for r in records])

    @app.get("/v1/search")
    async def search_text(request: Request, q: str, k: int = 10) -> SearchResponse:
        return await search.search_text(q, k, str(request.base_url))

    @app.post("/v1/search/image")
    async def search_image(request: Request, image: Annotated[UploadFile, File()], k: int = 10) -> SearchResponse:
        declared = int(request.headers.get("content-length") or 0)
        if declared > settings.limits.max_image_bytes + MULTIPART_OVERHEAD_BYTES:
            raise LimitExceeded(f"image exceeds max bytes {settings.limits.max_image_bytes}")
        data = await image.read(settings.limits.max_image_bytes + 1)
        return await search.search_image(data, k, str(request.base_url))

    @app.get("/v1/frames/{frame_id}/thumbnail")
    async def thumbnail(frame_id: str) -> Response:
        data = await asyncio.to_thread(store.thumbnail, frame_id)
        if not data:
            raise HTTPException(404, f"no thumbnail for {frame_id}")
        return Response(content=data, media_type="image/jpeg", headers={"Cache-Control": "max-age=3600"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        registry = CollectorRegistry()
        videos = Gauge("vidx_videos", "Videos in the catalog by status", ["status"], registry=registry)
        for status_name, count in (await asyncio.to_thread(store.count_videos)).items():
            videos.labels(status=status_name).set(count)
        router = Gauge("vidx_router_events", "EventRouter counters since start", ["kind"], registry=registry)
        for kind, count in (await stats()).items():
            router.labels(kind=kind).set(count)
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    return app
