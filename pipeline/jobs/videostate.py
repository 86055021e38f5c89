"""The per-video state machine over the catalog: each transition is one compare-and-set on the
revision the caller read (``Catalog.write``), so no interleaving of jobs can write over a change it
did not see. docs/design/state-machine.md draws the states and who moves them.

A transition returns the row as written, or None when another writer changed the row first: the
caller reads again and decides anew.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from events.jobs import IndexJob, JobOp, JobSink
from storage.catalog import IN_FLIGHT, Catalog, VideoRecord, VideoStatus
from storage.commits.catalog import CatalogWrites, DirectWrites, PendingWrite
from storage.errors import TransientError, WriteInDoubt
from storage.models import ModelIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Attempt:
    """Who is running a job: the task id (stable across retries and redeliveries) and the consumer
    process (``holder``) running it now."""

    task_id: str
    holder: str
    #: The task queue's retry count of this start (0: the first); a redelivery repeats it.
    number: int = 0


@dataclass(slots=True)
class JobRows:
    """What one job did to its video's rows since it last settled the row: whether it changed them, in
    which tables, and the ``write_id`` of its settle (``indexed``/``deleted``) if that write's outcome
    is in doubt — a row carrying it means the settle landed and the rows are what the row says."""

    rows_changed: bool = False
    tables: set[str] = field(default_factory=set)
    settle_in_doubt: str | None = None


@contextlib.contextmanager
def settling(rows: JobRows) -> Iterator[None]:
    """Around a job's settle write: an outcome in doubt is remembered (``JobRows.settle_in_doubt``)."""
    try:
        yield
    except WriteInDoubt as exc:
        rows.settle_in_doubt = exc.write_id
        raise


def claim_record(
    job: IndexJob,
    seen: VideoRecord | None,
    *,
    version: str,
    model: str,
    sampling: str,
    attempt: Attempt | None,
    crashes: int,
) -> VideoRecord:
    """``seen`` (None: a new row) as a claim makes it: ``indexing`` ``version`` with the started-marker; the
    revision stays ``seen``'s (a job that skipped its claim finishes from this, on ``seen``'s revision)."""
    base = seen or VideoRecord(video_id=job.video_id, uri=job.uri, status=VideoStatus.INDEXING)
    return base.evolve(
        status=VideoStatus.INDEXING,
        version=version,
        model=model,
        sampling=sampling,
        error=None,
        task_id=attempt.task_id if attempt else None,
        holder=attempt.holder if attempt else None,
        attempt=attempt.number if attempt else None,
        crashes=crashes,
    )


#: Longest a transition waits for the outcome of its write (a grouped commit, see ``storage.commits.catalog``).
WRITE_TIMEOUT_S = 60.0


