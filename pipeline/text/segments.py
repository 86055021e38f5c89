"""A timed piece of text from one source, and the text clean-up every source shares."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


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


_ASS_TAGS = re.compile(r"\{[^}]*\}")
_MARKUP = re.compile(r"</?[a-zA-Z][^>]*>")
_SPACE = re.compile(r"\s+")


def clean_text(raw: str) -> str:
    """Subtitle or OCR text as words: ASS override tags (``{\\i1}``), HTML-like markup (SRT's ``<i>``,
    WebVTT's ``<c.yellow>``), ASS line breaks (``\\N``, ``\\n``, ``\\h``) and runs of whitespace go."""
    text = _ASS_TAGS.sub("", raw)
    text = text.replace("\\N", " ").replace("\\n", " ").replace("\\h", " ")
    text = _MARKUP.sub("", text)
    return _SPACE.sub(" ", text).strip()
