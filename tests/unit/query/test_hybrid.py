"""Hybrid search: the query's words and quoted phrases, the marks in a matched segment, reciprocal rank
fusion of the visual moments with the text matches (``pipeline.query.hybrid``), and ``SearchService``
over videos indexed by the real ``Indexer`` and text jobs into a local LanceDB (subtitles)."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from numpy.typing import NDArray

from events.jobs import JobSource
from infra.dev.textclips import Cue
from pipeline.query.hybrid import (
    ALTERNATIVE_WEIGHT,
    NEAR_WEIGHT,
    RRF_K,
    TEXT_WEIGHT,
    Ranked,
    TextMatch,
    fuse,
    rank_words,
)
from pipeline.query.moments import Moment
from pipeline.query.search import SearchResponse, SearchService
from pipeline.query.terms import marks, parse_query, parse_sources, text_match
from pipeline.settings import Settings, TextSettings
from storage.errors import InvalidInput
from storage.frames import FRAMES
from storage.models import ModelTable
from storage.texts import TextHit
from tests.unit.index.test_indexer import MeanColour
from tests.unit.index.test_text_jobs import TEXT, Parts, job


def test_a_query_splits_into_quoted_phrases_and_free_words() -> None:
    q = parse_query('slide "Quarterly Revenue" growth "" "')
    assert q.phrases == ("Quarterly Revenue",) and q.words == ("slide", "growth")
    assert q.visual == "slide Quarterly Revenue growth"
    assert q.terms == {"slide", "growth", "quarterly", "revenue"}


def test_sources_name_the_visual_search_and_each_text_source() -> None:
    assert parse_sources(None) == {"visual", "subtitle", "ocr", "speech"}
    assert parse_sources(" OCR, speech ") == {"ocr", "speech"}
    with pytest.raises(ValueError, match="unknown sources"):
        parse_sources("visual,audio")


def test_the_matched_words_are_marked_whatever_their_case() -> None:
    text = "The Red boat, the red sky"
    assert [text[a:b] for a, b in marks(text, {"red", "boat"})] == ["Red", "boat", "red"]


def test_a_fuzzy_search_marks_the_words_a_letter_away_too() -> None:
    text = "Architecture Reviev, a preview, Review"
    assert [text[a:b] for a, b in marks(text, {"review"})] == ["Review"]
    assert [text[a:b] for a, b in marks(text, {"review"}, near=True)] == ["Reviev", "Review"]  # not "preview"


def test_a_spoken_match_points_at_its_first_matched_word() -> None:
    ts, spans = text_match("we leave at dawn", 10.0, 14.0, (10.0, 10.4, 11.0, 12.5), {"dawn"})
    assert ts == 12.5 and spans == ((12, 16),)
    # Without word times: the segment's start
    assert text_match("we leave at dawn", 10.0, 14.0, (), {"dawn"})[0] == 10.0


def moment(vid: str, start: float, end: float, score: float) -> Moment:
    return Moment(vid, f"s3://v/{vid}", start, end, start, score, f"{vid}-{int(start):07d}")


def match(vid: str, start: float, end: float, source: str = "subtitle") -> TextMatch:
    return TextMatch(vid, f"s3://v/{vid}", start, end, "words", source, start)


def test_fusion_joins_a_text_match_to_the_visual_moment_it_overlaps_and_ranks_it_first() -> None:
    visual = [moment("a", 0, 2, 0.9), moment("b", 10, 12, 0.8)]
    texts = [match("c", 5, 6), match("b", 12.5, 14)]
    fused = fuse(visual, texts, k=10)
    # b is found by both lists (visual rank 2, text rank 2): first; then c (text 1: words weigh more), then a
    assert [(f.video_id, f.sources) for f in fused] == [
        ("b", ("visual", "subtitle")),
        ("c", ("subtitle",)),
        ("a", ("visual",)),
    ]
    assert fused[0].score == pytest.approx(1 / (RRF_K + 2) + TEXT_WEIGHT / (RRF_K + 2))
    assert (fused[0].start_s, fused[0].end_s, fused[0].ts_s) == (12.5, 14, 12.5)  # the words' span
    assert fuse(visual, texts, k=1)[0].video_id == "b"


def test_two_sources_saying_the_same_at_one_time_are_one_moment() -> None:
    texts = [match("a", 5, 6, "subtitle"), match("a", 5.2, 6.5, "speech"), match("a", 30, 31)]
    fused = fuse([], texts, k=10)
    assert [(f.start_s, f.sources) for f in fused] == [(5, ("subtitle", "speech")), (30, ("subtitle",))]
    # With the frames matching there too: one moment found three ways
    fused = fuse([moment("a", 0, 10, 0.9)], texts, k=10)
    assert [(f.start_s, f.sources) for f in fused] == [(5, ("visual", "subtitle", "speech")), (30, ("subtitle",))]
    # Each list counts once per moment (its best rank): two weak word matches never outrank one strong one
    assert fused[0].score == pytest.approx(1 / (RRF_K + 1) + TEXT_WEIGHT / (RRF_K + 1))


def test_a_moment_starts_where_one_of_its_readings_showed_a_query_word_first() -> None:
    # The caption's second reading holds both words; its first (a second earlier) one of them
    late = TextMatch("a", "s3://v/a", 6.0, 7.0, "Falcon Prairie", "ocr", 6.0, ((0, 6), (7, 14)))
    early = TextMatch("a", "s3://v/a", 5.0, 6.0, "rairie Prairie", "ocr", 5.0, ((7, 14),))
    unmarked = TextMatch("a", "s3://v/a", 4.5, 5.0, "noise", "speech", 4.5)
    [f] = fuse([], [late, early, unmarked], k=5)
    assert (f.start_s, f.ts_s, f.text) == (5.0, 5.0, late)  # the words shown: the better reading's
    assert f.sources == ("ocr", "speech")


def hit(vid: str, start: float, text: str, source: str = "speech", alternative: int = 0, score: float = 1.0) -> TextHit:
    sid = f"{vid}-{start}-{alternative}-{source}"
    return TextHit(sid, vid, f"s3://v/{vid}", "v1", start, start + 2.0, text, source, (), score, alternative)


def test_the_words_rank_by_how_many_of_the_query_words_their_moment_holds_then_bm25() -> None:
    hits = [
        hit("short", 0.0, "willow", "ocr", score=9.0),  # BM25 likes short segments: one word
        hit("long", 0.0, "the willow by the old amber mill", "subtitle", score=4.0),  # both words
        hit("near", 0.0, "willow ambor", "ocr", score=3.0),  # one word, and one a letter away
    ]
    ranked = rank_words(hits, {"willow", "amber"}, near=True)
    assert [(r.hit.video_id, r.held) for r in ranked] == [
        ("long", 1.0),
        ("near", pytest.approx((1 + NEAR_WEIGHT) / 2)),
        ("short", 0.5),
    ]
    # Without fuzzy matching the one a letter away counts nothing: BM25 decides between equals
    assert [r.hit.video_id for r in rank_words(hits, {"willow", "amber"})] == ["long", "short", "near"]
    # A hit the full-text index matched where these words see none (its tokenizer folds accents) still counts
    [only] = rank_words([hit("cafe", 0.0, "le café", "subtitle")], {"cafe"})
    assert only.held == pytest.approx(ALTERNATIVE_WEIGHT * NEAR_WEIGHT)


def test_an_utterance_is_one_match_holding_what_any_of_its_readings_heard() -> None:
    best = hit("a", 1.0, "and he can help at all", score=2.0)
    first = hit("a", 1.0, "the beacon can help at all", alternative=1, score=3.0)
    second = hit("a", 1.0, "and he candle help at all", alternative=2, score=2.5)
    other = hit("b", 1.0, "a candle in the window", score=1.0)
    ranked = rank_words([first, second, best, other], {"beacon", "candle"})
    # One match for the utterance: both words heard, in alternative readings only (each counts half)
    assert [(r.hit.segment_id, r.held) for r in ranked] == [
        (first.segment_id, ALTERNATIVE_WEIGHT),
        (other.segment_id, 0.5),
    ]
    # Where the best reading heard a word, it counts whole and that reading is the one answered
    plain = hit("a", 1.0, "and the beacon help at all", score=1.0)
    [chosen, _] = rank_words([first, plain, other], {"beacon", "candle"})
    assert chosen.hit is plain and chosen.held == 0.5


def as_matches(ranked: list[Ranked[TextHit]], terms: Collection[str] = ()) -> list[TextMatch]:
    """The matches search.py makes of ``rank_words``' hits (``terms``: the words marked in them)."""
    return [
        TextMatch(
            h.video_id, h.uri, h.start_s, h.end_s, h.text, h.source, h.start_s, tuple(marks(h.text, terms)),
            r.held, r.moment, r.lead,
        )
        for r in ranked
        for h in (r.hit,)
    ]  # fmt: skip