class VideoStates:
    """The transitions of ``videos`` rows (see the module docstring). Reads go to ``catalog``;
    writes to ``writes`` (by default one commit per write; a ``GroupedCatalogWriter`` shares them)."""

    def __init__(
        self, catalog: Catalog, writes: CatalogWrites | None = None, *, write_timeout_s: float = WRITE_TIMEOUT_S
    ) -> None:
        self.catalog = catalog
        self._writes: CatalogWrites = writes or DirectWrites(catalog)
        self._write_timeout_s = write_timeout_s

    def _submit(self, record: VideoRecord, expected_rev: int) -> PendingWrite:
        """Start a write stamped with a fresh ``write_id``, so its outcome can be read back."""
        stamped = record.evolve(write_id=uuid.uuid4().hex)
        return _ReadBack(self, self._writes.submit(stamped, expected_rev), stamped)

    def _write(self, record: VideoRecord, expected_rev: int) -> VideoRecord | None:
        """Raises:
        TransientError: the write failed or its outcome did not come in time, and the row read back
            does not show it landed (it may still land).
        """
        return self._submit(record, expected_rev).result(self._write_timeout_s)

    def wait(self, pending: PendingWrite) -> VideoRecord | None:
        """The outcome of a write started by a ``*_async`` transition (bounded like every write)."""
        return pending.result(self._write_timeout_s)

    def landed(self, video_id: str, write_id: str | None) -> VideoRecord | None:
        """The row, if it is the one the write stamped ``write_id`` left (None: not seen, or unreadable)."""
        try:
            row = self.read(video_id)
        except TransientError:
            return None
        return row if row is not None and write_id is not None and row.write_id == write_id else None

    def read(self, video_id: str) -> VideoRecord | None:
        return self.catalog.get(video_id)

    def queue_async(self, job: IndexJob, seen: VideoRecord | None) -> PendingWrite | None:
        """absent | indexed | failed | deleted -> queued, once a job of the video was submitted,
        compare-and-set on the row as read *before* that submit (see ``QueueingSink``). A row already
        queued or being indexed is left as it is (None)."""
        if job.op is JobOp.DELETE and (seen is None or seen.status is VideoStatus.DELETED):
            return None  # nothing to remove: no row to put in flight (nor one to create)
        if seen is None:
            return self._submit(VideoRecord(video_id=job.video_id, uri=job.uri, status=VideoStatus.QUEUED), 0)
        if seen.status in IN_FLIGHT:
            return None
        return self._submit(seen.evolve(status=VideoStatus.QUEUED, error=None), seen.rev)

    def claim_async(self, job: IndexJob, seen: VideoRecord | None, **marker: Any) -> PendingWrite:
        """any -> indexing: ``claim_record``'s row (same keywords: version, model, sampling, attempt,
        crashes), started at once. Returns at once: the caller may fetch and decode meanwhile, but must
        have the outcome (``wait``) before it writes any rows."""
        return self.submit_claim(claim_record(job, seen, **marker))

    def submit_claim(self, claimed: VideoRecord) -> PendingWrite:
        """Start writing ``claimed`` (a ``claim_record``) over the row it was made from, on that row's revision."""
        return self._submit(claimed, claimed.rev)

    def claim(self, job: IndexJob, seen: VideoRecord | None, **marker: Any) -> VideoRecord | None:
        """``claim_async`` (same keywords), waiting for its outcome."""
        return self.wait(self.claim_async(job, seen, **marker))

    def finish(
        self,
        seen: VideoRecord,
        *,
        version: str,
        fingerprint: str,
        frames: int,
        duration_s: float | None,
        indexes: tuple[ModelIndex, ...] = (),
    ) -> VideoRecord | None:
        """queued | indexing ``version`` -> indexed, right after this job's rows were committed.
        ``seen`` must be the row as it stands after that commit: read after it, or a row the job had
        before it (its claim's, or its first read) — the compare-and-set on its revision then lands only if
        nothing changed the row since, so it is the row a read after the commit would have found. Any job
        that touched the rows later either changed the row already (so this write loses) or will lose its
        own write to this one.
        ``indexes``: what each model's table now holds (``fingerprint``/``frames``: the first's)."""
        return self._write(
            seen.evolve(
                status=VideoStatus.INDEXED,
                version=version,
                fingerprint=fingerprint,
                frames=frames,
                duration_s=duration_s,
                error=None,
                indexes=indexes,
            ),
            seen.rev,
        )

    def confirm(self, seen: VideoRecord, version: str) -> VideoRecord | None:
        """-> indexed, when ``frames`` already holds exactly the rows of ``version`` (checked by the caller)."""
        return self._write(seen.evolve(status=VideoStatus.INDEXED, version=version, error=None), seen.rev)

    def removed(self, job: IndexJob, seen: VideoRecord | None) -> VideoRecord | None:
        """any -> deleted, right after this job removed the video's rows (``seen`` read after that)."""
        base = seen or VideoRecord(video_id=job.video_id, uri=job.uri, status=VideoStatus.DELETED)
        gone = base.evolve(
            status=VideoStatus.DELETED, frames=0, fingerprint=None, error=None, duration_s=None, indexes=()
        )
        return self._write(gone, seen.rev if seen else 0)

    def unsettle(
        self, job: IndexJob, seen: VideoRecord | None, touched: frozenset[str] | None = None
    ) -> VideoRecord | None:
        """any -> indexing, by a job leaving after it changed the rows and before it settled the row:
        what the row says of the rows can't be trusted, so it goes back in flight (a retry, or the
        scheduled check past its grace, redoes the video). ``frames``/``fingerprint`` say "unknown"
        (-1 rows) so no reader takes them for the truth; of ``indexes`` only the entries of the
        tables in ``touched`` go (None: all)."""
        base = seen or VideoRecord(video_id=job.video_id, uri=job.uri, status=VideoStatus.INDEXING)
        kept = () if touched is None else tuple(i for i in base.indexes if i.table not in touched)
        gone = base.evolve(
            status=VideoStatus.INDEXING,
            frames=-1,
            fingerprint=None,
            error="a job left its rows unsettled",
            indexes=kept,
        )
        return self._write(gone, seen.rev if seen else 0)

    def fail(self, job: IndexJob, seen: VideoRecord | None, reason: str, version: str | None) -> VideoRecord | None:
        """queued | indexing | failed | (anything at ``version``) -> failed(reason). A settled outcome
        (indexed, deleted) of another or an unknown version is left alone: another job settled the
        video meanwhile. The rows, if any, stay (still searchable, still what ``frames`` holds)."""
        settled = seen is not None and seen.status in (VideoStatus.INDEXED, VideoStatus.DELETED)
        if seen is not None and settled and (version is None or seen.version != version):
            # Left alone; but a job that must write (``IndexJob.settle``) rewrites it as it is, so a
            # `queued` mark still in flight loses.
            return self._write(seen, seen.rev) if job.settle else seen
        base = seen or VideoRecord(video_id=job.video_id, uri=job.uri, status=VideoStatus.FAILED)
        failed = base.evolve(status=VideoStatus.FAILED, error=reason, version=version or base.version)
        return self._write(failed, seen.rev if seen else 0)


