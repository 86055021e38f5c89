"""What a query asks of the words: its terms and quoted phrases, the sources it names, which words of a
segment it matched (exactly, or one letter away) and where in the segment the first of them is."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

VISUAL = "visual"
#: What ``?sources=`` may name: the visual search and each text source.
SOURCES = (VISUAL, "subtitle", "ocr", "speech")

WORD = re.compile(r"\w+", re.UNICODE)
#: Quoted phrases a text search looks for at most (each is a search of its own); later ones are not.
MAX_QUERY_PHRASES = 4
PHRASE = re.compile(r'"([^"]*)"')


@dataclass(frozen=True, slots=True)
class TextQuery:
    """A search's query as the text search reads it: the quoted phrases (each a run of words that must
    appear in order, next to each other) and the free words; ``visual`` is the query for the image model
    (the quotes taken out)."""

    visual: str
    phrases: tuple[str, ...]
    words: tuple[str, ...]

    @property
    def terms(self) -> frozenset[str]:
        """Every word the query names (lower case): what is marked in a matched segment."""
        found = {w.lower() for w in self.words}
        for phrase in self.phrases:
            found.update(w.lower() for w in WORD.findall(phrase))
        return frozenset(found)

    def bounded(self, max_words: int, max_phrases: int = MAX_QUERY_PHRASES) -> TextQuery:
        """The query with at most ``max_words`` distinct words (any case) and ``max_phrases`` quoted phrases:
        its phrases first, in order (one that would pass the words' cap is cut to the words that fit, and
        ends them), then its free words, in order. ``visual`` is kept. Itself when within both."""
        distinct: set[str] = set()

        def fits(word: str) -> bool:
            if word.lower() not in distinct and len(distinct) >= max_words:
                return False
            distinct.add(word.lower())
            return True

        phrases: list[str] = []
        for phrase in self.phrases[:max_phrases]:
            words = WORD.findall(phrase)
            fit = words[: next((n for n, w in enumerate(words) if not fits(w)), len(words))]
            if fit:
                phrases.append(phrase if len(fit) == len(words) else " ".join(fit))
            if len(fit) < len(words):
                break
        kept = tuple(w for w in self.words if fits(w))
        if tuple(phrases) == self.phrases and kept == self.words:
            return self
        return TextQuery(self.visual, tuple(phrases), kept)


def parse_query(q: str) -> TextQuery:
    phrases = tuple(p.strip() for p in PHRASE.findall(q) if WORD.search(p))
    rest = PHRASE.sub(" ", q).replace('"', " ")
    words = tuple(WORD.findall(rest))
    visual = " ".join(q.replace('"', " ").split())
    return TextQuery(visual, phrases, words)


def parse_sources(raw: str | None) -> frozenset[str]:
    """``?sources=visual,subtitle,ocr,speech`` (any of them, comma separated; none: all).

    Raises:
        ValueError: a name that is not a source.
    """
    if raw is None or not raw.strip():
        return frozenset(SOURCES)
    names = {s.strip().lower() for s in raw.split(",") if s.strip()}
    unknown = names - set(SOURCES)
    if unknown:
        raise ValueError(f"unknown sources {sorted(unknown)}: each of {', '.join(SOURCES)}")
    return frozenset(names)


def marks(text: str, terms: Collection[str], *, near: bool = False) -> list[tuple[int, int]]:
    """The [start, end) character spans of ``text``'s words that are among ``terms`` (any case); ``near``:
    also those one letter away from one (same first letter), as a fuzzy search matches them."""
    return [(m.start(), m.end()) for m in WORD.finditer(text) if matches(m.group().lower(), terms, near)]


def matches(word: str, terms: Collection[str], near: bool) -> bool:
    return word in terms or (near and next(near_terms(word, terms), None) is not None)


def near_terms(word: str, terms: Collection[str]) -> Iterator[str]:
    """The terms one letter away from ``word`` with its first letter (what a fuzzy search matches)."""
    return (t for t in terms if t[:1] == word[:1] and _one_edit(word, t))


def _one_edit(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ by one letter changed, added or dropped."""
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b, strict=True)) == 1
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    return any(long_[:i] + long_[i + 1 :] == short for i in range(len(long_)))


def text_match(
    hit_text: str,
    start_s: float,
    end_s: float,
    word_starts: Sequence[float],
    terms: Collection[str],
    *,
    near: bool = False,
) -> tuple[float, tuple[tuple[int, int], ...]]:
    """Where in a segment the query's words are: the time of the first matched word (its own start where
    the source gives one per word, else the segment's) and the spans to mark (``near``: as ``marks``)."""
    spans = tuple(marks(hit_text, terms, near=near))
    ts = start_s
    if spans and word_starts:
        words = list(WORD.finditer(hit_text))
        first = next((n for n, m in enumerate(words) if matches(m.group().lower(), terms, near)), None)
        if first is not None and first < len(word_starts):
            ts = min(max(float(word_starts[first]), start_s), end_s)
    return ts, spans
