"""What stands between a request and a route, as the app's middleware: admission (load shedding),
bearer keys, per-caller rate limits and body bounds, installed in the order they run
(``install_guards``), and the JSON error every refusal is answered with.

Rate limits are a token bucket per caller and endpoint class, kept by each Api replica in memory
(bounded): with N replicas a key gets up to N times the rate, and a replica that restarts forgets. A
caller is its API key (hashed: the key itself is never kept), or its address when the API runs
without keys.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import math
import posixpath
import re
import time
from collections import OrderedDict
from collections.abc import Callable

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import SecretStr
from starlette._utils import get_route_path
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.api.routes.web import is_page_path
from pipeline.query.links import MediaSigner
from pipeline.settings import LimitSettings, Settings

#: Callers remembered per endpoint class; the least recently seen is forgotten first (a forgotten
#: caller starts again with a full bucket).
MAX_CALLERS = 10_000

#: Seconds a client is asked to wait before retrying a 503 (``Retry-After``): transient failures
#: (a store or queue restarting, the encoder scaling) usually clear within a few seconds.
RETRY_AFTER_S = 5


def error_response(status: int, code: str, message: str, retry_after_s: int = RETRY_AFTER_S) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if status == 503 else None
    return JSONResponse(status_code=status, content={"error": {"code": code, "message": message}}, headers=headers)


#: Room for multipart headers around an image when bounding an image search's body.
MULTIPART_OVERHEAD_BYTES = 64 * 1024
#: Largest body of any other request (JSON control bodies such as ``{"uri": ...}``).
MAX_BODY_BYTES = 1024 * 1024
#: The one path served without a key (load balancers and ``vidx up`` probe it).
PUBLIC_PATH = "/healthz"
#: Paths under this prefix need the admin key (dead letters, reindex).
ADMIN_PREFIX = "/v1/admin"
IMAGE_SEARCH_PATH = "/v1/search/image"
#: Thumbnails open with a key or with a live signed link (``pipeline.query.links``).
THUMBNAIL_PATH = re.compile(r"/v1/frames/[^/]+/thumbnail")
#: The path answered whatever the load: probes must tell "busy" from "down".
UNSHED_PATHS = frozenset({PUBLIC_PATH})
METRICS_PATH = "/metrics"


class Access(enum.Enum):
    """What a request's bearer key opens."""

    NONE = "none"
    USER = "user"
    ADMIN = "admin"


class BearerKeys:
    """Checks ``Authorization: Bearer KEY`` against the configured keys in constant time.

    Keys are kept as SHA-256 digests: each comparison is between equal-length values, so neither
    a key's content nor its length leaks through timing, and every key is compared on every call.
    """

    def __init__(self, api_keys: list[SecretStr], admin_key: SecretStr | None) -> None:
        self._users = [self._digest(k.get_secret_value()) for k in api_keys]
        self._admin = self._digest(admin_key.get_secret_value()) if admin_key else None

    @property
    def enabled(self) -> bool:
        return bool(self._users) or self._admin is not None

    @property
    def admin_enabled(self) -> bool:
        return self._admin is not None

    @staticmethod
    def _digest(key: str) -> bytes:
        return hashlib.sha256(key.encode()).digest()

    def access(self, authorization: str | None) -> Access:
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return Access.NONE
        given = self._digest(token.strip())
        user = False
        for digest in self._users:
            user |= hmac.compare_digest(given, digest)
        admin = self._admin is not None and hmac.compare_digest(given, self._admin)
        return Access.ADMIN if admin else Access.USER if user else Access.NONE


def route_path(scope: Scope) -> str:
    """The request path below the app's mount point (Serve's route prefix arrives as ``root_path``),
    read by Starlette's own rule: access is decided on exactly the path the router routes."""
    return get_route_path(scope)


def rate_class(method: str, path: str) -> str | None:
    """Which per-key rate limit a request counts against: ``index``, ``search`` or none."""
    if method == "POST" and path == "/v1/index":
        return "index"
    if (method == "GET" and path == "/v1/search") or (method == "POST" and path == IMAGE_SEARCH_PATH):
        return "search"
    return None


