"""What an index job ends with (``pipeline.index.indexer``): its outcome and the crash-loop error; what a
kind of job brings to the shared round (``JobKind``), and the step boundaries where hooks run (``STEPS``)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from events.jobs import IndexJob
from pipeline.index.clock import StageClock
from pipeline.index.plan import IndexPlan
from pipeline.index.settle import Acted, Claim
from pipeline.jobs.videostate import JobRows
from storage.catalog import VideoRecord
from storage.errors import PermanentError
from storage.models import ModelTable
from storage.s3 import ObjectHead


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


#: A step boundary of a job and the job: ``hooks(step, job)`` runs there (tests pause jobs at them).
StepHook = Callable[[str, IndexJob], None]

#: The boundaries, in the order one job can pass them.
STEPS = ("read", "head", "claim", "fetch", "embedded", "write", "written", "finish", "settled", "remove", "removed")


def no_hook(step: str, job: IndexJob) -> None:
    return None


class JobKind(Protocol):
    """What one round of a kind of job brings to the shared round (``FramesJob``, ``WordsJob``): the tables
    it plans over, whether it may claim, what giving up on the video means, what it makes, and whether its
    entries may join a row another job settled over its claim."""

    @property
    def tables(self) -> Sequence[ModelTable]: ...

    @property
    def deferred(self) -> frozenset[str]: ...

    @property
    def joins(self) -> bool: ...

    def ready(self, plan: IndexPlan) -> bool: ...

    def due_later(self, plan: IndexPlan) -> bool: ...

    def give_up(self, crashes: int) -> None: ...

    def act(
        self,
        head: ObjectHead,
        seen: VideoRecord | None,
        plan: IndexPlan,
        claim: Claim,
        clock: StageClock,
        dirty: JobRows,
    ) -> Acted: ...
