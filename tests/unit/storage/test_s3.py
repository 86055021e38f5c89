"""storage/s3.py: errors classed by what the caller should do (botocore errors built by hand), and
every wait bounded (the real aiobotocore client against local sockets that stall, drip or refuse)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiobotocore.session
import aiohttp
import botocore.exceptions
import pytest
from botocore.exceptions import ClientError
from pydantic import SecretStr, ValidationError

from storage.config import S3Settings
from storage.errors import PermanentError, TransientError
from storage.s3 import BlockingObjectStore, ObjectHead, ObjectStore
from storage.s3_errors import AccessRefused, ObjectGone, convert_error, is_missing

ACCESS_KEY = "AKIAROTATEDEXAMPLE01"
SECRET_KEY = "secret-never-logged-0123456789abcdef"
WHAT = "HEAD s3://videos/a.mp4"
#: The store's own message: not quoted either (it may echo request details).
STORE_TEXT = "store-says-0xdeadbeef"
HEAD = ObjectHead(
    bucket="videos", key="a.mp4", size=10, etag="e1", version_id=None, content_type="video/mp4", last_modified=None
)


def client_error(code: str, status: int | None, headers: dict[str, str] | None = None) -> ClientError:
    """A ClientError as botocore builds it from an answer (a HEAD answer has no body: code = status)."""
    meta: dict[str, Any] = {"HTTPHeaders": headers or {}}
    if status is not None:
        meta["HTTPStatusCode"] = status
    # S3 echoes the access key id (and the string it signed) in auth errors: never to be logged.
    error = {"Code": code, "Message": STORE_TEXT, "AWSAccessKeyId": ACCESS_KEY, "StringToSign": SECRET_KEY}
    return ClientError({"Error": error, "ResponseMetadata": meta}, "HeadObject")


# -- the error table --------------------------------------------------------------------------------

GONE: list[tuple[str, int | None]] = [
    ("NoSuchKey", 404),
    ("NoSuchVersion", 404),
    ("404", 404),  # a HEAD of a missing object: no body, no code
    ("NotFound", 404),
    ("NoSuchBucket", 404),
]
ACCESS: list[tuple[str, int | None]] = [
    ("AccessDenied", 403),
    ("InvalidAccessKeyId", 403),
    ("SignatureDoesNotMatch", 403),
    ("ExpiredToken", 400),
    ("InvalidToken", 400),
    ("InvalidTokenId", 403),  # MinIO's name for a bad session token
    ("TokenRefreshRequired", 400),
    ("AuthorizationHeaderMalformed", 400),
    ("AuthorizationQueryParametersError", 400),
    ("MissingSecurityHeader", 400),
    ("AllAccessDisabled", 403),
    ("RequestTimeTooSkewed", 403),
    ("UnauthorizedAccess", 401),
    ("403", 403),  # a HEAD refused: no body, no code
]
TRANSIENT: list[tuple[str, int | None]] = [
    ("SlowDown", 503),
    ("SlowDownRead", 503),
    ("ServiceUnavailable", 503),
    ("ServerBusy", 503),
    ("InternalError", 500),
    ("XMinioServerNotInitialized", 503),
    ("XMinioStorageFull", 507),
    ("SomethingNew", 502),  # any 5xx
    ("RequestTimeout", 400),  # AWS answers a stalled upload with a 400
    ("TooManyRequests", 429),
    ("OperationAborted", 409),
    ("PreconditionFailed", 412),
    ("400", 400),  # a HEAD 400 without a code: how AWS refuses an expired token on HEAD
    ("", None),  # no answer to go by
]
PERMANENT: list[tuple[str, int | None]] = [
    ("InvalidArgument", 400),
    ("InvalidRange", 416),
    ("InvalidBucketName", 400),
    ("KeyTooLongError", 400),
    ("MethodNotAllowed", 405),
    ("InvalidObjectState", 403),  # archived: a 403 that is not about credentials
    ("NotImplemented", 501),  # a 5xx that no retry fixes
]


@pytest.mark.parametrize(("code", "status"), GONE)
def test_missing_objects_are_gone(code: str, status: int) -> None:
    assert is_missing(client_error(code, status))


@pytest.mark.parametrize(("code", "status"), ACCESS + TRANSIENT + PERMANENT)
def test_other_answers_are_not_gone(code: str, status: int | None) -> None:
    assert not is_missing(client_error(code, status))


@pytest.mark.parametrize(("code", "status"), ACCESS)
def test_refused_access_is_transient_and_logged_without_credentials(
    code: str, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="storage.s3"):
        error = convert_error(client_error(code, status), WHAT)
    assert isinstance(error, AccessRefused) and isinstance(error, TransientError)
    assert WHAT in str(error) and code in str(error)
    [record] = [r for r in caplog.records if r.name == "storage.s3"]
    assert record.levelno == logging.WARNING
    assert WHAT in record.getMessage() and code in record.getMessage()
    for secret in (ACCESS_KEY, SECRET_KEY, STORE_TEXT):
        assert secret not in caplog.text and secret not in str(error)


def test_a_minio_head_refusal_is_named_by_its_header(caplog: pytest.LogCaptureFixture) -> None:
    # MinIO answers HEAD errors without a body but with the code in x-minio-error-code.
    with caplog.at_level(logging.WARNING, logger="storage.s3"):
        error = convert_error(client_error("403", 403, {"x-minio-error-code": "InvalidAccessKeyId"}), WHAT)
    assert isinstance(error, AccessRefused)
    assert "HTTP 403 InvalidAccessKeyId" in str(error) and "InvalidAccessKeyId" in caplog.text


@pytest.mark.parametrize(("code", "status"), TRANSIENT)
def test_throttling_restarts_and_server_errors_are_transient(code: str, status: int | None) -> None:
    error = convert_error(client_error(code, status), WHAT)
    assert type(error) is TransientError and str(error).startswith(f"{WHAT}: object store answered")


@pytest.mark.parametrize(("code", "status"), PERMANENT)
def test_other_client_errors_are_permanent(code: str, status: int) -> None:
    error = convert_error(client_error(code, status), WHAT)
    assert type(error) is PermanentError and code in str(error) and str(status) in str(error)


@pytest.mark.parametrize(
    "exc",
    [
        botocore.exceptions.EndpointConnectionError(endpoint_url="http://minio:9000"),
        botocore.exceptions.ConnectTimeoutError(endpoint_url="http://minio:9000"),
        botocore.exceptions.ReadTimeoutError(endpoint_url="http://minio:9000"),
        botocore.exceptions.ConnectionClosedError(endpoint_url="http://minio:9000"),
        botocore.exceptions.ResponseStreamingError(error="connection reset"),
        aiohttp.ClientPayloadError("body cut short"),
        ConnectionResetError(104, "reset by peer"),
        OSError(28, "no space left on device"),
        TimeoutError(),
    ],
)
def test_connection_errors_and_timeouts_are_transient(exc: Exception) -> None:
    error = convert_error(exc, WHAT)
    assert type(error) is TransientError and str(error) == f"{WHAT}: {type(exc).__name__}"


def test_missing_credentials_are_refused_access(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="storage.s3"):
        error = convert_error(botocore.exceptions.NoCredentialsError(), WHAT)
    assert isinstance(error, AccessRefused) and "NoCredentialsError" in caplog.text


def test_a_request_the_client_will_not_build_is_permanent() -> None:
    error = convert_error(botocore.exceptions.ParamValidationError(report="Invalid bucket name"), WHAT)
    assert type(error) is PermanentError


# -- the table through ObjectStore (a stand-in client) ----------------------------------------------


class RaisingClient:
    """An aiobotocore S3 client whose HEAD and GET raise ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def head_object(self, **params: Any) -> dict[str, Any]:
        raise self.error

    async def get_object(self, **params: Any) -> dict[str, Any]:
        raise self.error


