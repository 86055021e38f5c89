"""The text backfill: reads the words of every indexed video that lacks them in the live text table, the
way the backfill coordinator re-embeds for a model switch, through the text queue.

New uploads get their words from the text job their index job submits; this covers the rest: a text
source turned on (or the text pipeline changed: a new text table) over videos indexed before, and a
text job lost or given up. A round (every ``reindex.interval_s``, one worker in the fleet at a time: the
``text-backfill`` lease) walks the catalog: an indexed video whose active model's rows hold its version
and whose text entry is not of that version and the live pipeline *needs* a text job; at most
``reindex.max_outstanding`` are out at once, one not done within ``reindex.resubmit_after_s`` is
submitted again, at most ``MAX_SUBMITS`` times per video and table (then it is left to the dead letters,
where its reason is). Once a round finds nothing needed for a table, rounds stop walking the catalog for
``reindex.resubmit_after_s`` (or until the live text table changes): the index jobs keep new videos' words
coming, and the next walk finds those whose text job was lost since.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from events.jobs import IndexJob, JobOp, JobSink, JobSource
from pipeline.upkeep.backfill import has_model
from pipeline.upkeep.leased_loop import LeasedLoop
from storage.catalog import VideoRecord, VideoStatus
from storage.ids import text_fingerprint
from storage.models import ModelTable
from storage.tables import IndexStore

log = logging.getLogger(__name__)

LEASE = "text-backfill"
#: Text jobs one video gets from the backfill for one text table, at most.
MAX_SUBMITS = 3


@dataclass(slots=True)
class TextRound:
    """What one round found and did."""

    table: str
    #: Indexed videos with the active model's rows at their version.
    total: int = 0
    #: Of those, with the live text table's words of that version.
    done: int = 0
    need: int = 0
    submitted: int = 0
    #: Needing words, but their text jobs were submitted ``MAX_SUBMITS`` times already.
    given_up: int = 0


def has_words(record: VideoRecord, text: ModelTable) -> bool:
    """Whether the catalog says the text table holds this video's words at its current version."""
    entry = record.index_in(text.table)
    return (
        entry is not None
        and record.version is not None
        and text.pipeline is not None
        and entry.fingerprint == text_fingerprint(record.version, text.pipeline)
    )


class TextBackfill:
    """Runs text backfill rounds under a lease (see the module docstring)."""

    def __init__(
        self,
        store: IndexStore,
        sink: JobSink,
        *,
        interval_s: float,
        max_outstanding: int,
        resubmit_after_s: float,
        lease_ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._sink = sink
        self._max_outstanding = max_outstanding
        self._resubmit_after_s = resubmit_after_s
        self._clock = clock
        self._loop = LeasedLoop("text-backfill", store.leases, LEASE, every_s=interval_s, ttl_s=lease_ttl_s)
        #: Video id -> (when its text job was last submitted, how many times) for ``_table``.
        self._submitted: dict[str, tuple[float, int]] = {}
        self._table: str | None = None
        #: The text table a round found complete, and when: no walk for ``resubmit_after_s`` after.
        self._complete: str | None = None
        self._complete_at = 0.0
        self.last: TextRound | None = None
        self.last_error: str | None = None

    @property
    def last_ok(self) -> float | None:
        return self._loop.last_ok

    def start(self) -> tuple[threading.Thread, threading.Event]:
        return self._loop.start(self._leased_round, self._failed)

    def _leased_round(self) -> None:
        if self._loop.hold():
            self.last = self.round()
            self.last_error = None

    def _failed(self, why: str) -> None:
        self.last_error = why[:500]

    def round(self) -> TextRound | None:
        """One round (None: no text source is on, or the live text table was found complete).

        Raises:
            TransientError: the catalog, the lifecycle row or the text queue is unavailable.
        """
        state = self._store.models.read()
        text, active = state.text, state.active
        if text is None or active is None:
            self._forget(None)
            return None
        self._forget(text.table)
        if self._complete == text.table and self._clock() - self._complete_at < self._resubmit_after_s:
            return None
        self._complete = None
        found = TextRound(text.table)
        waiting: list[VideoRecord] = []
        for record in self._store.catalog.scan_all():
            if record.status is not VideoStatus.INDEXED or not has_model(record, active):
                continue  # not searchable at its version (yet): its index job asks for the words
            found.total += 1
            if has_words(record, text):
                found.done += 1
                self._submitted.pop(record.video_id, None)
                continue
            found.need += 1
            waiting.append(record)
        self._submit(waiting, found)
        if found.need == 0:
            self._complete, self._complete_at = text.table, self._clock()
            log.info("text backfill: every indexed video has its words in %s (%d videos)", text.table, found.total)
        elif found.submitted:
            log.info(
                "text backfill of %s: %d of %d videos have their words; %d text jobs submitted",
                text.table,
                found.done,
                found.total,
                found.submitted,
            )
        return found

    def _submit(self, waiting: list[VideoRecord], found: TextRound) -> None:
        now = self._clock()
        outstanding = sum(1 for at, _ in self._submitted.values() if now - at < self._resubmit_after_s)
        for record in waiting:
            at, times = self._submitted.get(record.video_id, (None, 0))
            if at is not None and now - at < self._resubmit_after_s:
                continue
            if times >= MAX_SUBMITS:
                found.given_up += 1
                continue
            if outstanding >= self._max_outstanding:
                break
            bucket, _, key = record.uri.removeprefix("s3://").partition("/")
            self._sink.submit(IndexJob(op=JobOp.INDEX, bucket=bucket, key=key, source=JobSource.TEXT))
            self._submitted[record.video_id] = (now, times + 1)
            outstanding += 1
            found.submitted += 1
        if found.given_up and found.given_up == found.need:
            # Nothing left this process can do for this table for now (the dead letters say why).
            self._complete, self._complete_at = found.table, self._clock()

    def _forget(self, table: str | None) -> None:
        """Start afresh when the live text table changed."""
        if table != self._table:
            self._submitted.clear()
            self._complete = None
            self._table = table
