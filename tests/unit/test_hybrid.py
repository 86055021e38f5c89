"""Hybrid search: the query's words and quoted phrases, the marks in a matched segment, reciprocal rank
fusion of the visual moments with the text matches (``pipeline.query.hybrid``), and ``SearchService``
over videos indexed by the real ``Indexer`` and text jobs into a local LanceDB (subtitles)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from numpy.typing import NDArray

from events.jobs import JobSource
from infra.dev.textclips import Cue
from pipeline.query.hybrid import RRF_K, TEXT_WEIGHT, TextMatch, fuse, marks, parse_query, parse_sources, text_match
from pipeline.query.moments import Moment
from pipeline.query.search import SearchResponse, SearchService
from pipeline.settings import Settings, TextSettings
from storage.errors import InvalidInput
from storage.frames import FRAMES
from storage.models import ModelTable
from tests.unit.test_indexer import MeanColour
from tests.unit.test_text_jobs import TEXT, Parts, job


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
