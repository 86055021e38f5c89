"""The words side of a search: the segments of the text table that match a query (``search_words``), and
of those, the ones that are their video's words as the catalog has it now (``current_matches``). Both run
off the event loop (``pipeline.query.search`` calls them on threads), and both read a segment's text only
up to ``LimitSettings.max_segment_chars``: the words are the uploader's, and rows written before that cap
may be longer (a 1.2 MB segment took 4 s of the loop per search when it was matched there in full)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from pipeline.query.hybrid import READINGS_READ, Ranked, TextMatch, rank_words
from pipeline.query.terms import TextQuery, text_match
from storage.catalog import VideoRecord
from storage.ids import text_fingerprint
from storage.models import ModelTable
from storage.texts import TextHit, TextTable, capped_text

#: Candidate rows a search reads at most (frames or segments).
MAX_CANDIDATES = 2000


def capped(hits: Iterable[TextHit], max_chars: int) -> list[TextHit]:
    """The hits with each text cut to ``max_chars`` characters at a word, as a text job cuts a segment
    (``capped_text``), and its word starts to the words left."""
    out = []
    for h in hits:
        if len(h.text) > max_chars:
            text = capped_text(h.text, max_chars)
            h = replace(h, text=text, word_starts=h.word_starts[: len(text.split())])
        out.append(h)
    return out


def search_words(
    table: TextTable, query: TextQuery, limit: int, sources: list[str], fuzzy: bool, max_chars: int
) -> list[Ranked[TextHit]]:
    """The ``limit`` best matches of the query and the share of its words each holds (``rank_words``):
    segments with every quoted phrase (its words in order), or — with none — any of its words
    (``fuzzy``: near words too, below exact ones). Each hit's text is read up to ``max_chars`` (``capped``)."""
    read = max(limit, min(limit * READINGS_READ, MAX_CANDIDATES))
    near = fuzzy and not query.phrases
    if not query.phrases:
        found_any = capped(table.search(" ".join(query.words), read, sources, fuzzy=fuzzy), max_chars)
        return rank_words(found_any, query.terms, near=near)[:limit]
    found: dict[str, TextHit] = {}
    scores: dict[str, float] = {}
    for n, phrase in enumerate(query.phrases):
        hits = {h.segment_id: h for h in capped(table.search(phrase, read, sources, phrase=True), max_chars)}
        found = hits if n == 0 else {sid: h for sid, h in found.items() if sid in hits}
        for sid, h in hits.items():
            scores[sid] = scores.get(sid, 0.0) + h.score
    by_score = sorted(found.values(), key=lambda h: -scores[h.segment_id])
    return rank_words(by_score, query.terms)[:limit]


def current_matches(
    hits: list[Ranked[TextHit]], records: dict[str, VideoRecord], text: ModelTable, query: TextQuery, fuzzy: bool
) -> list[TextMatch]:
    """The hits whose rows are the words of their video as the catalog has it now (its text entry, at
    its version): words of an overwritten or deleted video's old version are never answered."""
    pipeline = text.pipeline or ""
    terms = query.terms
    matches = []
    for ranked in hits:
        h = ranked.hit
        record = records.get(h.video_id)
        entry = record.index_in(text.table) if record is not None else None
        if record is None or entry is None or record.version != h.version:
            continue
        if entry.fingerprint != text_fingerprint(h.version, pipeline):
            continue
        ts, spans = text_match(h.text, h.start_s, h.end_s, h.word_starts, terms, near=fuzzy and not query.phrases)
        matches.append(
            TextMatch(
                h.video_id,
                h.uri,
                h.start_s,
                h.end_s,
                h.text,
                h.source,
                ts,
                spans,
                ranked.held,
                ranked.moment,
                ranked.lead,
            )
        )
    return matches
