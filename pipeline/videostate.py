"""The per-video state machine over the catalog: each transition is one compare-and-set on the
revision the caller read (``Catalog.write``), so no interleaving of jobs can write over a change it
did not see. docs/architecture.md draws the states and who moves them.

A transition returns the row as written, or None when another writer changed the row first: the
caller reads again and decides anew.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from events.jobs import IndexJob, JobSink
from storage.catalog import IN_FLIGHT, Catalog, VideoRecord, VideoStatus
from storage.errors import TransientError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Attempt:
    """Who is running a job: the task id (stable across retries and redeliveries) and the consumer
    process (``holder``) running it now."""

    task_id: str
    holder: str


class VideoStates:
    """The transitions of ``videos`` rows (see the module docstring)."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def read(self, video_id: str) -> VideoRecord | None:
        return self.catalog.get(video_id)

    def queue(self, job: IndexJob, seen: VideoRecord | None) -> VideoRecord | None:
        """absent | indexed | failed | deleted -> queued, just before a job is submitted (see
        ``QueueingSink``). A row already queued or being indexed is returned as it is."""
        if seen is None:
            return self.catalog.write(VideoRecord(video_id=job.video_id, uri=job.uri, status=VideoStatus.QUEUED), 0)
        if seen.status in IN_FLIGHT:
            return seen
        return self.catalog.write(seen.evolve(status=VideoStatus.QUEUED, error=None), seen.rev)

    def unqueue(self, marked: VideoRecord, before: VideoRecord | None) -> VideoRecord | None:
        """queued -> what it was, when the submit that ``marked`` it failed (absent: failed, with why)."""
        if before is None:
            back = marked.evolve(status=VideoStatus.FAILED, error="its job could not be queued; submit it again")
        else:
            back = marked.evolve(status=before.status, error=before.error)
        return self.catalog.write(back, marked.rev)

    def claim(
        self,
        job: IndexJob,
        seen: VideoRecord | None,
        *,
        version: str,
        model: str,
        sampling: str,
        attempt: Attempt | None,
        crashes: int,
    ) -> VideoRecord | None:
        """any -> indexing ``version``: the started-marker (task, holder, crashes). What ``frames``
        holds (``frames``, ``fingerprint``) is kept: nothing has been written yet."""
        base = seen or VideoRecord(video_id=job.video_id, uri=job.uri, status=VideoStatus.INDEXING)
        claimed = base.evolve(
            status=VideoStatus.INDEXING,
            version=version,
            model=model,
            sampling=sampling,
            error=None,
            task_id=attempt.task_id if attempt else None,
            holder=attempt.holder if attempt else None,
            crashes=crashes,
        )
        return self.catalog.write(claimed, seen.rev if seen else 0)

    def finish(
        self, seen: VideoRecord, *, version: str, fingerprint: str, frames: int, duration_s: float | None
    ) -> VideoRecord | None:
        """queued | indexing ``version`` -> indexed, right after this job's rows were committed.
        ``seen`` must have been read after that commit: any job that touched the rows later either
        changed the row already (so this write loses) or will lose its own write to this one."""
        return self.catalog.write(
            seen.evolve(
                status=VideoStatus.INDEXED,
                version=version,
                fingerprint=fingerprint,
                frames=frames,
                duration_s=duration_s,
                error=None,
            ),
            seen.rev,
        )

    def confirm(self, seen: VideoRecord, version: str) -> VideoRecord | None:
        """-> indexed, when ``frames`` already holds exactly the rows of ``version`` (checked by the caller)."""
        return self.catalog.write(seen.evolve(status=VideoStatus.INDEXED, version=version, error=None), seen.rev)

    def removed(self, job: IndexJob, seen: VideoRecord | None) -> VideoRecord | None:
        """any -> deleted, right after this job removed the video's rows (``seen`` read after that)."""
        base = seen or VideoRecord(video_id=job.video_id, uri=job.uri, status=VideoStatus.DELETED)
        gone = base.evolve(status=VideoStatus.DELETED, frames=0, fingerprint=None, error=None, duration_s=None)
        return self.catalog.write(gone, seen.rev if seen else 0)

    def unsettle(self, job: IndexJob, seen: VideoRecord | None) -> VideoRecord | None:
        """any -> indexing, by a job leaving after it changed the rows and before it settled the row:
        what the row says of the rows can't be trusted, so it goes back in flight (a retry, or the
        scheduled check past its grace, redoes the video). ``frames``/``fingerprint`` say "unknown"
        (-1 rows) so no reader takes them for the truth."""
        base = seen or VideoRecord(video_id=job.video_id, uri=job.uri, status=VideoStatus.INDEXING)
        gone = base.evolve(
            status=VideoStatus.INDEXING, frames=-1, fingerprint=None, error="a job left its rows unsettled"
        )
        return self.catalog.write(gone, seen.rev if seen else 0)

    def fail(self, job: IndexJob, seen: VideoRecord | None, reason: str, version: str | None) -> VideoRecord | None:
        """queued | indexing | failed | (anything at ``version``) -> failed(reason). A settled outcome
        (indexed, deleted) of another or an unknown version is left alone: another job settled the
        video meanwhile. The rows, if any, stay (still searchable, still what ``frames`` holds)."""
        settled = seen is not None and seen.status in (VideoStatus.INDEXED, VideoStatus.DELETED)
        if seen is not None and settled and (version is None or seen.version != version):
            return seen
        base = seen or VideoRecord(video_id=job.video_id, uri=job.uri, status=VideoStatus.FAILED)
        failed = base.evolve(status=VideoStatus.FAILED, error=reason, version=version or base.version)
        return self.catalog.write(failed, seen.rev if seen else 0)


class QueueingSink:
    """A ``JobSink`` that marks the video ``queued`` before it submits the job, and puts the row back
    if the submit fails: ``queued`` is written only while no job of this submit can be running yet,
    so it never lands over the job's own outcome, and a failed submit leaves nothing behind (if even
    the rollback fails, the scheduled check finds the row past its grace and submits it again).
    Bucket events don't go through here: a commit per event would cap the fleet (the router submits
    straight away and the row says ``indexing`` once a consumer takes it)."""

    def __init__(self, sink: JobSink, states: VideoStates) -> None:
        self._sink = sink
        self._states = states

    def submit(self, job: IndexJob) -> str:
        """Raises:
        TransientError: the task queue did not take the job.
        """
        seen: VideoRecord | None = None
        marked: VideoRecord | None = None
        try:
            seen = self._states.read(job.video_id)
            marked = self._states.queue(job, seen)
        except TransientError as exc:  # the job matters, the status is a courtesy
            log.warning("could not mark %s queued: %s", job.uri, exc)
        try:
            return self._sink.submit(job)
        except Exception:
            if marked is not None and marked is not seen:
                try:
                    self._states.unqueue(marked, seen)
                except TransientError:
                    log.warning("could not take %s out of queued; the scheduled check will", job.uri)
            raise