def test_a_caption_shown_while_a_sentence_is_said_is_one_moment_holding_both() -> None:
    shown = hit("m", 9.0, "Quartz Lemon Glacier", "ocr", score=5.0)
    said = hit("m", 9.4, "the amber river", score=1.0)
    elsewhere = hit("x", 1.0, "amber quartz", "subtitle", score=2.0)
    later = hit("m", 14.0, "amber", "subtitle", score=8.0)  # the same video, a moment apart
    ranked = rank_words([later, shown, elsewhere, said], {"quartz", "amber"})
    assert [(r.hit.video_id, r.hit.start_s, r.held) for r in ranked] == [
        ("m", 9.0, 1.0),  # the moment's segments one after the other: fuse makes them one moment
        ("m", 9.4, 1.0),
        ("x", 1.0, 1.0),
        ("m", 14.0, 0.5),
    ]
    fused = fuse([], as_matches(ranked), k=5)
    assert [(f.video_id, f.start_s, f.sources) for f in fused] == [
        ("m", 9.0, ("ocr", "speech")),
        ("x", 1.0, ("subtitle",)),
        ("m", 14.0, ("subtitle",)),
    ]
    assert fused[-1].score == pytest.approx(TEXT_WEIGHT * 0.5 / (RRF_K + 4))  # half the words: half a rank


