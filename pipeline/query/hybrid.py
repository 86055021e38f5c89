"""Hybrid search's pure parts beside ``pipeline.query.terms``: the words' hits ranked by how many of the
query's words their moment holds (``rank_words``), and the fusion of the visual moments with the text matches by
weighted reciprocal rank (a visual rank r counts 1/(RRF_K + r), a words rank TEXT_WEIGHT·held/(RRF_K + r);
a text match and a visual moment of one video that overlap in time are one moment, which both lists
count)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar

from pipeline.query.moments import Moment
from pipeline.query.terms import VISUAL, WORD, near_terms

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

#: What a query word heard only in an alternative reading of speech counts, against one in the best
#: reading (``pipeline.text.speech``); a word one letter away counts ``NEAR_WEIGHT`` of an exact one.
ALTERNATIVE_WEIGHT = 0.5
NEAR_WEIGHT = 1 / 3
#: The words' search reads this many rows per match it answers: an utterance's readings (the best one
#: and about twenty alternatives kept of the fifty looked at) answer once.
READINGS_READ = 24

#: Two segments of one source this close (seconds) are one after the other, with no gap between.
_TOUCH_S = 0.05


class _Words(Protocol):
    """A segment's words where they are: a ``Reading`` or a ``TextMatch``."""

    @property
    def source(self) -> str: ...
    @property
    def start_s(self) -> float: ...
    @property
    def end_s(self) -> float: ...
    @property
    def text(self) -> str: ...


