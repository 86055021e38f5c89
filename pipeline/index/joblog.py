"""The one log line of an index job: readable text, and the same facts as structured fields
(``extra``), which Ray Serve's JSON log encoding writes as keys of the line's JSON object."""

from __future__ import annotations

import logging

from events.jobs import IndexJob
from pipeline.failures import failure_reason
from pipeline.index.clock import StageClock
from storage.errors import PermanentError, VidxError

log = logging.getLogger(__name__)

#: The ``extra`` key whose dict Ray's log formatters flatten into the line's own keys. Fields given
#: as plain ``extra`` attributes would lose ``task_id``: Serve strips that attribute (Ray's own).
FIELDS_KEY = "ray_serve_extra_fields"


def job_fields(
    job: IndexJob, task_id: str | None, clock: StageClock, duration_s: float, **more: object
) -> dict[str, object]:
    """What one job's line carries as structured fields (JSON-ready values)."""
    return {
        "video_id": job.video_id,
        "task_id": task_id,
        "uri": job.uri,
        "op": job.op.value,
        "duration_s": round(duration_s, 4),
        "stages_s": {k: round(v, 4) for k, v in clock.seconds.items()},
        **more,
    }


def log_job(
    job: IndexJob,
    task_id: str | None,
    clock: StageClock,
    duration_s: float,
    *,
    outcome: str | None = None,
    frames: int = 0,
    error: BaseException | None = None,
) -> None:
    """Log the job's line: its ``outcome`` and ``frames``, or the ``error`` that ended it (``failed``
    when permanent, else ``error``: a transient failure is retried, its outcome is the retry's)."""
    if error is None:
        fields = job_fields(job, task_id, clock, duration_s, outcome=outcome, frames=frames, stage="done")
        done = (job.op.value, job.uri, outcome, frames, duration_s, clock.summary())
        log.info("job %s %s -> %s (%d frames) in %.2fs: %s", *done, extra={FIELDS_KEY: fields})
        return
    permanent = isinstance(error, PermanentError)
    reason = error.reason if isinstance(error, VidxError) else f"internal error ({type(error).__name__})"
    outcome = "failed" if permanent else "error"
    fields = job_fields(
        job,
        task_id,
        clock,
        duration_s,
        outcome=outcome,
        # Where it failed: the stage the error came out of (None: between stages).
        stage=clock.failed_in,
        reason=reason,
        reason_class=failure_reason(error).value,
    )
    args = (job.op.value, job.uri, outcome, duration_s, clock.summary(), reason)
    log.log(
        logging.WARNING if permanent else logging.INFO,
        "job %s %s -> %s in %.2fs: %s; %s",
        *args,
        extra={FIELDS_KEY: fields},
    )
