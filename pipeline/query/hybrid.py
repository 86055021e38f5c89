"""Hybrid search's pure parts: what a query asks of the words (its terms, its quoted phrases), which
words of a segment it matched, and the fusion of the visual moments with the text matches by
weighted reciprocal rank (a visual rank r counts 1/(RRF_K + r), a words rank TEXT_WEIGHT·held/(RRF_K + r);
a text match and a visual moment of one video that overlap in time are one moment, which both lists
count)."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar

from pipeline.query.moments import Moment

#: Reciprocal rank fusion's constant (Cormack, Clarke and Büttcher, 2009): ranks past the first few
#: weigh nearly alike, so a moment both lists find beats one either list ranks first alone.
RRF_K = 60
#: A text match and a visual moment of one video join when their spans come this close (seconds).
JOIN_S = 1.0
#: What a rank of the words' list counts against the same rank of the frames' (weighted RRF): the words
#: a query names, said or shown, outrank a picture that merely resembles it, so word matches lead and
#: the visual moments follow; a moment both find leads them all. (Measured by ``bench.relevance``: with
#: equal weights the frames' list, with the random weights this machine has, took half the top five.)
TEXT_WEIGHT = 2.0
VISUAL = "visual"
#: What ``?sources=`` may name: the visual search and each text source.
SOURCES = (VISUAL, "subtitle", "ocr", "speech")

#: What a query word heard only in an alternative reading of speech counts, against one in the best
#: reading (``pipeline.text.speech``); a word one letter away counts ``NEAR_WEIGHT`` of an exact one.
ALTERNATIVE_WEIGHT = 0.5
NEAR_WEIGHT = 1 / 3
#: The words' search reads this many rows per match it answers: an utterance's readings (the best one
#: and about six alternatives kept of ten looked at) answer once.
READINGS_READ = 8

_WORD = re.compile(r"\w+", re.UNICODE)
_PHRASE = re.compile(r'"([^"]*)"')


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
            found.update(w.lower() for w in _WORD.findall(phrase))
        return frozenset(found)


def parse_query(q: str) -> TextQuery:
    phrases = tuple(p.strip() for p in _PHRASE.findall(q) if _WORD.search(p))
    rest = _PHRASE.sub(" ", q).replace('"', " ")
    words = tuple(_WORD.findall(rest))
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
    return [(m.start(), m.end()) for m in _WORD.finditer(text) if _matches(m.group().lower(), terms, near)]


def _matches(word: str, terms: Collection[str], near: bool) -> bool:
    return word in terms or (near and next(_near_terms(word, terms), None) is not None)


def _near_terms(word: str, terms: Collection[str]) -> Iterator[str]:
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


class Reading(Protocol):
    """A text search's hit as ``rank_words`` reads it (``storage.texts.TextHit``)."""

    @property
    def segment_id(self) -> str: ...
    @property
    def video_id(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def start_s(self) -> float: ...
    @property
    def end_s(self) -> float: ...
    @property
    def text(self) -> str: ...
    @property
    def alternative(self) -> int: ...


R = TypeVar("R", bound=Reading)


def rank_words(hits: Iterable[R], terms: Collection[str], *, near: bool = False) -> list[Ranked[R]]:
    """The text search's hits (BM25 order) as matches, best first, each with the share (0..1) of the
    query's words its moment holds and its moment's number: the moments holding more of them first,
    then BM25.

    A moment is one video's segments that come within ``JOIN_S`` of each other, one after another (a
    caption shown while a sentence is said); the readings of one utterance (one span of one video's
    speech) are one segment, answered with the reading that counts most (below; the best reading on a
    tie). A moment counts each query word once: 1 where a segment reads it, ``ALTERNATIVE_WEIGHT`` where
    only an alternative reading of the speech heard it, each times ``NEAR_WEIGHT`` where the word is one
    letter away (``near``). Each moment's segments come one after the other, the one counting most first;
    ``fuse`` makes them one moment."""
    units: dict[tuple[str, ...], _Unit[R]] = {}
    for n, h in enumerate(hits):
        key = (h.video_id, h.version, repr(h.start_s), repr(h.end_s)) if h.source == "speech" else (h.segment_id,)
        unit = units.get(key)
        if unit is None:
            unit = units[key] = _Unit(h, n)
        unit.add(h, _heard(h.text, terms, near, ALTERNATIVE_WEIGHT if h.alternative else 1.0))
    moments: list[list[_Unit[R]]] = []
    by_video: dict[str, list[_Unit[R]]] = {}
    for unit in units.values():
        by_video.setdefault(unit.chosen.video_id, []).append(unit)
    for video_units in by_video.values():
        video_units.sort(key=lambda u: u.chosen.start_s)
        current: list[_Unit[R]] = []
        until = float("-inf")
        for unit in video_units:
            if current and unit.chosen.start_s - JOIN_S <= until:
                current.append(unit)
                until = max(until, unit.chosen.end_s)
            else:
                current = [unit]
                moments.append(current)
                until = unit.chosen.end_s
    scored = []
    for members in moments:
        heard: dict[str, float] = {}
        for unit in members:
            for term, w in unit.heard.items():
                heard[term] = max(heard.get(term, 0.0), w)
        members.sort(key=lambda u: (-u.own, u.first))
        scored.append((sum(heard.values()), min(u.first for u in members), members))
    scored.sort(key=lambda m: (-m[0], m[1]))
    share = 1 / max(len(terms), 1)
    # The full-text index matched something in each hit even where these words don't see it (its tokenizer
    # folds what ``_WORD`` keeps apart): such a hit holds the least a match can.
    least = ALTERNATIVE_WEIGHT * NEAR_WEIGHT
    return [
        Ranked(unit.chosen, min(max(held, least) * share, 1.0), n)
        for n, (held, _, members) in enumerate(scored)
        for unit in members
    ]


@dataclass(frozen=True, slots=True)
class Ranked(Generic[R]):
    """A hit of ``rank_words``: the share of the query's words its moment holds, and which moment."""

    hit: R
    held: float
    moment: int


class _Unit(Generic[R]):
    """One segment of ``rank_words``: the readings of one utterance (or a segment of another source)."""

    def __init__(self, first: R, position: int) -> None:
        self.chosen = first
        self.first = position
        self.own = -1.0
        self.heard: dict[str, float] = {}

    def add(self, reading: R, heard: dict[str, float]) -> None:
        for term, w in heard.items():
            self.heard[term] = max(self.heard.get(term, 0.0), w)
        own = sum(heard.values())
        if own > self.own or (own == self.own and reading.alternative < self.chosen.alternative):
            self.chosen, self.own = reading, own


def _heard(text: str, terms: Collection[str], near: bool, weight: float) -> dict[str, float]:
    """Each query term ``text`` holds, and what it counts (exact: ``weight``; one letter away: less)."""
    found: dict[str, float] = {}
    for m in _WORD.finditer(text):
        word = m.group().lower()
        if word in terms:
            found[word] = weight
        elif near:
            for t in _near_terms(word, terms):
                found[t] = max(found.get(t, 0.0), weight * NEAR_WEIGHT)
    return found


@dataclass(frozen=True, slots=True)
class TextMatch:
    """One matched segment of a video's words, best first in its list."""

    video_id: str
    uri: str
    start_s: float
    end_s: float
    text: str
    source: str
    #: When the first matched word is said (speech gives each word's start), else the segment's start.
    ts_s: float
    marks: tuple[tuple[int, int], ...] = ()
    #: The share of the query's words its moment holds (``rank_words``): what its rank counts in ``fuse``.
    held: float = 1.0
    #: Its moment of ``rank_words`` (None: none given): matches of one moment are one moment of ``fuse``.
    moment: int | None = None


@dataclass(frozen=True, slots=True)
class Fused:
    """A moment of the fused list: the visual moment (None: found by its words only), the text match
    (None: found by its picture only), its fused score and the sources that found it."""

    video_id: str
    uri: str
    start_s: float
    end_s: float
    ts_s: float
    score: float
    sources: tuple[str, ...]
    visual: Moment | None = None
    text: TextMatch | None = None


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
        words = list(_WORD.finditer(hit_text))
        first = next((n for n, m in enumerate(words) if _matches(m.group().lower(), terms, near)), None)
        if first is not None and first < len(word_starts):
            ts = min(max(float(word_starts[first]), start_s), end_s)
    return ts, spans


def fuse(visual: Sequence[Moment], texts: Sequence[TextMatch], k: int) -> list[Fused]:
    """The ``k`` best moments of both lists by weighted reciprocal rank: a text match joins the best-ranked
    visual moment of its video whose span comes within ``JOIN_S`` of it (at most one text match per visual
    moment: the best); the frames' rank r adds 1/(RRF_K + r), the words' TEXT_WEIGHT·held/(RRF_K + r) (a
    match holding half the query's words counts half); text matches of one ``rank_words`` moment join
    where the first of them went. Ties: earlier video id, earlier time."""
    fused: list[Fused] = []
    joined: dict[int, int] = {}  # visual rank -> index in fused
    for rank, m in enumerate(visual, start=1):
        joined[rank] = len(fused)
        fused.append(Fused(m.video_id, m.uri, m.start_s, m.end_s, m.ts_s, 1 / (RRF_K + rank), (VISUAL,), visual=m))
    went: dict[int, int] = {}  # rank_words moment -> index in fused
    for rank, t in enumerate(texts, start=1):
        if t.moment is not None and t.moment in went:
            fused[went[t.moment]] = _joined(fused[went[t.moment]], t)  # the words' list counts once
            continue
        at = _place(fused, joined, visual, t, TEXT_WEIGHT * t.held / (RRF_K + rank))
        if t.moment is not None:
            went[t.moment] = at
    fused.sort(key=lambda f: (-f.score, f.video_id, f.start_s))
    return fused[:k]


def _place(fused: list[Fused], joined: dict[int, int], visual: Sequence[Moment], t: TextMatch, score: float) -> int:
    """Text match ``t`` (worth ``score``) put in ``fused``: joined to its visual partner, to the moment
    another source's words at the same time made, or as a moment of its own; where it went."""
    partner = next((r for r, m in enumerate(visual, start=1) if _near(m, t) and fused[joined[r]].text is None), None)
    if partner is None:
        # The moment a visual one became with another source's words at the same time (the speech
        # of a subtitled line) takes these too.
        worded = next((r for r, m in enumerate(visual, start=1) if _near(fused[joined[r]], t)), None)
        if worded is not None:
            f = fused[joined[worded]]
            if f.text is not None and _near_text(f.text, t):
                fused[joined[worded]] = _joined(f, t)  # the words' list counts once
                return joined[worded]
        # Another source's words at the same time (the subtitle and the speech of one line) join too.
        at = next((n for n, f in enumerate(fused) if f.visual is None and _near(f, t)), None)
        if at is None:
            fused.append(Fused(t.video_id, t.uri, t.start_s, t.end_s, t.ts_s, score, (t.source,), text=t))
            return len(fused) - 1
        # it says which sources found the moment; the words' list counts once (its best rank)
        fused[at] = _joined(fused[at], t)
        return at
    at = joined[partner]
    both = fused[at]
    fused[at] = replace(
        both,
        # The words pin the moment down: where they are said or shown, not the frames' looser span.
        start_s=t.start_s,
        end_s=t.end_s,
        ts_s=t.ts_s,
        score=both.score + score,
        sources=(*both.sources, t.source),
        text=t,
    )
    return at


def _joined(f: Fused, t: TextMatch) -> Fused:
    """Moment ``f`` with the words of ``t`` (at the same time) joined: its sources, and — where ``t``
    holds a query word said or shown earlier — the player starting there (the first matched word)."""
    sources = f.sources if t.source in f.sources else (*f.sources, t.source)
    if t.marks and t.ts_s < f.ts_s:
        return replace(f, sources=sources, start_s=min(f.start_s, t.start_s), ts_s=t.ts_s)
    return replace(f, sources=sources)


def _near_text(a: TextMatch, t: TextMatch) -> bool:
    """Whether two text matches of one video come within ``JOIN_S`` of each other."""
    return a.video_id == t.video_id and a.start_s - JOIN_S <= t.end_s and t.start_s <= a.end_s + JOIN_S


def _near(a: Moment | Fused, t: TextMatch) -> bool:
    """Whether a moment of ``t``'s video comes within ``JOIN_S`` of its span."""
    return a.video_id == t.video_id and a.start_s - JOIN_S <= t.end_s and t.start_s <= a.end_s + JOIN_S
