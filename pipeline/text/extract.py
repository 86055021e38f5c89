"""All of a video's words: each source the text settings turn on, its segments, its cost, and — when a
source could not read this video — why (the video's frames are indexed all the same)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.settings import Settings, TextSettings
from pipeline.text.segments import TextSegment, TextSource, WordsDeadline, capped_words
from storage.errors import CorruptVideo, LimitExceeded, NotAVideo
from storage.ids import segment_id
from storage.sampling import Sampling, SamplingStrategy
from storage.texts import TextRow

if TYPE_CHECKING:
    from pipeline.text.ocr import OcrReader
    from pipeline.text.speech import SpeechRecognizer


@dataclass
class TextExtraction:
    segments: list[TextSegment] = field(default_factory=list)
    #: Seconds each source took (wall clock, on this thread).
    seconds: dict[str, float] = field(default_factory=dict)
    #: Why a source read nothing of this video, where it failed (a damaged audio track, say).
    errors: dict[str, str] = field(default_factory=dict)
    #: Segments read and left out: the video's words ran past ``LimitSettings.max_video_text_chars`` (a
    #: subtitle track is not read past it, so its later cues are not among them).
    left_out: int = 0

    def of(self, source: TextSource) -> list[TextSegment]:
        return [s for s in self.segments if s.source is source]

    def rows(self, video_id: str) -> list[TextRow]:
        """The segments as a text table's rows, ids in this (time) order: two readings of one video
        by one pipeline give the same rows."""
        return [
            TextRow(
                segment_id(video_id, n),
                s.start_s,
                s.end_s,
                s.text,
                s.source.value,
                s.confidence,
                s.word_starts,
                s.track,
                s.alternative,
            )
            for n, s in enumerate(self.segments)
        ]


def text_pipeline_id(text: TextSettings) -> str:
    """``TextSettings.pipeline_id``: what decides a video's segments."""
    return text.pipeline_id()


class TextExtractor:
    """Reads a local video file's words with the sources ``settings.text`` turns on. Holds one OCR
    engine and one speech decoder (made on first use): one thread at a time. ``close`` (or ``with``)
    ends the OCR engine."""

    def __init__(
        self, settings: Settings, *, ocr: OcrReader | None = None, speech: SpeechRecognizer | None = None
    ) -> None:
        self._settings = settings
        self._text = settings.text
        self._ocr = ocr
        self._speech = speech

    def __enter__(self) -> TextExtractor:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._ocr is not None:
            self._ocr.close()
            self._ocr = None

    def extract(self, path: Path) -> TextExtraction:
        """The words of the video at ``path``, by every source on, within ``text.read_deadline_s`` in all:
        a source still reading then stops, and it and the sources after it read nothing (each says so in
        ``errors``); the words of the sources that finished are kept."""
        out = TextExtraction()
        deadline = WordsDeadline(self._text.read_deadline_s)
        if self._text.subtitles:
            self._run(out, TextSource.SUBTITLE, lambda: self._subtitles(path, deadline))
        if self._text.ocr:
            self._run(out, TextSource.OCR, lambda: self._read_ocr(path, deadline))
        if self._text.speech:
            self._run(out, TextSource.SPEECH, lambda: self._read_speech(path, deadline))
        out.segments.sort(key=lambda s: (s.start_s, s.source.value))
        # The words are the uploader's: each segment is cut to its cap, and the video's words end at theirs.
        limits = self._settings.limits
        out.segments, out.left_out = capped_words(out.segments, limits.max_segment_chars, limits.max_video_text_chars)
        return out

    def _run(self, out: TextExtraction, source: TextSource, read: Callable[[], list[TextSegment]]) -> None:
        """One source: its segments, or why it read none of this video. Only what the input decides is
        kept as a reason (the readers convert their libraries' errors on bad input to these); a
        transient failure, or a reader that can't start (``OcrUnavailable``), goes to the caller."""
        started = time.perf_counter()
        try:
            out.segments.extend(read())  # a deadline passed raises LimitExceeded (before or while reading)
        except (CorruptVideo, NotAVideo, LimitExceeded) as exc:
            out.errors[source.value] = str(exc)
        finally:
            out.seconds[source.value] = round(time.perf_counter() - started, 4)

    def _subtitles(self, path: Path, deadline: WordsDeadline) -> list[TextSegment]:
        from pipeline.text.subtitles import read_subtitles

        deadline.check()
        limits = self._settings.limits
        caps = (limits.max_segment_chars, limits.max_video_text_chars)
        return read_subtitles(path, max_chars=caps, deadline=deadline)

    def _read_ocr(self, path: Path, deadline: WordsDeadline) -> list[TextSegment]:
        from pipeline.media.decode import sample_frames
        from pipeline.text.ocr import OcrReader

        deadline.check()
        if self._ocr is None:
            t = self._text
            self._ocr = OcrReader(t.ocr_tessdata, t.ocr_language, t.ocr_min_confidence, min_side=t.ocr_min_side)
        sampling = Sampling(self._text.ocr_every_s, SamplingStrategy.INTERVAL)
        frames = sample_frames(path, sampling, self._settings.limits, max_side=self._text.ocr_max_side)
        return self._ocr.read_frames(frames, self._text.ocr_every_s, deadline)

    def _read_speech(self, path: Path, deadline: WordsDeadline) -> list[TextSegment]:
        from pipeline.text.speech import SpeechRecognizer

        deadline.check()
        if self._speech is None:
            self._speech = SpeechRecognizer(
                max_audio_s=self._settings.limits.max_duration_s, alternatives=self._text.speech_alternatives
            )
        return self._speech.read_file(path, deadline)