@pytest.fixture
def stub_client(monkeypatch: pytest.MonkeyPatch) -> Callable[[Exception], None]:
    """Makes ``ObjectStore`` open a ``RaisingClient`` instead of a real one."""

    def use(error: Exception) -> None:
        class Session:
            def create_client(self, *args: Any, **kwargs: Any) -> contextlib.AbstractAsyncContextManager[Any]:
                @contextlib.asynccontextmanager
                async def opened() -> AsyncIterator[RaisingClient]:
                    yield RaisingClient(error)

                return opened()

        monkeypatch.setattr(aiobotocore.session, "get_session", Session)

    return use


async def _head_and_download(tmp_path: Path) -> tuple[Any, Any]:
    outcomes: list[Any] = []
    async with ObjectStore(S3Settings()) as store:
        for call in (lambda: store.head("videos", "a.mp4"), lambda: store.download(HEAD, tmp_path / "v", 100)):
            try:
                outcomes.append(await call())
            except Exception as exc:
                outcomes.append(exc)
    return outcomes[0], outcomes[1]


@pytest.mark.parametrize(("code", "status"), GONE)
def test_gone_is_none_on_head_and_object_gone_on_download(
    stub_client: Callable[[Exception], None], tmp_path: Path, code: str, status: int
) -> None:
    stub_client(client_error(code, status))
    head, download = asyncio.run(_head_and_download(tmp_path))
    assert head is None and isinstance(download, ObjectGone)


