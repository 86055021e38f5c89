"""What every ``vidx`` command shares: one-line failures, the settings object, JSON output, and the
HTTP API client (also used by the demo in ``infra.dev``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any, NoReturn

import typer

from pipeline.settings import Settings
from storage.errors import VidxError

#: How long one API call may take (a search embeds the query on a CPU).
HTTP_TIMEOUT_S = 60.0
WAIT_POLL_S = 2.0
WAIT_LIST_LIMIT = 1000


class CliError(VidxError):
    """Raised for a failure the command reports in one line."""


def fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(message if message.startswith("vidx") else f"vidx: {message}", err=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def errors() -> Iterator[None]:
    """Turns every expected failure into one line on stderr and exit status 1."""
    try:
        yield
    except VidxError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc))
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except typer.Exit:
        raise
    except Exception as exc:  # a library error we did not anticipate: still one line, no traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        fail(f"{type(exc).__name__}: {first}"[:300])


def settings_of(ctx: typer.Context) -> Settings:
    settings: Settings = ctx.obj
    return settings


# -- HTTP API -------------------------------------------------------------------------------------------


class ApiClient:
    """The vidx HTTP API; errors become one-line ``CliError``s.

    Sends the configured API key (``VIDX_API_KEY``, ``VIDX_API_KEYS``, ``VIDX_API_KEY_FILE``), else
    the one ``vidx up`` keeps under the state dir; ``admin=True`` sends the admin key instead.
    """

    def __init__(self, settings: Settings, admin: bool = False) -> None:
        import httpx

        from infra.dev.stack import client_key

        self.url = settings.api_url
        key = client_key(settings, admin=admin)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=HTTP_TIMEOUT_S)
        which = "VIDX_ADMIN_KEY or VIDX_ADMIN_KEY_FILE" if admin else "VIDX_API_KEY or VIDX_API_KEY_FILE"
        self._key_hint = f"sent {'a' if key else 'no'} key; set {which}, or use the state dir of 'vidx up'"

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.ConnectError as exc:
            raise CliError(f"vidx API not reachable at {self.url}: run 'vidx up'") from exc
        except httpx.TimeoutException as exc:
            raise CliError(f"vidx API at {self.url} did not answer within {HTTP_TIMEOUT_S:.0f}s") from exc
        except httpx.HTTPError as exc:
            raise CliError(f"vidx API at {self.url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                text = response.text.strip()
                message = text.splitlines()[0] if text else response.reason_phrase
            if response.status_code in (401, 403):
                message += f" ({self._key_hint})"
            raise CliError(f"{method} {path} failed ({response.status_code}): {message}")
        return response.json()


def hms(seconds: float) -> str:
    minutes, s = divmod(max(seconds, 0.0), 60)
    hours, minutes = divmod(int(minutes), 60)
    return f"{hours:02d}:{minutes:02d}:{s:04.1f}"


def format_moment(r: dict[str, Any]) -> str:
    """One line per moment: score, video, span, best second, playable link."""
    return (
        f"{r['score']:6.3f}  {r['uri']}  {hms(r['start_s'])}–{hms(r['end_s'])}  best {hms(r['ts_s'])}  {r['video_url']}"
    )


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))