class Reading(_Words, Protocol):
    """A text search's hit as ``rank_words`` reads it (``storage.texts.TextHit``)."""

    @property
    def segment_id(self) -> str: ...
    @property
    def video_id(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def alternative(self) -> int: ...


R = TypeVar("R", bound=Reading)


def rank_words(hits: Iterable[R], terms: Collection[str], *, near: bool = False) -> list[Ranked[R]]:
    """The text search's hits (BM25 order) as matches, best first, each with the share (0..1) of the
    query's words its moment holds and its moment's number: the moments holding more of them first,
    then BM25.

    A moment is one video version's segments that are words of one moment (``_one_moment``: a caption
    shown while a sentence is said; one caption read again on the next frame; not the next caption or
    cue after a gap);
    the readings of one utterance (one span of one video's speech) are one segment, answered with the
    reading that counts most (below; the best reading on a tie). A moment counts each query word once:
    1 where a segment reads it, ``ALTERNATIVE_WEIGHT`` where only an alternative reading of the speech
    heard it, each times ``NEAR_WEIGHT`` where the word is one letter away (``near``). Each moment's
    segments come one after the other, the one counting most first;
    ``fuse`` makes them one moment."""
    units: dict[tuple[str, ...], _Unit[R]] = {}
    for n, h in enumerate(hits):
        key = (h.video_id, h.version, repr(h.start_s), repr(h.end_s)) if h.source == "speech" else (h.segment_id,)
        unit = units.get(key)
        if unit is None:
            unit = units[key] = _Unit(h, n)
        unit.add(h, _heard(h.text, terms, near, ALTERNATIVE_WEIGHT if h.alternative else 1.0))
    moments: list[list[_Unit[R]]] = []
    by_video: dict[tuple[str, str], list[_Unit[R]]] = {}  # one version's words: another's are not shown
    for unit in units.values():
        by_video.setdefault((unit.chosen.video_id, unit.chosen.version), []).append(unit)
    for video_units in by_video.values():
        video_units.sort(key=lambda u: u.chosen.start_s)
        current: list[_Unit[R]] = []
        reach = 0.0  # the latest end in ``current``: a segment starting past it by JOIN_S is of no moment of it
        for unit in video_units:
            at = unit.chosen.start_s
            if current and at - JOIN_S <= reach and any(_one_moment(u.chosen, unit.chosen) for u in reversed(current)):
                current.append(unit)
                reach = max(reach, unit.chosen.end_s)
            else:
                current = [unit]
                reach = unit.chosen.end_s
                moments.append(current)
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
    # folds what ``terms.WORD`` keeps apart): such a hit holds the least a match can.
    least = ALTERNATIVE_WEIGHT * NEAR_WEIGHT
    return [
        Ranked(unit.chosen, min(max(held, least) * share, 1.0), n, lead=_leads(unit, members[0]))
        for n, (held, _, members) in enumerate(scored)
        for unit in members
    ]


def _leads(unit: _Unit[R], best: _Unit[R]) -> bool:
    """Whether a moment may start at ``unit``: it counts as much as the moment's ``best`` segment, or it is
    the same line read in part (one source, half its words or more among the best's: a caption's first
    frames read one word of it), not the line before it (which may share a word with a part-read best)."""
    a, b = unit.chosen, best.chosen
    return unit.own >= best.own or (a.source == b.source and _shares_half(a.text, b.text, of_first=True))


def _shares_half(a: str, b: str, *, of_first: bool = False) -> bool:
    """Whether two texts share half the words of the shorter (``of_first``: of ``a``), or more."""
    words = [{w.lower() for w in WORD.findall(x)} for x in (a, b)]
    least = len(words[0]) if of_first else min(len(w) for w in words)
    return 2 * len(words[0] & words[1]) >= least > 0


def _one_moment(a: _Words, b: _Words) -> bool:
    """Whether two segments of one video are words of one moment: of two
    sources, within ``JOIN_S`` of each other (a caption shown while a sentence is said); of one source,
    over the same time or one right after the other (a second subtitle track; one caption's frames read
    in part, one part on each), or within ``JOIN_S`` and sharing half the words of the shorter (one
    caption read again after a frame that read nothing). One source's next line after a gap is a moment
    of its own: the next caption shown, the next cue."""
    near = b.start_s - JOIN_S <= a.end_s and a.start_s - JOIN_S <= b.end_s
    if a.source != b.source or not near:
        return near
    if b.start_s <= a.end_s + _TOUCH_S and a.start_s <= b.end_s + _TOUCH_S:
        return True
    return _shares_half(a.text, b.text)


@dataclass(frozen=True, slots=True)
class Ranked(Generic[R]):
    """A hit of ``rank_words``: the share of the query's words its moment holds, which moment, and whether
    its moment may start there (``lead``: it holds as many of them as any segment of its moment, or it is a
    part-read of that segment's line, ``_leads``)."""

    hit: R
    held: float
    moment: int
    lead: bool = True


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
    for m in WORD.finditer(text):
        word = m.group().lower()
        if word in terms:
            found[word] = weight
        elif near:
            for t in near_terms(word, terms):
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
    #: The moment may start at its words (``Ranked.lead``): a caption of other words holding one of the
    #: query's, shown right before the one holding both, does not move the start.
    lead: bool = True


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
            fused[went[t.moment]] = _joined(fused[went[t.moment]], t, move=t.lead)  # the words' list counts once
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
                fused[joined[worded]] = _joined(f, t, move=t.lead)  # the words' list counts once
                return joined[worded]
        # Another source's words at the same time (the subtitle and the speech of one line) join too.
        at = next(
            (n for n, f in enumerate(fused) if f.visual is None and f.text is not None and _near_text(f.text, t)), None
        )
        if at is None:
            fused.append(Fused(t.video_id, t.uri, t.start_s, t.end_s, t.ts_s, score, (t.source,), text=t))
            return len(fused) - 1
        # it says which sources found the moment; the words' list counts once (its best rank)
        fused[at] = _joined(fused[at], t, move=t.lead)
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


def _joined(f: Fused, t: TextMatch, *, move: bool = True) -> Fused:
    """Moment ``f`` with the words of ``t`` (at the same time) joined: its sources, and — where ``t``
    holds a query word said or shown earlier (and ``move``) — the player starting there (the first
    matched word)."""
    sources = f.sources if t.source in f.sources else (*f.sources, t.source)
    if move and t.marks and t.ts_s < f.ts_s:
        return replace(f, sources=sources, start_s=min(f.start_s, t.start_s), ts_s=t.ts_s)
    return replace(f, sources=sources)


def _near_text(a: TextMatch, t: TextMatch) -> bool:
    """Whether two text matches of one video are words of one moment (``_one_moment``)."""
    return a.video_id == t.video_id and _one_moment(a, t)


def _near(a: Moment | Fused, t: TextMatch) -> bool:
    """Whether a moment of ``t``'s video comes within ``JOIN_S`` of its span."""
    return a.video_id == t.video_id and a.start_s - JOIN_S <= t.end_s and t.start_s <= a.end_s + JOIN_S