class QueryEncoder:
    #: What the last encoder made was asked to embed.
    last: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self.asked: list[str] = []
        QueryEncoder.last = self.asked

    async def embed_text(self, text: str, model_id: str | None = None) -> NDArray[np.float32]:
        self.asked.append(text)
        v = np.ones(6, dtype=np.float32)
        return v / np.linalg.norm(v)

    async def embed_image(self, rgb: NDArray[np.uint8], model_id: str | None = None) -> NDArray[np.float32]:
        raise AssertionError("not an image search")


class Live:
    def __init__(self, text: ModelTable | None) -> None:
        self._text = text

    def active(self) -> ModelTable:
        return ModelTable(MeanColour.model_id, 0, FRAMES)

    def text(self) -> ModelTable | None:
        return self._text


def search(
    p: Parts, q: str, sources: str | None = None, *, k: int = 10, text: bool = True, settings: Settings | None = None
) -> SearchResponse:
    encoder = QueryEncoder()
    service = SearchService(settings or p.settings, p.store, encoder, models=Live(TEXT if text else None))

    async def run() -> SearchResponse:
        try:
            return await service.search_text(q, k, "http://api", sources)
        finally:
            await service.aclose()

    return asyncio.run(run())


@pytest.fixture
def indexed(tmp_path: Path) -> Parts:
    p = Parts(tmp_path)
    p.clip("harbour.mp4", [Cue(1.0, 2.0, "the harbour at dawn"), Cue(3.0, 4.0, "A red boat leaves")], seconds=6)
    p.clip("field.mp4", [Cue(2.0, 3.0, "a field of red poppies")], seconds=6)
    for key in ("harbour.mp4", "field.mp4"):
        p.indexer.run(job(key))
        p.indexer.run(job(key, JobSource.TEXT))
    return p


