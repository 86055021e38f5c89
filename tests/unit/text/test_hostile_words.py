"""Hostile words: subtitles, on-screen text and speech are the uploader's. The subtitle clean-up is linear
in a cue, a segment and a video's words have caps, reading a video's words has a deadline, and a search
reads at most its first words and each segment up to the cap, off the event loop (issue 35, point 6).
Each test fails on the code before: there a 1 MB cue of unclosed tags took minutes to clean, nothing
was capped or bounded, and the matching ran on the loop."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from events.jobs import JobSource
from infra.dev.textclips import Cue, Overlay, overlaid_clip, subtitled_clip
from pipeline.query import words as query_words
from pipeline.query.search import SearchService
from pipeline.query.terms import MAX_QUERY_PHRASES, parse_query
from pipeline.settings import LimitSettings, Settings, TextSettings
from pipeline.text import segments as text_segments
from pipeline.text.extract import TextExtractor
from pipeline.text.ocr import OcrReader
from pipeline.text.segments import TextSegment, TextSource, capped, capped_words
from tests.unit.index.test_text_jobs import TEXT, Parts, job
from tests.unit.query.test_hybrid import Live, QueryEncoder

ROOT = Path(__file__).resolve().parents[3]

#: What the clean-up of one cue may take here, against minutes before (it grew with the square of the cue).
CLEAN_DEADLINE_S = 30.0


@pytest.mark.parametrize("unit", ["{", "<a", "{\\i1<b"])
def test_a_megabyte_cue_of_unclosed_tags_is_cleaned_within_a_deadline(unit: str) -> None:
    # In a process of its own, so that a clean-up that runs for minutes is killed at the deadline.
    # The patterns themselves on the whole megabyte (clean_text reads only MAX_RAW_CHARS of it), then clean_text.
    cue = f"{unit!r} * {1_000_000 // len(unit)}"
    program = (
        "from pipeline.text import segments as s\n"
        f"cue = {cue}\n"
        "assert len(s._MARKUP.sub('', s._ASS_TAGS.sub('', cue))) > 0\n"
        "print(len(s.clean_text(cue)))\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=CLEAN_DEADLINE_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"cleaning a cue of {cue} ran past {CLEAN_DEADLINE_S:g}s")
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) <= text_segments.MAX_RAW_CHARS  # and only the first MAX_RAW_CHARS were read


def test_markup_still_goes_with_the_linear_patterns() -> None:
    clean = text_segments.clean_text
    assert clean("{\\an8}{\\i1}Hello{\\i0} <font color='red'>world</font>") == "Hello world"
    assert clean("{{\\i1}}a") == "{}a"  # a tag inside braces goes, the stray braces stay
    assert clean("1 < 2 <b>bold</b> >") == "1 < 2 bold >"


def test_a_segment_is_cut_at_a_word_with_its_word_times() -> None:
    said = TextSegment(0.0, 4.0, "the lighthouse keeper lives alone", TextSource.SPEECH, word_starts=(0, 1, 2, 3, 4))
    cut = capped(said, 21)
    assert (cut.text, cut.word_starts) == ("the lighthouse keeper", (0, 1, 2))
    one = capped(TextSegment(0.0, 1.0, "x" * 50, TextSource.OCR), 10)
    assert one.text == "x" * 10
    assert capped(said, 200) is said


def test_a_videos_words_end_at_their_cap_through_the_extractor(tmp_path: Path) -> None:
    cues = [Cue(1.0, 2.0, "alpha " * 40), Cue(3.0, 4.0, "bravo charlie"), Cue(5.0, 6.0, "delta echo foxtrot")]
    clip = subtitled_clip(tmp_path / "clip", cues, seconds=7, fmt="srt")
    limits = LimitSettings(max_segment_chars=20, max_video_text_chars=40)
    settings = Settings(text=TextSettings(subtitles=True), limits=limits)
    out = TextExtractor(settings).extract(clip)
    # 17 + 13 characters fit the video's 40; the third cue (18) would pass it
    assert [s.text for s in out.segments] == ["alpha alpha alpha", "bravo charlie"]
    assert out.left_out == 1
    # cues that fit once cut are all kept: the reader counts each as it will be cut (17 + 17 + 3 + 1 <= 40)
    fitting = [Cue(1.0, 2.0, "alpha " * 40), Cue(2.5, 3.0, "alpha " * 40), Cue(3.5, 4.0, "abc"), Cue(5.0, 6.0, "d")]
    out = TextExtractor(settings).extract(subtitled_clip(tmp_path / "fits", fitting, seconds=7, fmt="srt"))
    assert ([s.text for s in out.segments][2:], out.left_out) == (["abc", "d"], 0)
    kept, left = capped_words(out.segments, 20, 10)
    assert (kept, left) == ([], 4)  # a first segment past the cap: nothing kept


def test_reading_the_words_stops_at_its_deadline_and_keeps_the_sources_that_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The subtitles read at time 0; the clock jumps past the deadline once OCR has read its first frame.
    now = [0.0]
    monkeypatch.setattr(text_segments, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    clip = subtitled_clip(tmp_path / "subs", [Cue(1.0, 2.0, "harbour at dawn")], seconds=6, fmt="srt")
    overlaid = overlaid_clip(tmp_path / "slide.mp4", [Overlay(0.0, 6.0, "Quarterly Results", size=40)], seconds=6)
    reader = OcrReader()
    read_image = reader.read_image

    def read_then_late(rgb: Any) -> tuple[str, float]:
        now[0] = 10_000.0
        return read_image(rgb)

    reader.read_image = read_then_late  # type: ignore[method-assign]
    text = TextSettings(subtitles=True, ocr=True, speech=True, read_deadline_s=60.0)
    try:
        # one file with both: the subtitles' clip is read for its subtitles, the slide for its text
        extractor = TextExtractor(Settings(text=text), ocr=reader)
        monkeypatch.setattr(extractor, "_subtitles", _subtitles_of(clip, extractor._subtitles))
        out = extractor.extract(overlaid)
    finally:
        reader.close()
    assert [s.text for s in out.segments] == ["harbour at dawn"]
    assert "text.read_deadline_s" in out.errors["ocr"] and "text.read_deadline_s" in out.errors["speech"]
    assert reader.stats.read == 1  # no frame read past the deadline


def _subtitles_of(clip: Path, read: Any) -> Any:
    return lambda _path, deadline: read(clip, deadline)


def test_a_query_searches_its_first_words_only() -> None:
    q = parse_query('one two "three four five" two six seven')
    # the phrases' words first, then the free words in order, repeats free
    assert (q.bounded(5).phrases, q.bounded(5).words) == (("three four five",), ("one", "two", "two"))
    assert (q.bounded(2).phrases, q.bounded(2).words) == (("three four",), ())  # a phrase cut to what fits
    assert q.bounded(5).visual == q.visual and q.bounded(7) is q  # its 7 distinct words
    # each phrase is a search of its own: at most MAX_QUERY_PHRASES of them
    many = parse_query(" ".join(f'"w{n}"' for n in range(87)))
    assert len(many.bounded(32).phrases) == MAX_QUERY_PHRASES
    assert len(parse_query('"' + " ".join(f"w{n}" for n in range(124)) + '"').bounded(32).terms) == 32


def test_a_long_segment_is_matched_off_the_event_loop_and_only_up_to_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Words written with the caps raised, as a release before them wrote them: one 64 KB segment
    long_cue = "the red boat " + "sails on " * 100_000
    p = Parts(tmp_path, limits=LimitSettings(max_segment_chars=1_000_000))
    p.clip("long.mkv", [Cue(1.0, 2.0, long_cue)], seconds=4, fmt="srt")  # Matroska: MP4's cues stop at 64 KB
    p.indexer.run(job("long.mkv"))
    p.indexer.run(job("long.mkv", JobSource.TEXT))
    assert max(len(t) for t in p.text_rows("long.mkv")) > 60_000
    seen: list[tuple[int, bool]] = []
    text_match = query_words.text_match

    def watched(hit_text: str, *args: Any, **kwargs: Any) -> Any:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        seen.append((len(hit_text), on_loop))
        return text_match(hit_text, *args, **kwargs)

    monkeypatch.setattr(query_words, "text_match", watched)
    searched: list[Any] = []
    search_words = query_words.search_words

    def searching(table: Any, query: Any, *args: Any) -> Any:
        searched.append(query)
        return search_words(table, query, *args)

    monkeypatch.setattr("pipeline.query.search.search_words", searching)
    settings = Settings(text=TextSettings(subtitles=True), limits=LimitSettings(max_query_words=2))
    service = SearchService(settings, p.store, QueryEncoder(), models=Live(TEXT))

    async def run() -> Any:
        try:
            return await service.search_text("red boat harbour dawn", 5, "http://api", "subtitle")
        finally:
            await service.aclose()

    response = asyncio.run(run())
    [answer] = response.results
    assert answer.text is not None and len(answer.text) <= settings.limits.max_segment_chars
    assert [answer.text[a:b] for a, b in answer.text_marks][:2] == ["red", "boat"]
    assert seen and all(size <= settings.limits.max_segment_chars and not on_loop for size, on_loop in seen), seen
    assert [q.words for q in searched] == [("red", "boat")]
