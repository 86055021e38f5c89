"""The object store (MinIO/S3) through aiobotocore. Every call has a deadline (``S3Settings``), and
library errors are converted by what the caller should do (``storage.s3_errors``): missing objects
are ``None``/``ObjectGone``; refused credentials, throttling, 5xx, timeouts and dropped connections
``TransientError``; the other 4xx ``PermanentError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import aiobotocore.session
import botocore.exceptions
from aiobotocore.config import AioConfig

from storage.config import S3Settings
from storage.errors import LimitExceeded, TransientError
from storage.s3_errors import STORE_ERRORS, ObjectGone, convert_error, error_code, is_missing

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ObjectHead:
    bucket: str
    key: str
    size: int
    etag: str
    version_id: str | None
    content_type: str | None
    last_modified: datetime | None

    @property
    def version(self) -> str:
        """The content version: versionId on versioned buckets, else the ETag."""
        return self.version_id or self.etag


async def _within(seconds: float, setting: str, what: str, work: Awaitable[T]) -> T:
    """``work``, cancelled once it has run ``seconds``.

    Raises:
        TransientError: past the deadline, naming ``what`` and the setting that bounds it.
    """
    deadline = asyncio.timeout(seconds)
    try:
        async with deadline:
            return await work
    except TimeoutError as exc:
        if not deadline.expired():
            raise
        raise TransientError(f"{what}: no answer within {setting} ({seconds:g} s)") from exc


class ObjectStore:
    """Async object-store client. Use as ``async with ObjectStore(settings) as store: ...``."""

    def __init__(self, settings: S3Settings, endpoint_url: str | None = None) -> None:
        """``endpoint_url`` overrides the settings' endpoint (e.g. a public one for presigned links)."""
        self._settings = settings
        self._endpoint_url = endpoint_url or settings.endpoint_url
        self._stack = contextlib.AsyncExitStack()
        self._client: Any = None

    async def __aenter__(self) -> ObjectStore:
        s = self._settings
        session = aiobotocore.session.get_session()
        config = AioConfig(
            connect_timeout=s.connect_timeout_s,
            read_timeout=s.read_timeout_s,
            # botocore's "max_attempts" counts retries only; the setting counts every attempt.
            retries={"total_max_attempts": s.max_attempts, "mode": "standard"},
            signature_version="s3v4",
            s3={"addressing_style": "path"},
        )
        self._client = await self._stack.enter_async_context(
            session.create_client(
                "s3",
                endpoint_url=self._endpoint_url,
                region_name=s.region,
                aws_access_key_id=s.access_key.get_secret_value(),
                aws_secret_access_key=s.secret_key.get_secret_value(),
                config=config,
            )
        )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stack.aclose()

    async def head(self, bucket: str, key: str) -> ObjectHead | None:
        """The object's current state, or ``None`` when it doesn't exist.

        Raises:
            TransientError: also past ``head_timeout_s``.
            PermanentError.
        """
        what = f"HEAD s3://{bucket}/{key}"
        return await _within(self._settings.head_timeout_s, "head_timeout_s", what, self._head(bucket, key, what))

    async def _head(self, bucket: str, key: str, what: str) -> ObjectHead | None:
        try:
            resp = await self._client.head_object(Bucket=bucket, Key=key)
        except STORE_ERRORS as exc:
            if is_missing(exc):
                return None
            raise convert_error(exc, what) from exc
        return ObjectHead(
            bucket=bucket,
            key=key,
            size=int(resp.get("ContentLength", 0)),
            etag=str(resp.get("ETag", "")).strip('"'),
            version_id=resp.get("VersionId") if resp.get("VersionId") not in (None, "null") else None,
            content_type=resp.get("ContentType"),
            last_modified=resp.get("LastModified"),
        )

    async def download(self, head: ObjectHead, dest: Path, max_bytes: int, chunk_bytes: int = 1 << 20) -> int:
        """Write exactly the version ``head`` describes to ``dest``, stopping past ``max_bytes``.

        Raises:
            LimitExceeded: the object is larger than ``max_bytes``.
            ObjectGone: the object was deleted or replaced since ``head``.
            TransientError: also when the whole download takes longer than ``download_timeout_s``.
            PermanentError.
        """
        if head.size > max_bytes:
            raise LimitExceeded(f"exceeds max bytes {max_bytes} (object is {head.size} bytes)")
        what = f"GET s3://{head.bucket}/{head.key}"
        work = self._download(head, dest, max_bytes, chunk_bytes, what)
        return await _within(self._settings.download_timeout_s, "download_timeout_s", what, work)

    async def _download(self, head: ObjectHead, dest: Path, max_bytes: int, chunk_bytes: int, what: str) -> int:
        params: dict[str, Any] = {"Bucket": head.bucket, "Key": head.key}
        if head.version_id:
            params["VersionId"] = head.version_id
        elif head.etag:
            params["IfMatch"] = f'"{head.etag}"'
        written = 0
        try:
            resp = await self._client.get_object(**params)
            async with resp["Body"] as body:
                with dest.open("wb") as out:
                    while chunk := await body.read(chunk_bytes):
                        written += len(chunk)
                        if written > max_bytes:
                            raise LimitExceeded(f"exceeds max bytes {max_bytes} (read {written} bytes)")
                        out.write(chunk)
        except STORE_ERRORS as exc:
            if is_missing(exc) or (
                isinstance(exc, botocore.exceptions.ClientError) and error_code(exc)[0] == "PreconditionFailed"
            ):
                raise ObjectGone(f"{what}: the object changed or disappeared while being read") from exc
            raise convert_error(exc, what) from exc
        return written

    async def presign_get(self, bucket: str, key: str, ttl_s: int, content_type: str | None = None) -> str:
        """A short-lived GET link for one object (signed locally: no request is made); with
        ``content_type`` the store answers with that type whatever the object was stored with."""
        params = {"Bucket": bucket, "Key": key}
        if content_type is not None:
            params["ResponseContentType"] = content_type
        url: str = await self._client.generate_presigned_url("get_object", Params=params, ExpiresIn=ttl_s)
        return url

    async def presign_put(self, bucket: str, key: str, ttl_s: int, content_type: str, size_bytes: int) -> str:
        """A short-lived PUT link for one object of exactly ``size_bytes``, sent with ``Content-Type:
        content_type`` (both are signed: the store refuses any other). Signed locally: no request."""
        url: str = await self._client.generate_presigned_url(
            "put_object",
            Params={"Bucket": bucket, "Key": key, "ContentType": content_type, "ContentLength": size_bytes},
            ExpiresIn=ttl_s,
        )
        return url

    async def put(self, bucket: str, key: str, body: bytes, content_type: str | None = None) -> None:
        """Raises: TransientError (also past ``upload_timeout_s``), PermanentError."""
        what = f"PUT s3://{bucket}/{key}"
        extra = {"ContentType": content_type} if content_type else {}
        work = self._call(what, self._client.put_object(Bucket=bucket, Key=key, Body=body, **extra))
        await _within(self._settings.upload_timeout_s, "upload_timeout_s", what, work)

    async def _call(self, what: str, request: Awaitable[T]) -> T:
        try:
            return await request
        except STORE_ERRORS as exc:
            raise convert_error(exc, what) from exc

    async def ensure_bucket(self, bucket: str) -> None:
        """Create ``bucket`` unless it exists (each request bounded by ``head_timeout_s``)."""
        bound = self._settings.head_timeout_s
        what = f"HEAD bucket {bucket}"
        try:
            await _within(bound, "head_timeout_s", what, self._client.head_bucket(Bucket=bucket))
            return
        except STORE_ERRORS as exc:
            if not is_missing(exc):
                raise convert_error(exc, what) from exc
        what = f"create bucket {bucket}"
        try:
            await _within(bound, "head_timeout_s", what, self._client.create_bucket(Bucket=bucket))
        except botocore.exceptions.ClientError as exc:
            if error_code(exc)[0] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise convert_error(exc, what) from exc
        except STORE_ERRORS as exc:
            raise convert_error(exc, what) from exc

    async def is_versioned(self, bucket: str) -> bool:
        """Whether ``bucket`` keeps versions (enabled or suspended: versionIds may exist)."""
        what = f"GET versioning of {bucket}"
        work = self._call(what, self._client.get_bucket_versioning(Bucket=bucket))
        resp = await _within(self._settings.head_timeout_s, "head_timeout_s", what, work)
        return resp.get("Status") in ("Enabled", "Suspended")

    async def list_current(
        self, bucket: str, prefix: str = "", start_after: str | None = None
    ) -> AsyncIterator[list[ObjectHead]]:
        """The objects under ``prefix`` (after the key ``start_after``) as they are now, one listing
        page at a time, in key order.

        ``version`` is what HEAD would report: the latest versionId on versioned buckets (delete
        markers hide their object), else the ETag.

        Raises:
            TransientError: also when one page takes longer than ``list_page_timeout_s``.
            PermanentError.
        """
        versioned = await self.is_versioned(bucket)
        what = f"LIST s3://{bucket}/{prefix}"
        operation = "list_object_versions" if versioned else "list_objects_v2"
        bound = self._settings.list_page_timeout_s
        after: dict[str, str] = {}
        if start_after is not None:
            after = {"KeyMarker": start_after} if versioned else {"StartAfter": start_after}
        paginator = self._client.get_paginator(operation).paginate(Bucket=bucket, Prefix=prefix, **after)
        async with contextlib.aclosing(paginator.__aiter__()) as pages:
            while (page := await _within(bound, "list_page_timeout_s", what, self._next_page(pages, what))) is not None:
                yield _latest_versions(bucket, page) if versioned else _listed_objects(bucket, page)

    async def _next_page(self, pages: Any, what: str) -> dict[str, Any] | None:
        try:
            page: dict[str, Any] = await anext(pages)
        except StopAsyncIteration:
            return None
        except STORE_ERRORS as exc:
            raise convert_error(exc, what) from exc
        return page