def test_a_text_query_finds_the_moment_its_words_are_said_with_them_marked(indexed: Parts) -> None:
    response = search(indexed, "red boat")
    (top,) = [r for r in response.results if r.uri.endswith("/harbour.mp4") and r.text]
    assert "subtitle" in top.sources and "visual" in top.sources  # its frames matched too: one moment
    assert top.text == "A red boat leaves" and top.text_source == "subtitle"
    assert [top.text[a:b] for a, b in top.text_marks] == ["red", "boat"]
    assert (top.start_s, top.end_s, top.ts_s) == (3.0, 4.0, 3.0) and top.video_url.endswith("#t=3")
    assert "/v1/frames/" in top.thumbnail_url
    # The field's "red" matches too; by its words alone the harbour's two words rank first
    assert any(r.uri.endswith("/field.mp4") and "subtitle" in r.sources for r in response.results)
    words_only = search(indexed, "red boat", "subtitle").results
    assert [r.text for r in words_only] == ["A red boat leaves", "a field of red poppies"]
    assert words_only[0].score > words_only[1].score


def test_sources_filter_the_lists_fused(indexed: Parts) -> None:
    words_only = search(indexed, "red boat", "subtitle")
    assert words_only.results and all(r.sources == ["subtitle"] for r in words_only.results)
    pictures_only = search(indexed, "red boat", "visual")
    assert pictures_only.results and all(r.sources == ["visual"] and r.text is None for r in pictures_only.results)
    assert search(indexed, "red boat", "ocr").results == []
    with pytest.raises(InvalidInput):
        search(indexed, "red boat", "smell")


def test_a_quoted_phrase_matches_its_words_in_order_only(indexed: Parts) -> None:
    assert [r.text for r in search(indexed, '"red boat"', "subtitle").results] == ["A red boat leaves"]
    assert search(indexed, '"boat red"', "subtitle").results == []


def test_the_words_of_a_version_since_overwritten_are_not_answered(indexed: Parts, tmp_path: Path) -> None:
    # The harbour is overwritten and its frames indexed; its text job has not run yet
    indexed.clip("harbour.mp4", [Cue(1.0, 2.0, "a green lighthouse")], seconds=6)
    indexed.indexer.run(job("harbour.mp4"))
    assert all(r.text != "A red boat leaves" for r in search(indexed, "red boat").results)
    indexed.indexer.run(job("harbour.mp4", JobSource.TEXT))
    assert [r.text for r in search(indexed, "lighthouse", "subtitle").results] == ["a green lighthouse"]


def test_with_no_text_table_a_search_is_the_visual_one_of_the_query_as_typed(indexed: Parts) -> None:
    response = search(indexed, 'a  "red" boat', text=False)
    assert response.results and all(r.sources == ["visual"] and r.text is None for r in response.results)
    assert all(0 < r.score <= 1 for r in response.results)  # the best frame's similarity
    assert QueryEncoder.last == ['a  "red" boat']


def test_a_text_table_left_from_a_source_turned_off_is_not_searched(indexed: Parts) -> None:
    off = indexed.settings.model_copy(update={"text": TextSettings()})
    response = search(indexed, "red boat", settings=off)
    assert response.results and all(r.sources == ["visual"] and r.text is None for r in response.results)


def test_when_no_words_match_the_scores_are_the_frames_similarity(indexed: Parts) -> None:
    response = search(indexed, "zebra crossing")
    assert response.results and all(r.sources == ["visual"] and 0 < r.score <= 1 for r in response.results)
    assert QueryEncoder.last == ["zebra crossing"]


def test_successive_lines_of_one_source_are_moments_of_their_own_each_starting_at_its_words() -> None:
    # Two captions of a, the second shown half a second after the first went, then a cue of b
    first = hit("a", 1.0, "lantern amber river", "ocr")  # one query word; shown 1.0-3.0
    second = hit("a", 3.5, "amber quartz pepper", "ocr")  # both: the right answer (one word shared)
    terms = {"amber", "quartz"}
    ranked = rank_words([first, second, hit("b", 0.0, "quartz", "subtitle")], terms)
    assert [(r.hit.start_s, r.moment) for r in ranked][:2] == [(3.5, 0), (1.0, 1)]
    fused = fuse([], as_matches(ranked, terms), k=5)
    # Then the caption holding both words leads at its own time, not where the caption before it began
    assert (fused[0].video_id, fused[0].start_s, fused[0].ts_s) == ("a", 3.5, 3.5)
    assert [(f.video_id, f.start_s) for f in fused[1:]] == [("a", 1.0), ("b", 0.0)]


