"""What every ``vidx`` command shares: the settings object and the HTTP API client (also used by the
demo in ``infra.dev``). One-line failures live in ``pipeline.cli.errors``, output in ``pipeline.cli.output``."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import typer

from pipeline.cli.errors import ApiError, CliError
from pipeline.settings import Settings
from storage.sampling import hms

__all__ = [
    "ADMIN_KEY_FILE",
    "API_KEY_FILE",
    "HTTP_TIMEOUT_S",
    "ApiClient",
    "ApiError",
    "CliError",
    "client_key",
    "format_moment",
    "minio_client",
    "settings_of",
]

#: How long one API call may take (a search embeds the query on a CPU).
HTTP_TIMEOUT_S = 60.0
#: Where the API's address comes from (``settings.api_url``).
API_SETTINGS = "VIDX_SERVE__HOST / VIDX_SERVE__PORT"
#: The key files ``vidx up`` makes under the state dir, read by clients when no key is configured.
API_KEY_FILE = "api-key"
ADMIN_KEY_FILE = "admin-key"


def settings_of(ctx: typer.Context) -> Settings:
    settings: Settings = ctx.obj
    return settings


def client_key(settings: Settings, admin: bool = False) -> str | None:
    """The key a client of the API sends: the configured one, else the key file under the state dir
    (``API_KEY_FILE``, ``ADMIN_KEY_FILE``), else None.

    Raises CliError when a key file exists but can't be read.
    """
    root = settings.state_dir.resolve()
    if admin:
        candidates: list[Any] = [settings.admin_key, root / ADMIN_KEY_FILE]
    else:
        first = settings.api_keys[0] if settings.api_keys else None
        candidates = [first, root / API_KEY_FILE, settings.admin_key, root / ADMIN_KEY_FILE]
    for candidate in candidates:
        if candidate is None:
            continue
        if not isinstance(candidate, Path):
            key: str = candidate.get_secret_value()
            return key
        if candidate.exists():
            try:
                return candidate.read_text(encoding="utf-8").strip() or None
            except OSError as exc:
                raise CliError(f"could not read the API key in {candidate}: {exc.strerror}") from exc
    return None


def minio_client(settings: Settings) -> Any:
    """A MinIO client for the configured object store (uploads, bucket set-up)."""
    from minio import Minio

    s3 = settings.s3
    parsed = urlparse(s3.endpoint_url)
    return Minio(
        parsed.netloc,
        access_key=s3.access_key.get_secret_value(),
        secret_key=s3.secret_key.get_secret_value(),
        secure=parsed.scheme == "https",
        region=s3.region,
    )


# -- HTTP API -------------------------------------------------------------------------------------------


class ApiClient:
    """The vidx HTTP API; every failure becomes a one-line ``ApiError`` naming the API and the fix.

    Sends the configured API key (``VIDX_API_KEY``, ``VIDX_API_KEYS``, ``VIDX_API_KEY_FILE``), else
    the one ``vidx up`` keeps under the state dir; ``admin=True`` sends the admin key instead.
    """

    def __init__(self, settings: Settings, admin: bool = False) -> None:
        import httpx

        self.url = settings.api_url
        key = client_key(settings, admin=admin)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=HTTP_TIMEOUT_S)
        which = "VIDX_ADMIN_KEY or VIDX_ADMIN_KEY_FILE" if admin else "VIDX_API_KEY or VIDX_API_KEY_FILE"
        self._key_hint = f"sent {'a' if key else 'no'} key — set {which}, or run `vidx up`, which makes one"

    def unreachable(self) -> str:
        return f"the vidx API is not reachable at {self.url} — run `vidx up`, or set {API_SETTINGS}"

    def request(self, method: str, path: str, *, timeout_s: float = HTTP_TIMEOUT_S, **kwargs: Any) -> Any:
        """The decoded JSON answer. Raises ApiError (``status`` None when no answer came in ``timeout_s``)."""
        import httpx

        try:
            response = self._client.request(method, path, timeout=timeout_s, **kwargs)
        except httpx.ConnectError as exc:
            raise ApiError(self.unreachable()) from exc
        except httpx.TimeoutException as exc:
            raise ApiError(
                f"the vidx API at {self.url} did not answer {method} {path} within {timeout_s:.0f}s — see `vidx status`"
            ) from exc
        except httpx.HTTPError as exc:
            raise ApiError(f"the vidx API at {self.url} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                text = response.text.strip()
                message = text.splitlines()[0] if text else response.reason_phrase
            status = response.status_code
            if status in (401, 403):
                raise ApiError(f"the vidx API refused {method} {path} ({status}: {message}): {self._key_hint}", status)
            hint = " — retry later, or see `vidx status`" if status >= 500 else ""
            raise ApiError(f"the vidx API answered {status} to {method} {path}: {message}{hint}", status)
        try:
            return response.json()
        except ValueError as exc:
            raise ApiError(f"the vidx API at {self.url} answered {method} {path} with no JSON", None) from exc


def format_moment(r: dict[str, Any]) -> str:
    """One line per moment: score, video, span, best second, playable link."""
    return (
        f"{r['score']:6.3f}  {r['uri']}  {hms(r['start_s'], 1)}–{hms(r['end_s'], 1)}  "
        f"best {hms(r['ts_s'], 1)}  {r['video_url']}"
    )
