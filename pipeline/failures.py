"""Why a video failed for good, as a small closed set of reason classes (the full reason is in the
catalog and the dead letter): the label of ``vidx_videos_failed`` and of a failed job's log line."""

from __future__ import annotations

import enum

from storage.errors import (
    CorruptVideo,
    InvalidInput,
    LimitExceeded,
    ModelUnavailable,
    NotAVideo,
    PermanentError,
    TransientError,
)


class FailureReason(enum.StrEnum):
    """Why a video failed for good, as a small closed set (the full reason is in the catalog)."""

    NOT_A_VIDEO = "not_a_video"
    DECODE_ERROR = "decode_error"
    TOO_LARGE = "too_large"
    TOO_LONG = "too_long"
    TOO_MANY_FRAMES = "too_many_frames"
    TOO_MANY_PIXELS = "too_many_pixels"
    DECODE_TIMEOUT = "decode_timeout"
    OVER_LIMIT = "over_limit"
    INVALID_INPUT = "invalid_input"
    MODEL_UNAVAILABLE = "model_unavailable"
    CRASH_LOOP = "crash_loop"
    MALFORMED_JOB = "malformed_job"
    UNCONFIGURED_BUCKET = "unconfigured_bucket"
    TRANSIENT_EXHAUSTED = "transient_exhausted"
    INTERNAL_ERROR = "internal_error"
    PERMANENT = "permanent"


#: Which limit a ``LimitExceeded`` names (its messages say "exceeds max <limit>").
_LIMITS = (
    ("max bytes", FailureReason.TOO_LARGE),
    ("max duration", FailureReason.TOO_LONG),
    ("max frames", FailureReason.TOO_MANY_FRAMES),
    ("max pixels", FailureReason.TOO_MANY_PIXELS),
    ("max decode time", FailureReason.DECODE_TIMEOUT),
)


def failure_reason(exc: BaseException) -> FailureReason:
    """The reason class of the error that failed a job for good (after its retries, if transient)."""
    if isinstance(exc, NotAVideo):
        return FailureReason.NOT_A_VIDEO
    if isinstance(exc, CorruptVideo):
        return FailureReason.DECODE_ERROR
    if isinstance(exc, LimitExceeded):
        text = str(exc)
        return next((reason for phrase, reason in _LIMITS if phrase in text), FailureReason.OVER_LIMIT)
    if isinstance(exc, InvalidInput):
        return FailureReason.INVALID_INPUT
    if isinstance(exc, ModelUnavailable):
        return FailureReason.MODEL_UNAVAILABLE
    if isinstance(exc, PermanentError):
        return FailureReason.PERMANENT
    if isinstance(exc, TransientError):
        return FailureReason.TRANSIENT_EXHAUSTED
    return FailureReason.INTERNAL_ERROR