def test_a_moment_does_not_start_at_a_caption_of_other_words_right_before_the_one_holding_all_query_words() -> None:
    # OCR read every second: a caption shown 1-5 s, the next from 6 s, read as segments that touch
    first = hit("a", 1.0, "lantern amber river", "ocr")  # 1.0-3.0, one query word
    second = hit("a", 3.0, "amber quartz pepper", "ocr")  # 3.0-5.0, both
    terms = {"amber", "quartz"}
    ranked = rank_words([first, second], terms)
    assert [(r.hit.start_s, r.moment, r.lead) for r in ranked] == [(3.0, 0, True), (1.0, 0, False)]
    [fused] = fuse([], as_matches(ranked, terms), k=5)
    assert (fused.start_s, fused.ts_s) == (3.0, 3.0)


def test_a_moment_does_not_start_at_the_caption_before_when_the_best_read_is_part_of_its_line() -> None:
    # Caption "Saddle Coral Walnut" 1-5 s, then "Anchor Saddle Rocket" from 6 s, one frame of it read in
    # part: the part-read holds both query words (the best, with its two words) and shares one word with
    # the caption before (half the part-read's words, a third of that caption's)
    segments = [
        hit("a", 1.0, "Saddle Coral Walnut", "ocr", score=1.0),
        hit("a", 3.0, "Anchor Saddle", "ocr", score=3.0),
        hit("a", 5.0, "Anchor Saddle Rocket", "ocr", score=2.0),
    ]
    terms = {"anchor", "saddle"}
    ranked = rank_words(segments, terms)
    assert {r.moment for r in ranked} == {0}
    assert [(r.hit.start_s, r.lead) for r in ranked] == [(3.0, True), (5.0, True), (1.0, False)]
    [fused] = fuse([], as_matches(ranked, terms), k=5)
    assert (fused.start_s, fused.ts_s) == (3.0, 3.0)


def test_a_caption_read_whole_only_on_its_last_frames_starts_where_its_first_frame_read_part_of_it() -> None:
    # A caption shown from 11 s: its first frames read one of its words, the frame at 14 s all of them
    parts = [
        hit("a", 11.0, "Ribbon", "ocr"),
        hit("a", 13.0, "Ribbon Isl", "ocr"),
        hit("a", 14.0, "Ribbon Island Tunnel", "ocr"),
    ]
    terms = {"ribbon", "island"}
    ranked = rank_words(parts, terms)
    assert {r.moment for r in ranked} == {0} and all(r.lead for r in ranked)
    [fused] = fuse([], as_matches(ranked, terms), k=5)
    assert (fused.start_s, fused.ts_s) == (11.0, 11.0)


def test_a_caption_read_in_parts_on_frames_one_after_the_other_is_one_moment_holding_both_parts() -> None:
    parts = [hit("a", 1.0, "Ember", "ocr"), hit("a", 3.0, "Walnut Lantern", "ocr")]  # 1-3 s, then 3-5 s
    ranked = rank_words([hit("b", 0.0, "ember", "subtitle"), *parts], {"ember", "walnut"})
    assert ranked[0].hit.video_id == "a" and ranked[0].held == 1.0
    fused = fuse([], as_matches(ranked, {"ember", "walnut"}), k=5)
    assert [(f.video_id, f.start_s) for f in fused] == [("a", 1.0), ("b", 0.0)]


def test_a_moment_of_words_chained_in_time_is_one_fused_moment_holding_what_its_segments_hold() -> None:
    # Three segments of a, of two sources, each within a second of the one before, hold both words
    chain = [hit("a", 0.0, "amber", "ocr"), hit("a", 2.5, "amber", "speech"), hit("a", 5.0, "quartz", "ocr")]
    both = hit("b", 0.0, "amber quartz", "subtitle")
    ranked = rank_words([*chain, both], {"amber", "quartz"})
    fused = fuse([], as_matches(ranked), k=5)
    assert [(f.video_id, f.start_s) for f in fused] == [("a", 0.0), ("b", 0.0)]  # a: one moment, not three
    assert fused[0].score == pytest.approx(TEXT_WEIGHT / (RRF_K + 1))