def _listed_objects(bucket: str, page: dict[str, Any]) -> list[ObjectHead]:
    return [_listed(bucket, item, None) for item in page.get("Contents", [])]


def _latest_versions(bucket: str, page: dict[str, Any]) -> list[ObjectHead]:
    # A key whose latest version is a delete marker has no latest entry in "Versions".
    return [
        _listed(bucket, item, item.get("VersionId") if item.get("VersionId") not in (None, "null") else None)
        for item in page.get("Versions", [])
        if item.get("IsLatest")
    ]


def _listed(bucket: str, item: dict[str, Any], version_id: str | None) -> ObjectHead:
    """One entry of a listing page (listings carry no content type)."""
    return ObjectHead(
        bucket=bucket,
        key=item["Key"],
        size=int(item.get("Size", 0)),
        etag=str(item.get("ETag", "")).strip('"'),
        version_id=version_id,
        content_type=None,
        last_modified=item.get("LastModified"),
    )


class BlockingObjectStore:
    """An ``ObjectStore`` for synchronous callers on many threads: one client, kept open on an event
    loop of its own (a daemon thread), so calls don't pay for a new client and connection each time.

    Each call is cancelled at its deadline (``head_timeout_s``, ``download_timeout_s``); a caller
    waits at most ``cancel_grace_s`` longer, even if the client's loop is stuck.
    """

    def __init__(self, settings: S3Settings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._store: ObjectStore | None = None
        self._finalizer: weakref.finalize | None = None

    def _open(self) -> tuple[asyncio.AbstractEventLoop, ObjectStore]:
        s = self._settings
        with self._lock:
            if self._loop is None or self._store is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=_serve_loop, args=(loop,), name="s3-client", daemon=True).start()
                store = ObjectStore(s)
                try:
                    opening = asyncio.run_coroutine_threadsafe(store.__aenter__(), loop)
                    _wait(opening, "open the S3 client", "client_open_timeout_s", s.client_open_timeout_s)
                except BaseException:
                    loop.call_soon_threadsafe(loop.stop)
                    raise
                self._loop, self._store = loop, store
                # Closed with its owner: an aiohttp session collected open is a leak (and a warning).
                self._finalizer = weakref.finalize(self, _shut_down, loop, store, s.close_timeout_s)
            return self._loop, self._store

    def _run(self, what: str, setting: str, bound_s: float, make: Callable[[ObjectStore], Coroutine[Any, Any, T]]) -> T:
        loop, store = self._open()
        # The call cancels itself at ``bound_s``; the grace only covers a loop too busy to notice.
        future = asyncio.run_coroutine_threadsafe(make(store), loop)
        return _wait(future, what, setting, bound_s, self._settings.cancel_grace_s)

    def head(self, bucket: str, key: str) -> ObjectHead | None:
        """See ``ObjectStore.head``."""
        s = self._settings
        return self._run(f"HEAD s3://{bucket}/{key}", "head_timeout_s", s.head_timeout_s, lambda o: o.head(bucket, key))

    def download(self, head: ObjectHead, dest: Path, max_bytes: int) -> int:
        """See ``ObjectStore.download``."""
        what, bound_s = f"GET s3://{head.bucket}/{head.key}", self._settings.download_timeout_s
        return self._run(what, "download_timeout_s", bound_s, lambda o: o.download(head, dest, max_bytes))

    def close(self) -> None:
        """Close the client and stop its loop (it is reopened on the next call)."""
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()
            self._loop = self._store = self._finalizer = None


def _wait(future: concurrent.futures.Future[T], what: str, setting: str, bound_s: float, grace_s: float = 0.0) -> T:
    """The result of ``future``, waited for at most ``bound_s + grace_s``; past that it is cancelled.

    Raises:
        TransientError: naming ``what`` and the setting; or whatever the call raised.
    """
    done, _ = concurrent.futures.wait([future], timeout=bound_s + grace_s)
    if not done:
        future.cancel()
        raise TransientError(f"{what}: no answer within {setting} ({bound_s:g} s)")
    return future.result()


def _serve_loop(loop: asyncio.AbstractEventLoop) -> None:
    try:
        loop.run_forever()
    finally:
        loop.close()


def _shut_down(loop: asyncio.AbstractEventLoop, store: ObjectStore, timeout_s: float) -> None:
    if loop.is_running():
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(store.__aexit__(None, None, None), loop).result(timeout=timeout_s)
        loop.call_soon_threadsafe(loop.stop)
