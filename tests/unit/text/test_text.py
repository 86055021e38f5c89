"""The words in a video (``pipeline.text``): subtitle tracks of every text format, on-screen text by
OCR and speech by PocketSphinx, each at its time, read from clips whose words are known
(``infra.dev.textclips``: ffmpeg's drawtext, muxed subtitle files, Flite's voices)."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.dev.samples import write_video
from infra.dev.textclips import Cue, Line, Overlay, overlaid_clip, spoken_clip, subtitled_clip
from pipeline.settings import Settings, TextSettings
from pipeline.text.extract import TextExtractor, text_pipeline_id
from pipeline.text.ocr import OcrReader, OcrUnavailable, find_tessdata
from pipeline.text.segments import TextSegment, TextSource, clean_text
from pipeline.text.speech import SpeechRecognizer, alternative_readings
from pipeline.text.subtitles import read_subtitles
from storage.texts import TEXT_ROWS

CUES = [Cue(1.0, 3.0, "Hello from the <i>harbour</i>"), Cue(5.5, 7.0, "A red boat leaves at dawn")]


@pytest.mark.parametrize("fmt", ["srt", "ass", "vtt", "mov_text"])
def test_every_text_subtitle_format_is_read_with_its_times(tmp_path: Path, fmt: str) -> None:
    clip = subtitled_clip(tmp_path / "clip", CUES, seconds=8, fmt=fmt)
    segments = read_subtitles(clip)
    assert [(s.start_s, s.end_s, s.text) for s in segments] == [
        (1.0, 3.0, "Hello from the harbour"),
        (5.5, 7.0, "A red boat leaves at dawn"),
    ]
    assert {s.source for s in segments} == {TextSource.SUBTITLE} and all(s.confidence == 1.0 for s in segments)


def test_a_video_without_subtitle_tracks_has_no_subtitles(tmp_path: Path) -> None:
    assert read_subtitles(write_video(tmp_path / "plain.mp4", seconds=2, size=(64, 48))) == []


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("{\\i1}Hello{\\i0}\\Nworld", "Hello world"),
        ("<i>Hello</i>   <c.yellow>world</c>", "Hello world"),
        ("a\\hb\n c", "a b c"),
        ("5 < 6 and 7 > 2", "5 < 6 and 7 > 2"),
    ],
)
def test_subtitle_markup_is_cleaned_to_words(raw: str, clean: str) -> None:
    assert clean_text(raw) == clean


def test_ocr_reads_drawn_text_in_the_seconds_it_is_shown(tmp_path: Path) -> None:
    clip = overlaid_clip(
        tmp_path / "slide.mp4", [Overlay(2.0, 5.0, "Architecture Review", size=44, box="black@0.7")], seconds=8
    )
    reader = OcrReader()
    try:
        segments = TextExtractor(_only(ocr=True), ocr=reader).extract(clip).segments
    finally:
        reader.close()
    found = [s for s in segments if "architecture review" in s.text.lower()]
    assert found, segments
    assert 2.0 <= found[0].start_s <= 3.0 and 5.0 <= found[-1].end_s <= 6.0, found
    assert all(s.source is TextSource.OCR and 0.6 <= s.confidence <= 1.0 for s in found)
    assert not [s for s in segments if s.end_s <= 2.0 or s.start_s >= 6.0], segments  # nothing read where nothing is


def test_ocr_does_not_read_a_frame_again_when_the_picture_did_not_change(tmp_path: Path) -> None:
    clip = overlaid_clip(tmp_path / "still.mp4", [Overlay(0.0, 10.0, "Quarterly Results", size=44)], 10, still=True)
    reader = OcrReader()
    try:
        segments = TextExtractor(_only(ocr=True), ocr=reader).extract(clip).segments
    finally:
        reader.close()
    assert [(s.start_s, s.end_s, s.text) for s in segments] == [(0.0, 10.0, "Quarterly Results")]
    assert (reader.stats.frames, reader.stats.read) == (10, 1)


def test_speech_is_transcribed_with_the_time_of_each_word(tmp_path: Path) -> None:
    clip = spoken_clip(tmp_path / "talk.mp4", [Line(2.0, "the lighthouse keeper lives alone")], seconds=6)
    [segment] = SpeechRecognizer().read_file(clip)
    words = segment.text.split()
    assert segment.source is TextSource.SPEECH and "lighthouse" in words and "keeper" in words
    assert 2.0 <= segment.start_s <= 2.6 and segment.end_s <= 5.0
    said = segment.time_of(words.index("lighthouse"))
    assert segment.start_s < said < segment.time_of(words.index("keeper")) < segment.end_s


def test_an_alternative_reading_is_kept_only_for_words_no_reading_before_heard_each_timed() -> None:
    best = TextSegment(1.0, 3.0, "and he can help", TextSource.SPEECH, 0.4, (1.0, 1.4, 1.8, 2.4))
    readings = [
        ["and", "he", "can", "help"],  # the best again
        ["and", "he", "can", "<sil>", "help"],  # fillers are not words
        ["the", "beacon", "can", "help"],  # 'the beacon' in place of 'and he'
        ["and", "he", "can", "help", "all"],  # 'all' added at the end
        ["the", "he", "can", "help"],  # nothing new
        ["and", "he", "candle", "help"],
    ]
    alts = alternative_readings(best, readings)
    assert [(a.text, a.alternative, a.word_starts) for a in alts] == [
        ("the beacon can help", 1, (1.0, 1.4, 1.8, 2.4)),
        ("and he can help all", 2, (1.0, 1.4, 1.8, 2.4, 3.0)),
        ("and he candle help", 3, (1.0, 1.4, 1.8, 2.4)),
    ]
    assert all((a.start_s, a.end_s, a.source, a.confidence) == (1.0, 3.0, TextSource.SPEECH, 0.4) for a in alts)
    # One word in place of two: spread over their time
    [merged] = alternative_readings(best, [["and", "hecan", "help"]])
    assert merged.word_starts == (1.0, 1.4, 2.4)
    # A bare pronunciation marker is no word; a word the best reading dropped (said before the picture) is not new
    assert (
        alternative_readings(best, [["(2)", "and", "he", "can", "help"], ["so", "and", "he", "can", "help"]], {"so"})
        == []
    )


def test_speech_gives_alternative_readings_after_the_best_one_when_asked(tmp_path: Path) -> None:
    clip = spoken_clip(tmp_path / "talk.mp4", [Line(1.0, "the saffron glacier and the copper falcon")], seconds=6)
    only = SpeechRecognizer().read_file(clip)
    segments = SpeechRecognizer(alternatives=10).read_file(clip)
    assert [s.alternative for s in only] == [0]
    assert segments[0] == only[0] and len(segments) > 1
    heard = set(only[0].text.split())
    for n, alt in enumerate(segments[1:], start=1):
        words = alt.text.split()
        assert alt.alternative == n and (alt.start_s, alt.end_s) == (only[0].start_s, only[0].end_s)
        assert not heard.issuperset(words), "each alternative hears a word no reading before it did"
        heard.update(words)
        assert len(alt.word_starts) == len(words)
        assert all(alt.start_s <= t <= alt.end_s for t in alt.word_starts)
        assert list(alt.word_starts) == sorted(alt.word_starts)


def test_a_clip_without_audio_has_no_speech(tmp_path: Path) -> None:
    assert SpeechRecognizer().read_file(write_video(tmp_path / "mute.mp4", seconds=2, size=(64, 48))) == []


def test_a_damaged_file_gives_each_source_a_reason_and_no_segments(tmp_path: Path) -> None:
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x17" * 4000)
    out = TextExtractor(_only(subtitles=True, ocr=True, speech=True)).extract(broken)
    assert out.segments == []
    assert set(out.errors) == {"subtitle", "ocr", "speech"}
    assert all("unreadable container" in reason for reason in out.errors.values()), out.errors


def test_sources_that_are_off_are_not_read(tmp_path: Path) -> None:
    clip = subtitled_clip(tmp_path / "clip", CUES, seconds=8, fmt="srt")
    out = TextExtractor(_only(subtitles=True)).extract(clip)
    assert set(out.seconds) == {"subtitle"} and len(out.segments) == 2


def test_the_text_pipeline_id_changes_with_what_decides_the_segments() -> None:
    base = TextSettings(subtitles=True, ocr=True, speech=True)
    ids = {
        text_pipeline_id(base),
        text_pipeline_id(base.model_copy(update={"ocr": False})),
        text_pipeline_id(base.model_copy(update={"speech": False})),
        text_pipeline_id(base.model_copy(update={"ocr_every_s": 2.0})),
        text_pipeline_id(base.model_copy(update={"ocr_min_confidence": 70.0})),
        text_pipeline_id(base.model_copy(update={"speech_alternatives": 0})),
    }
    assert len(ids) == 6
    assert all(pid.startswith(f"{TEXT_ROWS}+") for pid in ids)  # a new row layout: new tables
    assert text_pipeline_id(TextSettings()) == "none"  # every source off: the default, by cost


def test_a_missing_ocr_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(OcrUnavailable, match=r"no klingon\.traineddata"):
        find_tessdata(str(tmp_path), "klingon")


@pytest.mark.parametrize(
    "bad",
    [
        {"start_s": 2.0, "end_s": 1.0, "text": "x"},
        {"start_s": 0.0, "end_s": 1.0, "text": "two words", "word_starts": (0.0,)},
    ],
)
def test_a_segment_that_makes_no_sense_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        TextSegment(source=TextSource.SPEECH, **bad)  # type: ignore[arg-type]


def _only(**on: bool) -> Settings:
    sources = {"subtitles": False, "ocr": False, "speech": False, **on}
    return Settings(text=TextSettings(**sources))


def test_two_readings_of_one_clip_give_the_same_rows(tmp_path: Path) -> None:
    clip = subtitled_clip(tmp_path / "clip", CUES, seconds=8, fmt="srt")
    first, second = (TextExtractor(_only(subtitles=True)).extract(clip).rows("vid") for _ in range(2))
    assert first == second and [r.segment_id for r in first] == ["vid-t000000", "vid-t000001"]
    assert first[0].source == "subtitle" and first[0].text == "Hello from the harbour"


def test_ocr_reads_a_small_caption_that_comes_on_a_still_picture(tmp_path: Path) -> None:
    """A lower third replacing a title on a held shot changes few pixels: it must still be read."""
    overlays = [
        Overlay(0.0, 4.9, "Quarterly Results", size=44),
        Overlay(5.0, 10.0, "Speaker Jane Doe", size=22, y="h*0.85"),
    ]
    clip = overlaid_clip(tmp_path / "lower-third.mp4", overlays, 10, size=(1280, 720), still=True)
    reader = OcrReader()
    try:
        segments = TextExtractor(_only(ocr=True), ocr=reader).extract(clip).segments
    finally:
        reader.close()
    assert [(s.start_s, s.end_s, s.text) for s in segments] == [
        (0.0, 5.0, "Quarterly Results"),
        (5.0, 10.0, "Speaker Jane Doe"),
    ]
    assert reader.stats.read == 2


def _picture_digest(path: Path) -> str:
    import hashlib

    import av

    digest = hashlib.sha256()
    with av.open(str(path)) as container:
        for frame in container.decode(video=0):
            digest.update(frame.to_ndarray(format="rgb24").tobytes())
    return digest.hexdigest()


def test_a_clip_with_captions_over_a_moving_picture_is_the_same_every_time_it_is_made(tmp_path: Path) -> None:
    # The relevance corpus is made anew each run: a picture that differed each time (ffmpeg's gradients
    # source did, seed or not) gave OCR other frames to read, and each run other figures.
    overlays = [Overlay(0.5, 2.0, "Amber Lantern", font="serif", size=32, colour="yellow", y="h*0.8")]
    first = overlaid_clip(tmp_path / "a.mp4", overlays, 3)
    second = overlaid_clip(tmp_path / "b.mp4", overlays, 3)
    assert _picture_digest(first) == _picture_digest(second)


def test_a_caption_wider_than_the_frame_is_drawn_smaller_so_that_all_of_it_is_read(tmp_path: Path) -> None:
    # Three long words at 48 px bold are ~730 px: at 640 px wide they were cut at both edges
    # ("Walnut Meadow Compass" read "alnut Meadow Compas")
    text = "Compass Sparrow Thunder"
    clip = overlaid_clip(
        tmp_path / "wide.mp4", [Overlay(0.0, 3.0, text, font="sans-bold", size=48, box="navy@0.8")], 3, still=True
    )
    with TextExtractor(Settings(text=TextSettings(ocr=True))) as extractor:
        read = " ".join(s.text for s in extractor.extract(clip).segments)
    assert set(text.lower().split()) <= set(read.lower().split())
