"""The HTTP contract (v1): FastAPI routes over plain services. Errors are JSON
``{"error": {"code", "message"}}`` with a 4xx/5xx status, never a traceback; a ``TransientError``
(a store, the task queue or the encoder blipping) is a 503 with ``Retry-After``."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Annotated, Any, Protocol

from fastapi import APIRouter, FastAPI, File, HTTPException, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client.metrics_core import Metric
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from events.jobs import IndexJob, JobOp, JobSource
from pipeline.api.guards import (
    HTTP_CODES,
    IMAGE_SEARCH_PATH,
    MAX_BODY_BYTES,
    METRICS_PATH,
    MULTIPART_OVERHEAD_BYTES,
    PUBLIC_PATH,
    THUMBNAIL_PATH,
    Access,
    Admission,
    BearerKeys,
    BodyLimit,
    RateLimit,
    caller_of,
    error_response,
    is_admin_path,
    rate_class,
    route_path,
)
from pipeline.api.prometheus import exposition
from pipeline.api.web import is_page_path, web_router
from pipeline.query.links import S3Links, media_signer
from pipeline.query.search import SearchResponse, SearchService
from pipeline.settings import Settings
from storage.catalog import VideoRecord, VideoStatus
from storage.errors import InvalidInput, LimitExceeded, ReindexRefused, TransientError, VidxError
from storage.ids import parse_s3_uri, video_id
from storage.tables import IndexStore

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


def create_app(
    settings: Settings,
    search: SearchService,
    store: IndexStore,
    jobs: JobSubmitter,
    stats: Callable[[], Awaitable[dict[str, Any]]],
    admin: APIRouter | None = None,
    check_state: Callable[[], Awaitable[dict[str, Any]]] | None = None,
    replicas: Callable[[], Awaitable[dict[str, dict[str, int]]]] | None = None,
    queues: Callable[[], Awaitable[dict[str, int]]] | None = None,
    recorded: Callable[[], Awaitable[list[Metric]]] | None = None,
    links: S3Links | None = None,
    active_table: Callable[[], str] | None = None,
) -> FastAPI:
    """Build the API over its services (plain objects: testable without Ray). ``admin``: the
    ``/v1/admin`` routes (``pipeline.api.admin``), guarded by the admin key; ``check_state``: the
    scheduled check's last round (``/v1/status``, ``/metrics``); ``replicas``: replicas by
    deployment and state, ``queues``: messages per queue role, ``recorded``: the metrics every
    replica recorded (all three ``/metrics``); ``links``: the presigned-link signer for uploads
    (the search's, to share one client); ``active_table``: the active model's frames table, where
    thumbnails are read (by default ``frames``)."""
    app = FastAPI(title="vidx", version="1", docs_url="/docs", redoc_url=None)
    keys = BearerKeys(settings.api_keys, settings.admin_key)
    limits = settings.limits
    retry_after_s = settings.serve.retry_after_s

    def max_body_bytes(path: str) -> int:
        return limits.max_image_bytes + MULTIPART_OVERHEAD_BYTES if path == IMAGE_SEARCH_PATH else MAX_BODY_BYTES

    # Added first, so it runs inside ``auth``: no body is read before the key is checked.
    app.add_middleware(BodyLimit, max_bytes_for=max_body_bytes)
    thumbnails = media_signer(settings)

    rates = {
        kind: RateLimit(rate, burst)
        for kind, rate, burst in (
            ("index", limits.index_rate_per_s, limits.index_burst),
            ("search", limits.search_rate_per_s, limits.search_burst),
        )
        if rate > 0
    }

    @app.middleware("http")
    async def rate_limited(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        """Runs inside ``auth``: only callers with a valid key (or any, without keys) are counted."""
        kind = rate_class(request.method, route_path(request.scope))
        limit = rates.get(kind) if kind is not None else None
        if limit is not None:
            host = request.client.host if request.client else None
            caller = caller_of(request.headers.get("authorization"), host, keys.enabled)
            if (wait_s := limit.take(caller)) is not None:
                response = error_response(
                    429, "rate_limited", f"too many {kind} requests from this key; retry after {wait_s} s"
                )
                response.headers["Retry-After"] = str(wait_s)
                return response
        return await call_next(request)

    @app.middleware("http")
    async def auth(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        path = route_path(request.scope)
        if path == PUBLIC_PATH or (request.method in ("GET", "HEAD") and is_page_path(path)):
            return await call_next(request)
        signed = THUMBNAIL_PATH.fullmatch(path) and thumbnails.verify(path, dict(request.query_params))
        if signed and request.method in ("GET", "HEAD"):
            return await call_next(request)
        if is_admin_path(path) and not keys.admin_enabled:
            # Dead letters and reconcile are never open: without an admin key they are off.
            return error_response(
                403, "forbidden", "admin endpoints are off: set VIDX_ADMIN_KEY or VIDX_ADMIN_KEY_FILE"
            )
        if not keys.enabled:
            return await call_next(request)
        access = keys.access(request.headers.get("authorization"))
        if access is Access.NONE:
            given = "authorization" in request.headers
            response = error_response(401, "unauthorized", "a valid API key is required: Authorization: Bearer KEY")
            response.headers["WWW-Authenticate"] = 'Bearer realm="vidx"' + (', error="invalid_token"' if given else "")
            return response
        if is_admin_path(path) and access is not Access.ADMIN:
            return error_response(403, "forbidden", "this endpoint needs the admin key")
        return await call_next(request)

    # Added last, so it runs first: shed load costs no key check and reads no body.
    app.add_middleware(
        Admission,
        max_in_flight=settings.serve.api_max_in_flight,
        retry_after_s=retry_after_s,
        max_scrapes=settings.serve.metrics_max_in_flight,
    )

    @app.exception_handler(VidxError)
    async def vidxerror_response(request: Request, exc: VidxError) -> JSONResponse:
        if isinstance(exc, LimitExceeded):
            return error_response(413, "too_large", str(exc))
        if isinstance(exc, ReindexRefused):  # refused in the lifecycle's current state: a conflict
            return error_response(409, "conflict", str(exc))
        if isinstance(exc, InvalidInput):
            return error_response(400, "bad_request", str(exc))
        if isinstance(exc, TransientError):
            log.warning("%s %s answered 503: %s", request.method, route_path(request.scope), exc)
            return error_response(503, "unavailable", str(exc), retry_after_s)
        return error_response(400, "bad_request", exc.reason)

    @app.exception_handler(StarletteHTTPException)
    async def httperror_response(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, HTTP_CODES.get(exc.status_code, "error"), str(exc.detail), retry_after_s)

    @app.exception_handler(RequestValidationError)
    async def validationerror_response(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return error_response(422, "invalid_request", f"{where}: {first.get('msg', 'invalid request')}")

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, "internal", "internal error; see the server log")

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/index", status_code=202)
    async def index(body: IndexRequest) -> IndexAccepted:
        bucket, key = parse_s3_uri(body.uri, settings.s3.buckets)
        job = IndexJob(op=JobOp.INDEX, bucket=bucket, key=key, source=JobSource.API)
        task_id = await asyncio.to_thread(jobs.submit, job)
        return IndexAccepted(video_id=job.video_id, task_id=task_id, status=VideoStatus.QUEUED.value)

    @app.get("/v1/videos/{video_id}")
    async def get_video(video_id: str) -> VideoOut:
        record = await asyncio.to_thread(store.catalog.get, video_id)
        if record is None:
            raise HTTPException(404, f"no video {video_id}")
        return VideoOut.of(record)

    @app.get("/v1/videos")
    async def list_videos(
        uri: str | None = None,
        status: VideoStatus | None = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        cursor: str | None = None,
    ) -> VideoList:
        """Newest first, ``limit`` at a time; ``cursor`` (a page's ``next_cursor``) gives the next page."""
        if uri is not None:
            bucket, key = parse_s3_uri(uri, settings.s3.buckets)
            record = await asyncio.to_thread(store.catalog.get, video_id(bucket, key))
            return VideoList(videos=[VideoOut.of(record)] if record else [])
        after = decode_cursor(cursor) if cursor else None
        records, position = await asyncio.to_thread(store.catalog.page, status=status, limit=limit, after=after)
        return VideoList(videos=[VideoOut.of(r) for r in records], next_cursor=encode_cursor(position))

    @app.get("/v1/search")
    async def search_text(request: Request, q: str, k: int = 10, sources: str | None = None) -> SearchResponse:
        return await search.search_text(q, k, str(request.base_url), sources)

    @app.post(IMAGE_SEARCH_PATH)
    async def search_image(request: Request, image: Annotated[UploadFile, File()], k: int = 10) -> SearchResponse:
        # The body was bounded while it was read (BodyLimit); the part itself is bounded here.
        data = await image.read(limits.max_image_bytes + 1)
        return await search.search_image(data, k, str(request.base_url))

    @app.get("/v1/frames/{frame_id}/thumbnail")
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

    @app.get(METRICS_PATH)
    async def metrics() -> PlainTextResponse:
        text = await exposition(stats, check_state, replicas, queues, recorded)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        """What the app knows of itself: the scheduled check's last round, each background service's
        liveness (alive, last success in epoch seconds) and the videos by status."""
        try:
            counts: dict[str, int] | None = await asyncio.to_thread(store.catalog.counts)
        except TransientError:  # the catalog blips: the rest of the status matters more now
            counts = None
        check = dict(await check_state()) if check_state is not None else None
        services = dict(check.pop("services", None) or {}) if check is not None else {}
        # The router's work is holding its broker connection: ok as of this answer while connected.
        connected = bool((await stats()).get("connected"))
        services["router"] = {"alive": connected, "last_ok": time.time() if connected else None}
        return {"check": check, "services": services, "videos": counts}

    app.include_router(web_router(settings, links or S3Links(settings.s3), store))
    if admin is not None:
        app.include_router(admin)
    return app