def test_a_version_replaced_during_download_is_object_gone(
    stub_client: Callable[[Exception], None], tmp_path: Path
) -> None:
    stub_client(client_error("PreconditionFailed", 412))  # If-Match on the ETag HEAD saw
    _, download = asyncio.run(_head_and_download(tmp_path))
    assert isinstance(download, ObjectGone)


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [("AccessDenied", 403, AccessRefused), ("SlowDown", 503, TransientError), ("InvalidArgument", 400, PermanentError)],
)
def test_head_and_download_raise_the_class_chained_to_the_cause(
    stub_client: Callable[[Exception], None], tmp_path: Path, code: str, status: int, kind: type[Exception]
) -> None:
    stub_client(client_error(code, status))
    head, download = asyncio.run(_head_and_download(tmp_path))
    for error, op in ((head, "HEAD"), (download, "GET")):
        assert type(error) is kind and str(error).startswith(f"{op} s3://videos/a.mp4: ")
        assert isinstance(error.__cause__, ClientError)


# -- deadlines, through the real client -------------------------------------------------------------


class LocalServer:
    """A TCP server on 127.0.0.1 that reads each request's head and hands the socket to ``answer``.
    ``release`` ends every stalled answer; ``dropped`` is set when a client hung up mid-answer."""

    def __init__(self, answer: Callable[[LocalServer, socket.socket, bytes], None]) -> None:
        self.answer = answer
        self.release = threading.Event()
        self.dropped = threading.Event()
        self.requests: list[bytes] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                head += chunk
            self.requests.append(head)
            try:
                self.answer(self, conn, head)
            except OSError:
                self.dropped.set()

    def close(self) -> None:
        self.release.set()
        self._listener.close()


@contextlib.contextmanager
def serving(answer: Callable[[LocalServer, socket.socket, bytes], None]) -> Iterator[LocalServer]:
    server = LocalServer(answer)
    try:
        yield server
    finally:
        server.close()


def silent(server: LocalServer, conn: socket.socket, head: bytes) -> None:
    server.release.wait(30)


def dripping(server: LocalServer, conn: socket.socket, head: bytes) -> None:
    """Answers a 100 MB object one byte every 20 ms: each read is quick, the whole never ends."""
    conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 100000000\r\nETag: "e1"\r\nContent-Type: video/mp4\r\n\r\n')
    while not server.release.wait(0.02):
        conn.sendall(b"x")


def refusing(server: LocalServer, conn: socket.socket, head: bytes) -> None:
    """MinIO's refusals: a HEAD names its code in a header, a GET in an XML body."""
    if head.startswith(b"HEAD"):
        conn.sendall(b"HTTP/1.1 403 Forbidden\r\nx-minio-error-code: InvalidAccessKeyId\r\nContent-Length: 0\r\n\r\n")
        return
    body = (
        "<?xml version='1.0' encoding='UTF-8'?><Error><Code>SignatureDoesNotMatch</Code>"
        f"<Message>The request signature we calculated does not match</Message><AWSAccessKeyId>{ACCESS_KEY}"
        f"</AWSAccessKeyId><StringToSign>{SECRET_KEY}</StringToSign></Error>"
    ).encode()
    conn.sendall(
        b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )


def versioning_then_silent(server: LocalServer, conn: socket.socket, head: bytes) -> None:
    if b"?versioning" in head.split(b"\r\n", 1)[0]:
        body = b'<VersioningConfiguration xmlns="http://s3.amazonaws.com/doc/2006-03-01/"/>'
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        return
    silent(server, conn, head)


def settings_for(server: LocalServer, **bounds: float) -> S3Settings:
    # The client's own per-read timeout is far away: only the call's deadline can end these calls.
    return S3Settings.model_validate(
        {
            "endpoint_url": f"http://127.0.0.1:{server.port}",
            "access_key": SecretStr(ACCESS_KEY),
            "secret_key": SecretStr(SECRET_KEY),
            "read_timeout_s": 30,
            "max_attempts": 1,
            **bounds,
        }
    )