class _ReadBack:
    """A pending write that, when its outcome is lost (the writer failed, died or answered late), reads
    the row back: one carrying the write's ``write_id`` is the write, landed. Without this a job whose
    finish landed but whose reply was lost would unsettle its own settled row and embed the video again."""

    def __init__(self, states: VideoStates, pending: PendingWrite, record: VideoRecord) -> None:
        self._states = states
        self._pending = pending
        self._record = record

    def result(self, timeout_s: float) -> VideoRecord | None:
        try:
            return self._pending.result(timeout_s)
        except TransientError as exc:
            landed = self._states.landed(self._record.video_id, self._record.write_id)
            if landed is None:
                raise WriteInDoubt(str(exc), self._record.write_id) from exc
            log.info("%s: the reply to a catalog write was lost (%s) but the write landed", self._record.uri, exc)
            return landed


class QueueingSink:
    """A ``JobSink`` that marks the video ``queued`` once its job is submitted, without waiting for
    the mark. The mark is a compare-and-set on the row as it was before the submit, so it lands only
    if nothing changed the row since; and the job it submitted writes the row (``IndexJob.settle``),
    even when it finds nothing to do, until it sees the row moved past its first read (which the mark
    then can no longer land on: ``pipeline.index.settle.Fence``), so the mark can never outlive the job's
    own outcome: it lands before the job's write (which then loses, and the job settles the row
    again) or not at all. A failed submit writes nothing. Of bucket events only deletes go through
    here (``pipeline.serve.ingest.DeleteMarkingSink``); an upload's job is submitted straight away and
    its row says ``indexing`` once a consumer takes it.

    With ``deferred`` (the API), the submit reads nothing: it takes the catalog version the clock
    last saw and the mark is made on a thread from the row at that version
    (``pipeline.jobs.queued_marks``); without it the row is read before the submit."""

    def __init__(
        self, sink: JobSink, states: VideoStates, deferred: DeferredQueueing | None = None, *, read_first: bool = True
    ) -> None:
        """``read_first=False``: with no catalog version to hand (``deferred`` has none yet, or its
        lookups are failing) the job is submitted unmarked rather than after a read (the router: a mark
        must never hold up routing)."""
        self._sink = sink
        self._states = states
        self._deferred = deferred
        self._read_first = read_first

    def submit(self, job: IndexJob) -> str:
        """Raises:
        TransientError: the task queue did not take the job.
        """
        settle = job.model_copy(update={"settle": True})
        if self._deferred is not None and (version := self._deferred.version()) is not None:
            task_id = self._sink.submit(settle)
            self._deferred.mark(job, version)
            return task_id
        if not self._read_first:
            return self._sink.submit(job)
        try:
            seen = self._states.read(job.video_id)
        except TransientError as exc:  # the job matters, the status is a courtesy
            log.warning("could not read %s before its submit, so it is not marked queued: %s", job.uri, exc)
            return self._sink.submit(job)
        # The job writes the row (``settle``) until it saw the row move, so this mark, if still in flight, loses to it.
        task_id = self._sink.submit(settle)
        self._states.queue_async(job, seen)
        return task_id


class DeferredQueueing(Protocol):
    """Where ``QueueingSink`` takes a catalog version from before the submit, and leaves the mark."""

    def version(self) -> int | None: ...

    def mark(self, job: IndexJob, version: int) -> None: ...
