"""What an index job ends with (``pipeline.index.indexer``): its outcome, and the crash-loop error."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from storage.errors import PermanentError


class ConsumerKilled(PermanentError):
    """Raised when a job's consumer died while holding it ``max_crashes`` times: the video itself
    (a decoder crash, memory) is the likely cause, so it is failed instead of tried forever."""


class Outcome(enum.StrEnum):
    INDEXED = "indexed"
    UNCHANGED = "unchanged"
    DELETED = "deleted"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class JobResult:
    video_id: str
    outcome: Outcome
    frames: int = 0
    reason: str | None = None
    #: The video's words are not in the text table at this version: a text job is to read them.
    text_due: bool = False
    #: Seconds spent per stage (head, catalog, fetch, decode, embed, thumbnails, write).
    stages: dict[str, float] = field(default_factory=dict, compare=False)
