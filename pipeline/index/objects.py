"""Where index jobs read videos from: the object store as the indexer sees it, and its S3 form with
bounded concurrent downloads."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Protocol

from pipeline.settings import LimitSettings
from storage.config import S3Settings
from storage.errors import TransientError
from storage.s3 import BlockingObjectStore, ObjectHead


class ObjectSource(Protocol):
    """The object store as the indexer sees it (synchronous: jobs run in worker threads)."""

    def head(self, bucket: str, key: str) -> ObjectHead | None: ...

    def download(self, head: ObjectHead, dest: Path) -> int: ...


class S3ObjectSource:
    """``ObjectSource`` over one long-lived aiobotocore client (``BlockingObjectStore``). At most
    ``limits.max_concurrent_downloads`` downloads run at once through one source (one per consumer
    process), each bounded by ``limits.max_bytes``."""

    def __init__(self, s3: S3Settings, limits: LimitSettings) -> None:
        self._store = BlockingObjectStore(s3)
        self._limits = limits
        self._download_slots = threading.BoundedSemaphore(limits.max_concurrent_downloads)

    def head(self, bucket: str, key: str) -> ObjectHead | None:
        return self._store.head(bucket, key)

    def download(self, head: ObjectHead, dest: Path) -> int:
        """Download ``head``'s version to ``dest`` once a download slot is free.

        Raises:
            TransientError: no slot within ``download_slot_wait_s``, or the store's transient errors.
            LimitExceeded: the object is larger than ``max_bytes``.
            PermanentError.
        """
        limits = self._limits
        if not self._download_slots.acquire(timeout=limits.download_slot_wait_s):
            raise TransientError(
                f"no download slot within {limits.download_slot_wait_s:g}s "
                f"(max concurrent downloads {limits.max_concurrent_downloads})"
            )
        try:
            return self._store.download(head, dest, limits.max_bytes)
        finally:
            self._download_slots.release()