def is_admin_path(path: str) -> bool:
    """Whether ``path`` is under ``/v1/admin``, however it is spelled (case, ``//``, ``.`` segments)."""
    squeezed = re.sub(r"/+", "/", "/" + path.lower())
    return any(p == ADMIN_PREFIX or p.startswith(ADMIN_PREFIX + "/") for p in (squeezed, posixpath.normpath(squeezed)))


class BodyTooLarge(HTTPException):
    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body exceeds max bytes {max_bytes}")


class BodyLimit:
    """ASGI middleware bounding request bodies as they are read, whatever ``Content-Length`` says:
    a declared length over the bound is refused before reading; a body that grows past it (chunked,
    or longer than declared) fails the read with 413."""

    def __init__(self, app: ASGIApp, max_bytes_for: Callable[[str], int]) -> None:
        self._app = app
        self._max_bytes_for = max_bytes_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        max_bytes = self._max_bytes_for(route_path(scope))
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared and (not declared.isdigit() or int(declared) > max_bytes):
            exc = BodyTooLarge(max_bytes)
            await error_response(413, "too_large", str(exc.detail))(scope, receive, send)
            return
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    # fastapi's HTTPException: FastAPI re-raises it from body parsing as it is.
                    raise BodyTooLarge(max_bytes)
            return message

        await self._app(scope, bounded, send)


class Admission:
    """ASGI middleware bounding the requests the app works on at once: past ``max_in_flight`` a
    request is answered 503 with ``Retry-After`` at once (load shed, nothing done); ``/metrics`` has
    its own, smaller bound (``max_scrapes``); the paths in ``UNSHED_PATHS`` are neither counted nor
    shed. One event loop per replica: no lock needed."""

    def __init__(self, app: ASGIApp, max_in_flight: int, retry_after_s: int, max_scrapes: int = 4) -> None:
        self._app = app
        self._bounds = {"requests": max_in_flight, "scrapes": max_scrapes}
        self._retry_after_s = retry_after_s
        self.in_flight = {"requests": 0, "scrapes": 0}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route_path(scope) if scope["type"] == "http" else None
        if path is None or path in UNSHED_PATHS:
            await self._app(scope, receive, send)
            return
        kind = "scrapes" if path == METRICS_PATH else "requests"
        if self.in_flight[kind] >= self._bounds[kind]:
            message = f"over {self._bounds[kind]} {kind} in flight; retry after {self._retry_after_s} s"
            await error_response(503, "overloaded", message, self._retry_after_s)(scope, receive, send)
            return
        self.in_flight[kind] += 1
        try:
            await self._app(scope, receive, send)
        finally:
            self.in_flight[kind] -= 1


def caller_of(authorization: str | None, client_host: str | None, keys_enabled: bool) -> str:
    """Who is calling: with keys, a digest of the bearer token (as ``BearerKeys`` reads it, so every
    spelling of one key is one caller; only valid keys get this far); without keys, the client's
    address (a made-up header would otherwise be a fresh caller each time)."""
    if keys_enabled and authorization:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return "key:" + hashlib.sha256(token.strip().encode()).hexdigest()[:24]
    return f"addr:{client_host or 'unknown'}"


class RateLimit:
    """Admits ``rate_per_s`` requests a second per caller on average, ``burst`` at once."""

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_callers: int = MAX_CALLERS,
    ) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self._rate = rate_per_s
        self._burst = float(burst)
        self._clock = clock
        self._max_callers = max_callers
        #: caller -> (tokens, when they were counted)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, caller: str) -> int | None:
        """Take a token for ``caller``: None when admitted, else whole seconds until one is free
        (the ``Retry-After``, at least 1). One event loop per replica: no lock needed."""
        now = self._clock()
        tokens, at = self._buckets.pop(caller, (self._burst, now))
        tokens = min(self._burst, tokens + (now - at) * self._rate)
        admitted = tokens >= 1.0
        if admitted:
            tokens -= 1.0
        self._buckets[caller] = (tokens, now)
        while len(self._buckets) > self._max_callers:
            self._buckets.popitem(last=False)
        return None if admitted else max(1, math.ceil((1.0 - tokens) / self._rate))


