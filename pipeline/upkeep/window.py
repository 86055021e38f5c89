"""The submission window both backfills keep: the jobs a backfill has submitted for videos not yet seen
done, at most ``max_outstanding`` of them out at once; a video whose job is not seen done within
``resubmit_after_s`` is submitted again (jobs are idempotent: a duplicate finds the rows and does nothing),
at most ``max_submits`` times if bounded. The window is the process's memory only: a restart submits again
what it had out, at most a window's worth."""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass

from events.jobs import IndexJob, JobOp, JobSink, JobSource
from storage.ids import video_id


@dataclass(frozen=True, slots=True)
class Submitted:
    """What one pass over the waiting videos did."""

    submitted: int = 0
    #: Waiting videos whose jobs were submitted ``max_submits`` times already (none when unbounded).
    given_up: int = 0


class SubmissionWindow:
    """The jobs of source ``source`` a backfill has out on ``sink`` (see the module docstring)."""

    def __init__(
        self,
        sink: JobSink,
        source: JobSource,
        *,
        max_outstanding: int,
        resubmit_after_s: float,
        max_submits: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: monotonic seconds the submissions are timed in."""
        self._sink = sink
        self._source = source
        self._max_outstanding = max_outstanding
        self._resubmit_after_s = resubmit_after_s
        self._max_submits = max_submits
        self._clock = clock
        #: Video id -> (when its job was last submitted, how many times it was).
        self._submitted: dict[str, tuple[float, int]] = {}

    def done(self, video_id: str) -> None:
        """The video needs no job (any more): it frees its slot and its count of submissions."""
        self._submitted.pop(video_id, None)

    def clear(self) -> None:
        """Forget every submission (the backfill changed: what was out is for another table)."""
        self._submitted.clear()

    def submit(self, uris: Iterable[str], unslotted: Container[str] = frozenset()) -> Submitted:
        """Submit a job for each of ``uris`` in turn, skipping one submitted within ``resubmit_after_s``
        or given up, until ``max_outstanding`` jobs are out. A video of ``unslotted`` (its job ended, e.g.
        failed) holds no slot while its job is out, though it still waits ``resubmit_after_s``.

        Raises:
            TransientError: the task queue is unavailable (what was submitted before is kept).
        """
        now = self._clock()
        outstanding = sum(
            1 for vid, (at, _) in self._submitted.items() if now - at < self._resubmit_after_s and vid not in unslotted
        )
        submitted = given_up = 0
        for uri in uris:
            bucket, _, key = uri.removeprefix("s3://").partition("/")
            vid = video_id(bucket, key)
            at, times = self._submitted.get(vid, (None, 0))
            if at is not None and now - at < self._resubmit_after_s:
                continue
            if self._max_submits is not None and times >= self._max_submits:
                given_up += 1
                continue
            if outstanding >= self._max_outstanding:
                break
            self._sink.submit(IndexJob(op=JobOp.INDEX, bucket=bucket, key=key, source=self._source))
            self._submitted[vid] = (now, times + 1)
            outstanding += vid not in unslotted
            submitted += 1
        return Submitted(submitted, given_up)
