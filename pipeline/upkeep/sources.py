"""What the checker reads, as protocols it holds the bucket, the catalog and the frames against each
other through, and the bucket listing over S3 (``S3PageLister``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from typing import Protocol

from storage.catalog import VideoRecord
from storage.config import S3Settings
from storage.frames import FrameSummary
from storage.s3 import ObjectHead, ObjectStore


class PageLister(Protocol):
    def pages(self, bucket: str, prefix: str, start_after: str | None) -> Iterator[list[ObjectHead]]: ...


class CatalogReader(Protocol):
    def scan(self, uri_from: str, uri_to: str, *, include_from: bool) -> Iterator[VideoRecord]: ...

    def in_flight_since(self, before: datetime) -> list[VideoRecord]: ...


class FrameReader(Protocol):
    def summaries_in(self, uri_from: str, uri_to: str, *, include_from: bool) -> dict[str, FrameSummary]: ...


class S3PageLister:
    """``PageLister`` over aiobotocore, driven from synchronous code on one private event loop."""

    def __init__(self, s3: S3Settings) -> None:
        self._s3 = s3

    def pages(self, bucket: str, prefix: str, start_after: str | None = None) -> Iterator[list[ObjectHead]]:
        with asyncio.Runner() as runner:
            store = ObjectStore(self._s3)
            runner.run(store.__aenter__())
            try:
                listing = store.list_current(bucket, prefix, start_after)
                while True:
                    page = runner.run(_next_page(listing))
                    if page is None:
                        return
                    yield page
            finally:
                runner.run(store.__aexit__(None, None, None))


async def _next_page(listing: AsyncIterator[list[ObjectHead]]) -> list[ObjectHead] | None:
    try:
        return await anext(listing)
    except StopAsyncIteration:
        return None
