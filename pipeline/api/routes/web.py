"""The web page (``GET /`` and its assets under ``/ui/``): plain HTML/JS/CSS from
``pipeline/api/webui`` (no CDN, no build step). Its uploads go through ``POST /v1/uploads``
(``pipeline.api.routes.uploads``)."""

from __future__ import annotations

from importlib import resources
from urllib.parse import urlsplit

from fastapi import APIRouter, HTTPException
from fastapi.responses import Response

from pipeline.settings import Settings

#: The page's files and their media types: nothing else under /ui/ is served.
ASSETS = {
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
PAGE_PATHS = frozenset({"/", "/index.html"})
ASSET_PREFIX = "/ui/"


def is_page_path(path: str) -> bool:
    """The page and its assets: served without a key (they hold no data; the page asks for one).
    ``""`` is the app's mount point without its slash (a route prefix such as ``/vidx``)."""
    return path in PAGE_PATHS or path == "" or (path.startswith(ASSET_PREFIX) and path[len(ASSET_PREFIX) :] in ASSETS)


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def content_security_policy(settings: Settings) -> str:
    """Only this origin, plus the object store for playing and uploading videos."""
    s3 = _origin(settings.s3.public_endpoint_url or settings.s3.endpoint_url)
    return "; ".join(
        [
            "default-src 'self'",
            "img-src 'self' data:",
            f"media-src 'self' {s3}",
            f"connect-src 'self' {s3}",
            "style-src 'self'",
            "script-src 'self'",
            "object-src 'none'",
            "base-uri 'none'",
            "form-action 'self'",
            "frame-ancestors 'none'",
        ]
    )


def _read(name: str) -> bytes:
    return resources.files("pipeline.api").joinpath("webui", name).read_bytes()


def web_router(settings: Settings) -> APIRouter:
    """The page and its assets (the key check lets them through without a key)."""
    router = APIRouter()
    csp = content_security_policy(settings)
    page_headers = {
        "Cache-Control": "no-cache",
        "Content-Security-Policy": csp,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }

    @router.get("/", include_in_schema=False)
    @router.get("/index.html", include_in_schema=False)
    async def page() -> Response:
        return Response(_read("index.html"), media_type="text/html; charset=utf-8", headers=page_headers)

    @router.get(ASSET_PREFIX + "{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            raise HTTPException(404, f"no asset {name}")
        headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
        return Response(_read(name), media_type=ASSETS[name], headers=headers)

    return router