async def _head(settings: S3Settings) -> ObjectHead | None:
    async with ObjectStore(settings) as store:
        return await store.head("videos", "a.mp4")


def test_a_head_without_an_answer_fails_at_head_timeout() -> None:
    with serving(silent) as server:
        started = time.monotonic()
        with pytest.raises(
            TransientError, match=r"HEAD s3://videos/a\.mp4: no answer within head_timeout_s \(0\.3 s\)"
        ):
            asyncio.run(_head(settings_for(server, head_timeout_s=0.3)))
        assert time.monotonic() - started < 5


def test_a_dripping_download_fails_at_download_timeout_and_hangs_up(tmp_path: Path) -> None:
    with serving(dripping) as server:
        store = BlockingObjectStore(settings_for(server, download_timeout_s=0.5))
        try:
            started = time.monotonic()
            with pytest.raises(TransientError, match=r"GET s3://videos/a\.mp4: no answer within download_timeout_s"):
                store.download(HEAD, tmp_path / "a.mp4", max_bytes=10**9)
            assert 0.5 <= time.monotonic() - started < 5
            # The download was cancelled, not abandoned: its connection closes and nothing keeps reading.
            assert server.dropped.wait(5)
            assert 0 < (tmp_path / "a.mp4").stat().st_size < 1000
        finally:
            store.close()


def test_a_listing_page_without_an_answer_fails_at_list_page_timeout() -> None:
    async def first_page(settings: S3Settings) -> None:
        async with ObjectStore(settings) as store:
            async for _ in store.list_current("videos"):
                pass

    with serving(versioning_then_silent) as server:
        with pytest.raises(TransientError, match=r"LIST s3://videos/: no answer within list_page_timeout_s \(0\.3 s\)"):
            asyncio.run(first_page(settings_for(server, list_page_timeout_s=0.3)))
        assert any(b"list-type=2" in r for r in server.requests)


def test_a_blocking_call_waits_at_most_its_deadline_and_the_grace_even_on_a_stuck_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    unblock = threading.Event()

    async def stuck(self: ObjectStore, bucket: str, key: str) -> ObjectHead | None:
        unblock.wait(10)  # blocks the client's loop thread: the call can't even be cancelled
        return None

    monkeypatch.setattr(ObjectStore, "head", stuck)
    store = BlockingObjectStore(S3Settings(head_timeout_s=0.2, cancel_grace_s=0.3))
    try:
        started = time.monotonic()
        with pytest.raises(
            TransientError, match=r"HEAD s3://videos/a\.mp4: no answer within head_timeout_s \(0\.2 s\)"
        ):
            store.head("videos", "a.mp4")
        assert 0.5 <= time.monotonic() - started < 3
    finally:
        unblock.set()
        store.close()


def test_refusals_through_the_client_are_transient_and_logged_without_credentials(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with serving(refusing) as server, caplog.at_level(logging.WARNING, logger="storage.s3"):
        store = BlockingObjectStore(settings_for(server))
        try:
            with pytest.raises(AccessRefused, match="HTTP 403 InvalidAccessKeyId"):
                store.head("videos", "a.mp4")
            with pytest.raises(AccessRefused, match="HTTP 403 SignatureDoesNotMatch"):
                store.download(HEAD, tmp_path / "a.mp4", max_bytes=100)
        finally:
            store.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "storage.s3"]
    assert len(warnings) == 2 and "HEAD s3://videos/a.mp4" in warnings[0] and "GET s3://videos/a.mp4" in warnings[1]
    assert ACCESS_KEY not in caplog.text and SECRET_KEY not in caplog.text


def test_the_client_gets_the_connect_and_read_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    create_client = aiobotocore.session.AioSession.create_client

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return create_client(self, *args, **kwargs)

    monkeypatch.setattr(aiobotocore.session.AioSession, "create_client", spy)

    async def open_and_close() -> None:
        async with ObjectStore(S3Settings(connect_timeout_s=1.5, read_timeout_s=7, max_attempts=2)):
            pass

    asyncio.run(open_and_close())
    config = seen["config"]
    assert (config.connect_timeout, config.read_timeout) == (1.5, 7)
    assert config.retries["mode"] == "standard" and config.retries["total_max_attempts"] == 2


@pytest.mark.parametrize(
    "setting",
    ["connect_timeout_s", "read_timeout_s", "head_timeout_s", "download_timeout_s", "list_page_timeout_s"],
)
def test_timeouts_must_be_positive(setting: str) -> None:
    with pytest.raises(ValidationError):
        S3Settings.model_validate({setting: 0})
