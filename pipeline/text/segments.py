"""A timed piece of text from one source, and the text clean-up every source shares."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum

from storage.errors import LimitExceeded
from storage.texts import capped_text


class TextSource(StrEnum):
    SUBTITLE = "subtitle"
    OCR = "ocr"
    SPEECH = "speech"


@dataclass(frozen=True, slots=True)
class TextSegment:
    """``text`` shown or said from ``start_s`` to ``end_s`` (seconds on the player's timeline).

    ``confidence``: 0..1 (subtitles: 1; OCR: the words' mean confidence in the best-read frame of the
    segment; speech: the recogniser's mean word posterior). ``word_starts``: when each word of ``text``
    (split on whitespace) starts, where the source knows it (speech), so a match points at the word
    rather than the segment's start; else empty.
    ``track``: which subtitle stream, as ``<index>`` or ``<index>:<language>`` (other sources: empty).
    ``alternative``: 0 for what the source read; n > 0 for the n-th other reading of the same words kept
    (speech: a less likely hypothesis that heard a word the best one did not), ranked below."""

    start_s: float
    end_s: float
    text: str
    source: TextSource
    confidence: float = 1.0
    word_starts: tuple[float, ...] = ()
    track: str = ""
    alternative: int = 0

    def __post_init__(self) -> None:
        if self.end_s < self.start_s:
            raise ValueError(f"a segment ends ({self.end_s}) before it starts ({self.start_s})")
        if self.word_starts and len(self.word_starts) != len(self.text.split()):
            raise ValueError("word_starts must give one start per word of text")

    def time_of(self, word_index: int) -> float:
        """When word ``word_index`` of ``text`` starts (the segment's start where words aren't timed)."""
        if 0 <= word_index < len(self.word_starts):
            return self.word_starts[word_index]
        return self.start_s


# Each pattern stops at the next opening character, so a scan from one opening ends where the next
# begins: the clean-up is linear in the text, whatever it holds (a cue of ``{{{{…`` or ``<a<a<a…`` with no
# closing made the patterns that ran on to the closing quadratic: an 80 KB cue took 2.3 s, 1 MB minutes).
_ASS_TAGS = re.compile(r"\{[^{}]*\}")
_MARKUP = re.compile(r"</?[a-zA-Z][^<>]*>")
_SPACE = re.compile(r"\s+")

#: Of one cue or one frame's text, at most this many characters are cleaned (a segment keeps far fewer:
#: ``LimitSettings.max_segment_chars``); the rest is dropped unread.
MAX_RAW_CHARS = 64 * 1024


def clean_text(raw: str) -> str:
    """Subtitle or OCR text as words: ASS override tags (``{\\i1}``), HTML-like markup (SRT's ``<i>``,
    WebVTT's ``<c.yellow>``), ASS line breaks (``\\N``, ``\\n``, ``\\h``) and runs of whitespace go. Linear
    in ``raw``, of which the first ``MAX_RAW_CHARS`` are read."""
    text = _ASS_TAGS.sub("", raw[:MAX_RAW_CHARS])
    text = text.replace("\\N", " ").replace("\\n", " ").replace("\\h", " ")
    text = _MARKUP.sub("", text)
    return _SPACE.sub(" ", text).strip()


def capped(segment: TextSegment, max_chars: int) -> TextSegment:
    """``segment`` with its text cut to at most ``max_chars`` characters, at a word (a first word longer
    than that is cut inside), and the starts of the words kept; itself when it is within."""
    if len(segment.text) <= max_chars:
        return segment
    text = capped_text(segment.text, max_chars)
    return replace(segment, text=text, word_starts=segment.word_starts[: len(text.split())])


def capped_words(segments: list[TextSegment], max_segment_chars: int, max_chars: int) -> tuple[list[TextSegment], int]:
    """A video's segments (in the order given: time) with each one's text ``capped`` and the segments that
    would take the video's words past ``max_chars`` characters left out; and how many were left out."""
    kept: list[TextSegment] = []
    total = 0
    for n, segment in enumerate(segments):
        segment = capped(segment, max_segment_chars)
        total += len(segment.text)
        if total > max_chars:
            return kept, len(segments) - n
        kept.append(segment)
    return kept, 0


class WordsDeadline:
    """When reading a video's words must end: each source asks ``check`` between its units of work (a
    subtitle packet, a frame, an audio frame, an utterance), each bounded by itself, so a reading ends
    at most one unit past it. None: no deadline."""

    def __init__(self, seconds: float | None, clock: Callable[[], float] | None = None) -> None:
        self._seconds = seconds
        self._clock = clock or time.monotonic
        self._ends = None if seconds is None else self._clock() + seconds

    def check(self) -> None:
        """Raises:
        LimitExceeded: the deadline passed (the message names the setting).
        """
        if self._ends is not None and self._clock() >= self._ends:
            raise LimitExceeded(f"reading the words ran past text.read_deadline_s ({self._seconds:g}s)")


#: No deadline (tools and tests that read a file's words by themselves).
NO_DEADLINE = WordsDeadline(None)
