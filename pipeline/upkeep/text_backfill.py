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
import time
from collections.abc import Callable
from dataclasses import dataclass

from events.jobs import JobSink, JobSource
from pipeline.upkeep.backfill import has_model
from pipeline.upkeep.leased_loop import LeasedLoop, LeasedService
from pipeline.upkeep.window import SubmissionWindow
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
        self._resubmit_after_s = resubmit_after_s
        self._clock = clock
        #: The text jobs this process submitted for ``_table`` and not yet seen done.
        self._window = SubmissionWindow(
            sink,
            JobSource.TEXT,
            max_outstanding=max_outstanding,
            resubmit_after_s=resubmit_after_s,
            max_submits=MAX_SUBMITS,
            clock=clock,
        )
        self._table: str | None = None
        #: The text table a round found complete, and when: no walk for ``resubmit_after_s`` after.
        self._complete: str | None = None
        self._complete_at = 0.0
        #: Its rounds under the ``text-backfill`` lease, the first after one ``interval_s``.
        self.service = LeasedService(
            LeasedLoop("text-backfill", store.leases, LEASE, every_s=interval_s, ttl_s=lease_ttl_s), self.round
        )

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
        waiting: list[str] = []
        for record in self._store.catalog.scan_all():
            if record.status is not VideoStatus.INDEXED or not has_model(record, active):
                continue  # not searchable at its version (yet): its index job asks for the words
            found.total += 1
            if has_words(record, text):
                found.done += 1
                self._window.done(record.video_id)
                continue
            found.need += 1
            waiting.append(record.uri)
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

    def _submit(self, waiting: list[str], found: TextRound) -> None:
        sent = self._window.submit(waiting)
        found.submitted, found.given_up = sent.submitted, sent.given_up
        if found.given_up and found.given_up == found.need:
            # Nothing left this process can do for this table for now (the dead letters say why).
            self._complete, self._complete_at = found.table, self._clock()

    def _forget(self, table: str | None) -> None:
        """Start afresh when the live text table changed."""
        if table != self._table:
            self._window.clear()
            self._complete = None
            self._table = table
