"""``POST /v1/index``: queue one video in a configured bucket for indexing."""

from __future__ import annotations

import asyncio
from typing import Protocol

from fastapi import APIRouter
from pydantic import BaseModel

from events.jobs import IndexJob, JobOp, JobSource
from storage.catalog import VideoStatus
from storage.ids import parse_s3_uri


class JobSubmitter(Protocol):
    def submit(self, job: IndexJob) -> str: ...


class IndexRequest(BaseModel):
    uri: str


class IndexAccepted(BaseModel):
    video_id: str
    task_id: str
    status: str


def index_router(buckets: list[str], jobs: JobSubmitter) -> APIRouter:
    """``POST /v1/index`` over ``jobs``: only ``s3://`` URIs in ``buckets`` are accepted (400 otherwise)."""
    router = APIRouter()

    @router.post("/v1/index", status_code=202)
    async def index(body: IndexRequest) -> IndexAccepted:
        bucket, key = parse_s3_uri(body.uri, buckets)
        job = IndexJob(op=JobOp.INDEX, bucket=bucket, key=key, source=JobSource.API)
        task_id = await asyncio.to_thread(jobs.submit, job)
        return IndexAccepted(video_id=job.video_id, task_id=task_id, status=VideoStatus.QUEUED.value)

    return router
