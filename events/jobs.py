"""Jobs on the task queue: what the EventRouter and the API submit and the IndexConsumer runs."""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from events.records import BucketEvent, EventKind
from storage.ids import s3_uri, video_id

#: Name of the task handler on the index queue.
INDEX_TASK = "index_video"


class JobOp(enum.StrEnum):
    INDEX = "index"
    DELETE = "delete"


class JobSource(enum.StrEnum):
    EVENT = "event"
    API = "api"
    RECONCILE = "reconcile"
    REPLAY = "replay"
    #: A backfill re-embedding an indexed video with the model being switched to (``pipeline.upkeep.backfill``).
    REINDEX = "reindex"
    #: A text job: read the words of a video whose frames are in (``pipeline.index.words``), on the
    #: text queue, submitted by the index job that settled the frames.
    TEXT = "text"


class IndexJob(BaseModel):
    """A request to bring one object's index in line with the object. A hint: the consumer looks at the
    object (a HEAD, or a fetch conditional on the event's ETag) before it acts."""

    model_config = ConfigDict(frozen=True)

    op: JobOp
    bucket: str
    key: str
    source: JobSource
    #: Version (versionId or ETag) the event reported; informational (the look at the object decides).
    hint_version: str | None = None
    #: The ETag and size a bucket event reported for an upload to an unversioned bucket. A first start's
    #: first round takes the object to be at them and fetches on the ETag (a conditional GET) instead of
    #: HEADing it first; None (any other job, a versioned bucket, a retry or a redelivery): it HEADs.
    hint_etag: str | None = None
    hint_size: int | None = None
    sequencer: str | None = None
    #: Set by a submitter that marks the row ``queued`` after the submit (``QueueingSink``): the job
    #: then writes the row even when it finds nothing to change (until a later round of it reads the row
    #: at a newer revision than its first read: ``pipeline.index.settle.Fence``), so a late mark loses to it.
    settle: bool = False
    submitted_at: datetime = Field(default_factory=lambda: datetime.now(UTC))

    @property
    def video_id(self) -> str:
        return video_id(self.bucket, self.key)

    @property
    def uri(self) -> str:
        return s3_uri(self.bucket, self.key)


class JobSink(Protocol):
    """Where jobs go: the task queue. ``submit`` returns the task id once the broker has the job.

    Raises:
        TransientError: the broker did not confirm the job.
    """

    def submit(self, job: IndexJob) -> str: ...


def job_for(event: BucketEvent) -> IndexJob:
    hinted = event.kind is EventKind.CREATED and not event.version_id and bool(event.etag) and event.size is not None
    return IndexJob(
        op=JobOp.INDEX if event.kind is EventKind.CREATED else JobOp.DELETE,
        bucket=event.bucket,
        key=event.key,
        source=JobSource.EVENT,
        hint_version=event.version_id or event.etag,
        # A version id fetches that version whether or not it is current: only an ETag is a check.
        hint_etag=event.etag if hinted else None,
        hint_size=event.size if hinted else None,
        sequencer=event.sequencer,
    )
