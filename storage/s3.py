"""The object store (MinIO/S3) through aiobotocore. botocore errors are converted here:
missing objects are ``None``/``ObjectGone``, throttling/5xx/timeouts ``TransientError``,
the rest ``PermanentError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import aiobotocore.session
import botocore.exceptions
from aiobotocore.config import AioConfig

from storage.config import S3Settings
from storage.errors import LimitExceeded, PermanentError, TransientError

log = logging.getLogger(__name__)

T = TypeVar("T")

_MISSING = {"404", "NoSuchKey", "NotFound", "NoSuchVersion"}
_TRANSIENT = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "PreconditionFailed",
    "XMinioServerNotInitialized",
    "XMinioReadQuorum",
    "XMinioWriteQuorum",
    "412",
    "503",
    "500",
}


class ObjectGone(TransientError):
    """Raised when an object disappeared (or changed version) while it was being read. Transient:
    the retry HEADs the object again and indexes or removes whatever is there now."""


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


def _convert(exc: Exception, what: str) -> Exception:
    if isinstance(exc, botocore.exceptions.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        if code in _TRANSIENT or status in _TRANSIENT or status.startswith("5"):
            return TransientError(f"{what}: object store answered {code or status}")
        return PermanentError(f"{what}: object store answered {code or status}")
    if isinstance(exc, botocore.exceptions.BotoCoreError | OSError | TimeoutError):
        return TransientError(f"{what}: {type(exc).__name__}")
    return exc


def _is_missing(exc: Exception) -> bool:
    if not isinstance(exc, botocore.exceptions.ClientError):
        return False
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return code in _MISSING or status == "404"


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
            retries={"max_attempts": s.max_attempts, "mode": "standard"},
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
            TransientError, PermanentError.
        """
        try:
            resp = await self._client.head_object(Bucket=bucket, Key=key)
        except Exception as exc:
            if _is_missing(exc):
                return None
            raise _convert(exc, f"HEAD s3://{bucket}/{key}") from exc
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
            TransientError, PermanentError.
        """
        if head.size > max_bytes:
            raise LimitExceeded(f"exceeds max bytes {max_bytes} (object is {head.size} bytes)")
        params: dict[str, Any] = {"Bucket": head.bucket, "Key": head.key}
        if head.version_id:
            params["VersionId"] = head.version_id
        elif head.etag:
            params["IfMatch"] = f'"{head.etag}"'
        what = f"GET s3://{head.bucket}/{head.key}"
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
        except LimitExceeded:
            raise
        except Exception as exc:
            if _is_missing(exc) or (
                isinstance(exc, botocore.exceptions.ClientError)
                and str(exc.response.get("Error", {}).get("Code")) == "PreconditionFailed"
            ):
                raise ObjectGone(f"{what}: the object changed or disappeared while being read") from exc
            raise _convert(exc, what) from exc
        return written

    async def presign_get(self, bucket: str, key: str, ttl_s: int) -> str:
        """A short-lived GET link for one object."""
        url: str = await self._client.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=ttl_s
        )
        return url

    async def put(self, bucket: str, key: str, body: bytes, content_type: str | None = None) -> None:
        extra = {"ContentType": content_type} if content_type else {}
        try:
            await self._client.put_object(Bucket=bucket, Key=key, Body=body, **extra)
        except Exception as exc:
            raise _convert(exc, f"PUT s3://{bucket}/{key}") from exc

    async def ensure_bucket(self, bucket: str) -> None:
        """Create ``bucket`` unless it exists."""
        try:
            await self._client.head_bucket(Bucket=bucket)
            return
        except botocore.exceptions.ClientError as exc:
            if not _is_missing(exc):
                raise _convert(exc, f"HEAD bucket {bucket}") from exc
        try:
            await self._client.create_bucket(Bucket=bucket)
        except botocore.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise _convert(exc, f"create bucket {bucket}") from exc

    async def is_versioned(self, bucket: str) -> bool:
        """Whether ``bucket`` keeps versions (enabled or suspended: versionIds may exist)."""
        try:
            resp = await self._client.get_bucket_versioning(Bucket=bucket)
        except Exception as exc:
            raise _convert(exc, f"GET versioning of {bucket}") from exc
        return resp.get("Status") in ("Enabled", "Suspended")

    async def list_current(self, bucket: str, prefix: str = "") -> AsyncIterator[list[ObjectHead]]:
        """The objects under ``prefix`` as they are now, one listing page at a time, in key order.

        ``version`` is what HEAD would report: the latest versionId on versioned buckets (delete
        markers hide their object), else the ETag.

        Raises:
            TransientError, PermanentError.
        """
        versioned = await self.is_versioned(bucket)
        what = f"LIST s3://{bucket}/{prefix}"
        try:
            if not versioned:
                async for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                    yield [
                        ObjectHead(
                            bucket=bucket,
                            key=item["Key"],
                            size=int(item.get("Size", 0)),
                            etag=str(item.get("ETag", "")).strip('"'),
                            version_id=None,
                            content_type=None,
                            last_modified=item.get("LastModified"),
                        )
                        for item in page.get("Contents", [])
                    ]
                return
            async for page in self._client.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=prefix):
                # A key whose latest version is a delete marker has no latest entry in "Versions".
                yield [
                    ObjectHead(
                        bucket=bucket,
                        key=item["Key"],
                        size=int(item.get("Size", 0)),
                        etag=str(item.get("ETag", "")).strip('"'),
                        version_id=item.get("VersionId") if item.get("VersionId") not in (None, "null") else None,
                        content_type=None,
                        last_modified=item.get("LastModified"),
                    )
                    for item in page.get("Versions", [])
                    if item.get("IsLatest")
                ]
        except botocore.exceptions.ClientError as exc:
            raise _convert(exc, what) from exc


class BlockingObjectStore:
    """An ``ObjectStore`` for synchronous callers on many threads: one client, kept open on an event
    loop of its own (a daemon thread), so calls don't pay for a new client and connection each time.

    Every call is bounded by the client's connect/read timeouts and retry budget (``S3Settings``).
    """

    def __init__(self, settings: S3Settings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._store: ObjectStore | None = None
        self._finalizer: weakref.finalize | None = None

    def _run(self, make: Callable[[ObjectStore], Coroutine[Any, Any, T]]) -> T:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=_serve_loop, args=(loop,), name="s3-client", daemon=True).start()
                store = ObjectStore(self._settings)
                try:
                    asyncio.run_coroutine_threadsafe(store.__aenter__(), loop).result()
                except BaseException:
                    loop.call_soon_threadsafe(loop.stop)
                    raise
                self._loop, self._store = loop, store
                # Closed with its owner: an aiohttp session collected open is a leak (and a warning).
                self._finalizer = weakref.finalize(self, _shut_down, loop, store)
        assert self._store is not None
        return asyncio.run_coroutine_threadsafe(make(self._store), self._loop).result()

    def head(self, bucket: str, key: str) -> ObjectHead | None:
        """See ``ObjectStore.head``."""
        return self._run(lambda store: store.head(bucket, key))

    def download(self, head: ObjectHead, dest: Path, max_bytes: int) -> int:
        """See ``ObjectStore.download``."""
        return self._run(lambda store: store.download(head, dest, max_bytes))

    def close(self) -> None:
        """Close the client and stop its loop (it is reopened on the next call)."""
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()
            self._loop = self._store = self._finalizer = None


def _serve_loop(loop: asyncio.AbstractEventLoop) -> None:
    try:
        loop.run_forever()
    finally:
        loop.close()


def _shut_down(loop: asyncio.AbstractEventLoop, store: ObjectStore) -> None:
    if loop.is_running():
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(store.__aexit__(None, None, None), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
