"""How a ``vidx`` command fails: one line on stderr that names the failing component and how to fix it,
a non-zero exit status, never a traceback and never a credential.

A command names the services it contacts (``errors(rabbitmq(settings), minio(settings))``); they are
probed before the command starts, and again when it fails, so that "connection refused" deep inside a
library becomes "RabbitMQ is not reachable at 127.0.0.1:5672 — run `vidx up`, or set VIDX_AMQP__URL".
"""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NoReturn
from urllib.parse import urlparse

import typer

from pipeline.settings import Settings
from storage.errors import PermanentError, VidxError

#: How long a probe waits for a TCP connection to a service.
PROBE_TIMEOUT_S = 3.0
#: Longest failure line (a library's message can be a page long).
MAX_LINE_CHARS = 300

#: ``scheme://user:password@`` in any text: the user info is replaced before the text is printed.
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s]*@")
#: Exception types (by name, along the cause chain) that mean the broker refused the login.
_AMQP_REFUSED = frozenset(
    {"ProbableAuthenticationError", "AuthenticationError", "ProbableAccessDeniedError", "AccessRefused"}
)
#: S3 error codes that mean the object store refused the credentials.
_S3_REFUSED = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied")
#: Top-level modules whose exceptions come from talking to the broker / the object store.
_AMQP_MODULES = frozenset({"pika", "amqp", "kombu", "celery"})
_S3_MODULES = frozenset({"minio", "urllib3", "botocore", "aiobotocore", "lancedb", "lance"})


class CliError(VidxError):
    """Raised for a failure the command reports in one line (the message says what to do)."""


class ApiError(CliError):
    """Raised when the vidx API can't be reached or refuses a request; ``status`` is the HTTP status
    (None when no answer came)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Component:
    """A service a command contacts, as people know it: its name, where it is (never credentials),
    the settings that point at it and the ones that hold its credentials."""

    name: str
    host: str
    port: int
    setting: str
    credentials: str
    kind: str

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def reachable(self, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout_s):
                return True
        except OSError:
            return False

    def unreachable(self) -> str:
        return f"{self.name} is not reachable at {self.address} — run `vidx up`, or set {self.setting}"

    def refused(self, detail: str) -> str:
        return f"{self.name} at {self.address} refused the credentials ({detail}) — check {self.credentials}"

    def failed(self, message: str) -> str:
        return f"{self.name} at {self.address} failed: {message} — see `vidx status` and its log"


def _component(url: str, default_port: int, **fields: str) -> Component:
    parsed = urlparse(url)
    return Component(host=parsed.hostname or "127.0.0.1", port=parsed.port or default_port, **fields)


def rabbitmq(settings: Settings) -> Component:
    url = settings.amqp.url.get_secret_value()
    return _component(
        url,
        5671 if url.startswith("amqps:") else 5672,
        name="RabbitMQ",
        setting="VIDX_AMQP__URL",
        credentials="the user, password and vhost in VIDX_AMQP__URL",
        kind="amqp",
    )


def minio(settings: Settings) -> Component:
    url = settings.s3.endpoint_url
    return _component(
        url,
        443 if url.startswith("https:") else 80,
        name="MinIO",
        setting="VIDX_S3__ENDPOINT_URL",
        credentials="VIDX_S3__ACCESS_KEY and VIDX_S3__SECRET_KEY",
        kind="s3",
    )


def redact(text: str) -> str:
    """``text`` without the user info of any URL in it (AMQP URLs carry passwords)."""
    return _USERINFO.sub(r"\1***@", text)


def fail(message: str, code: int = 1) -> NoReturn:
    line = redact(" ".join(message.split()))[:MAX_LINE_CHARS]
    typer.echo(line if line.startswith("vidx") else f"vidx: {line}", err=True)
    raise typer.Exit(code)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def explain(exc: BaseException, uses: tuple[Component, ...]) -> str:
    """The one line for an unexpected failure of a command that contacts ``uses``."""
    by_kind = {c.kind: c for c in uses}
    chain = list(_chain(exc))
    for e in chain:
        if "amqp" in by_kind and type(e).__name__ in _AMQP_REFUSED:
            return by_kind["amqp"].refused(type(e).__name__)
        code = getattr(e, "code", None)
        text = f"{code} {e}" if isinstance(code, str) else str(e)
        for marker in _S3_REFUSED:
            if "s3" in by_kind and marker in text:
                return by_kind["s3"].refused(marker)
    for component in uses:
        if not component.reachable():
            return component.unreachable()
    if isinstance(exc, OSError):
        message = f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc)
    elif isinstance(exc, VidxError):
        message = str(exc)
    else:
        message = f"{type(exc).__name__}: {_first_line(exc)}"
    modules = {type(e).__module__.split(".")[0] for e in chain}
    for kind, owned in (("amqp", _AMQP_MODULES), ("s3", _S3_MODULES)):
        if kind in by_kind and modules & owned:
            return by_kind[kind].failed(message)
    if len(uses) == 1 and not isinstance(exc, OSError):
        return uses[0].failed(message)
    return message


@contextlib.contextmanager
def errors(*uses: Component) -> Iterator[None]:
    """Probes ``uses`` first, then turns every failure of the block into one line on stderr and exit
    status 1 (130 when interrupted)."""
    for component in uses:
        if not component.reachable():
            fail(component.unreachable())
    try:
        yield
    except typer.Exit:
        raise
    except (CliError, PermanentError) as exc:  # their message already says what to do
        fail(str(exc))
    except KeyboardInterrupt:
        fail("interrupted", 130)
    except Exception as exc:  # a library error: still one line, naming the component, no traceback
        fail(explain(exc, uses))
