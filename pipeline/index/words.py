"""The middle of a text job: fetch the object and read its words with the text settings' sources
(``pipeline.text``), holding one of the process's text slots (each slot keeps its own OCR engine and
speech decoder, which serve one thread at a time)."""

from __future__ import annotations

import logging
import queue
import tempfile
import threading
from pathlib import Path
from typing import Protocol

from pipeline.index.clock import StageClock
from pipeline.index.objects import ObjectSource
from pipeline.settings import Settings
from pipeline.text.extract import TextExtractor
from storage.errors import TransientError
from storage.s3 import ObjectHead
from storage.texts import TextRow

log = logging.getLogger(__name__)

#: Longest a text job waits for a text slot; then it is retried.
TEXT_SLOT_WAIT_S = 600.0


class WordReader(Protocol):
    """Reads the words of an object's version as a text table's rows (``TextStage``, or a stand-in)."""

    def rows(self, head: ObjectHead, video_id: str, clock: StageClock) -> list[TextRow]: ...


class TextStage:
    """Fetch and read words for the text jobs of one process: ``slots`` at once, each with its own
    extractor (made on first use and kept: the OCR engine and the speech model load once)."""

    def __init__(self, settings: Settings, objects: ObjectSource, slots: int) -> None:
        self._settings = settings
        self._objects = objects
        self._free: queue.SimpleQueue[TextExtractor | None] = queue.SimpleQueue()
        for _ in range(max(1, slots)):
            self._free.put(None)
        self._lock = threading.Lock()
        self._made: list[TextExtractor] = []

    def rows(self, head: ObjectHead, video_id: str, clock: StageClock) -> list[TextRow]:
        """The segments of the object's words, in time order (a source that could not read this video
        leaves its part out, with the reason logged: the video's frames are searchable all the same).

        Raises:
            TransientError: no slot within ``TEXT_SLOT_WAIT_S``, or the store's transient errors.
            PermanentError: the object can't be fetched (gone for good, over a limit).
        """
        # The slot first: a job waiting for one holds no downloaded copy (and fetches a fresh one after).
        with clock.stage("text_wait"):
            try:
                extractor = self._free.get(timeout=TEXT_SLOT_WAIT_S)
            except queue.Empty:
                raise TransientError(f"no text slot within {TEXT_SLOT_WAIT_S:g}s") from None
        with tempfile.TemporaryDirectory(prefix="vidx-text-") as tmp:
            path = Path(tmp) / "video"
            try:
                with clock.stage("fetch"):
                    self._objects.download(head, path)
                if extractor is None:
                    extractor = TextExtractor(self._settings)
                    with self._lock:
                        self._made.append(extractor)
                found = extractor.extract(path)
            finally:
                self._free.put(extractor)
        for source, seconds in found.seconds.items():
            clock.add(f"text_{source}", seconds)
        for source, why in found.errors.items():
            log.info("%s: %s read nothing: %s", head.key, source, why)
        if found.left_out:
            log.warning(
                "%s: its words ran past %d characters (limits.max_video_text_chars): %d segments read were left "
                "out, and the subtitle cues after them were not read",
                head.key,
                self._settings.limits.max_video_text_chars,
                found.left_out,
            )
        return found.rows(video_id)

    def close(self) -> None:
        with self._lock:
            made, self._made = self._made, []
        for extractor in made:
            extractor.close()
