"""The one exception tree of vidx, split by what the caller should do.

    VidxError
    ├── TransientError            retry with backoff (S3 5xx, timeouts, broker reconnects)
    │   └── EncoderUnavailable    the encoder could not be reached or restarted mid-call
    └── PermanentError            record the reason, dead-letter, never retry
        ├── InvalidInput          a request that can never succeed (bad URI, foreign bucket)
        ├── NotAVideo             the object holds no decodable video stream
        ├── CorruptVideo          the container or stream is damaged
        ├── LimitExceeded         a configured limit (bytes, duration, pixels, frames, time)
        └── ModelUnavailable      the configured model can't be loaded

Library exceptions are converted at the boundary (storage/s3.py, pipeline/media/decode.py, ...),
most specific first, and chained with ``raise ... from``.
"""

from __future__ import annotations


class VidxError(Exception):
    """Root of every error vidx raises on purpose."""

    @property
    def reason(self) -> str:
        """The human-readable reason recorded with a failed video."""
        return str(self)


class TransientError(VidxError):
    """Raised when an operation may succeed if retried later."""


class WriteInDoubt(TransientError):
    """A catalog write whose outcome is unknown: it failed or timed out, and the row read back did not
    (yet) carry its ``write_id``; it may still land. Whoever writes the row next after such a write
    must not take it for not landed: reading the row again shows ``write_id`` if it did."""

    def __init__(self, message: str, write_id: str | None) -> None:
        super().__init__(message)
        self.write_id = write_id


class EncoderUnavailable(TransientError):
    """Raised when the encoder deployment can't be reached."""


class PermanentError(VidxError):
    """Raised when retrying can't help; the job is failed with this reason."""


class InvalidInput(PermanentError):
    """Raised when a request or an object is outside what vidx accepts."""


class NotAVideo(PermanentError):
    """Raised when an object has no decodable video stream."""

    @property
    def reason(self) -> str:
        return f"not a video: {self}"


class CorruptVideo(PermanentError):
    """Raised when a video can't be decoded."""

    @property
    def reason(self) -> str:
        return f"decode error: {self}"


class LimitExceeded(PermanentError):
    """Raised when an object exceeds a configured limit (the message names the limit)."""


class ModelUnavailable(PermanentError):
    """Raised when the configured model can't be loaded; the message names the setting to change."""


class ModelConfigError(PermanentError):
    """Raised at start-up when the configured model and the index's model tables disagree (another
    model id than the index is on, or another dimension than its table); the message says what to do."""


class ReindexRefused(InvalidInput):
    """Raised when a reindex operation can't be done in the lifecycle's current state (the message
    says why and what to do instead)."""
