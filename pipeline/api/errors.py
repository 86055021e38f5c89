"""The app's exception handlers: every error is answered as JSON (``guards.error_response``) with a
4xx/5xx status, never a traceback; a ``TransientError`` (a store, the task queue or the encoder
blipping) is a 503 with ``Retry-After``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.api.guards import error_response, route_path
from storage.errors import InvalidInput, LimitExceeded, ReindexRefused, TransientError, VidxError

log = logging.getLogger(__name__)

#: The error code of each HTTP status a route or FastAPI raises.
HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    429: "rate_limited",
    405: "method_not_allowed",
    413: "too_large",
    422: "invalid_request",
    503: "unavailable",
}


def install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    """The one handler set: vidx's errors by what the caller should do, HTTP errors (routes' 404s,
    405s, a body over its bound) by status, invalid requests as their first complaint, and anything
    else as a 500 that names no detail. ``retry_after_s``: the ``Retry-After`` of every 503."""

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