def rate_limits(limits: LimitSettings) -> dict[str, RateLimit]:
    """The rate limit of each endpoint class (``rate_class``) whose rate is on (over 0)."""
    return {
        kind: RateLimit(rate, burst)
        for kind, rate, burst in (
            ("index", limits.index_rate_per_s, limits.index_burst),
            ("search", limits.search_rate_per_s, limits.search_burst),
        )
        if rate > 0
    }


class KeyCheck(BaseHTTPMiddleware):
    """Lets a request through with a valid key (the admin key under ``/v1/admin``), or without one
    to ``/healthz``, the page and its assets, and a thumbnail with a live signed link. Without any
    keys the API is open, but the admin routes are off."""

    def __init__(self, app: ASGIApp, keys: BearerKeys, thumbnails: MediaSigner) -> None:
        super().__init__(app)
        self._keys = keys
        self._thumbnails = thumbnails

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        path = route_path(request.scope)
        if path == PUBLIC_PATH or (request.method in ("GET", "HEAD") and is_page_path(path)):
            return await call_next(request)
        signed = THUMBNAIL_PATH.fullmatch(path) and self._thumbnails.verify(path, dict(request.query_params))
        if signed and request.method in ("GET", "HEAD"):
            return await call_next(request)
        if is_admin_path(path) and not self._keys.admin_enabled:
            # Dead letters and reconcile are never open: without an admin key they are off.
            return error_response(
                403, "forbidden", "admin endpoints are off: set VIDX_ADMIN_KEY or VIDX_ADMIN_KEY_FILE"
            )
        if not self._keys.enabled:
            return await call_next(request)
        access = self._keys.access(request.headers.get("authorization"))
        if access is Access.NONE:
            given = "authorization" in request.headers
            response = error_response(401, "unauthorized", "a valid API key is required: Authorization: Bearer KEY")
            response.headers["WWW-Authenticate"] = 'Bearer realm="vidx"' + (', error="invalid_token"' if given else "")
            return response
        if is_admin_path(path) and access is not Access.ADMIN:
            return error_response(403, "forbidden", "this endpoint needs the admin key")
        return await call_next(request)


class RateLimits(BaseHTTPMiddleware):
    """Answers 429 with ``Retry-After`` to a caller over its endpoint class's rate (``rates``, by
    ``rate_class``); requests of no limited class pass uncounted."""

    def __init__(self, app: ASGIApp, rates: dict[str, RateLimit], keys: BearerKeys) -> None:
        super().__init__(app)
        self._rates = rates
        self._keys = keys

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        kind = rate_class(request.method, route_path(request.scope))
        limit = self._rates.get(kind) if kind is not None else None
        if limit is not None:
            host = request.client.host if request.client else None
            caller = caller_of(request.headers.get("authorization"), host, self._keys.enabled)
            if (wait_s := limit.take(caller)) is not None:
                response = error_response(
                    429, "rate_limited", f"too many {kind} requests from this key; retry after {wait_s} s"
                )
                response.headers["Retry-After"] = str(wait_s)
                return response
        return await call_next(request)


def install_guards(app: FastAPI, settings: Settings, thumbnails: MediaSigner) -> None:
    """Installs the guards; they run in this order: admission, so shed load costs no key check and
    reads no body; the key check; rate limits, so only callers with a valid key (or any, without
    keys) are counted; the body bound, so no body is read before the key is checked.
    ``thumbnails``: the signer whose live links open a thumbnail without a key."""
    keys = BearerKeys(settings.api_keys, settings.admin_key)
    limits, serve = settings.limits, settings.serve

    def max_body_bytes(path: str) -> int:
        return limits.max_image_bytes + MULTIPART_OVERHEAD_BYTES if path == IMAGE_SEARCH_PATH else MAX_BODY_BYTES

    # Each middleware added wraps the ones before it: added innermost first.
    app.add_middleware(BodyLimit, max_bytes_for=max_body_bytes)
    app.add_middleware(RateLimits, rates=rate_limits(limits), keys=keys)
    app.add_middleware(KeyCheck, keys=keys, thumbnails=thumbnails)
    app.add_middleware(
        Admission,
        max_in_flight=serve.api_max_in_flight,
        retry_after_s=serve.retry_after_s,
        max_scrapes=serve.metrics_max_in_flight,
    )
