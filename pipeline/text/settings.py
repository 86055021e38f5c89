"""The text settings (``VIDX_TEXT__*``): which sources read a video's words, and how."""

from __future__ import annotations

from pydantic import BaseModel, Field


class TextSettings(BaseModel):
    """The words in a video (``pipeline.text``): which sources are read, and how. Every source is off by
    default, by its cost (docs/design/text.md, "Defaults"): a video a turned-on source may read (``pipeline_may_read``)
    costs a text job (a fetch and two catalog commits, whatever it finds), and OCR and speech cost
    CPU-seconds per video-minute (``bench.stages.text_cost``); ``bench.relevance`` gives what each finds."""

    #: Text subtitle tracks (SubRip, ASS/SSA, mov_text, WebVTT): no model, next to no cost.
    subtitles: bool = False
    #: On-screen text by OCR (Tesseract) on frames sampled every ``ocr_every_s`` seconds.
    ocr: bool = False
    ocr_every_s: float = Field(default=1.0, gt=0)
    #: The folder holding ``<ocr_language>.traineddata`` (None: ``TESSDATA_PREFIX``, then Debian's).
    ocr_tessdata: str | None = None
    ocr_language: str = "eng"
    #: Words Tesseract is less sure of than this (0..100) are dropped: textures read as letters.
    ocr_min_confidence: float = Field(default=60.0, ge=0, le=100)
    #: Frames are read at this short side at least (small captions read better larger).
    ocr_min_side: int = Field(default=720, ge=64)
    #: Frames are read at this longest side at most.
    ocr_max_side: int = Field(default=1920, ge=64)
    #: Speech by PocketSphinx (US English) on the first audio track.
    speech: bool = False
    #: Of each utterance, this many of the recogniser's most likely readings are looked at, and each that
    #: heard a word the ones before it did not is kept as an alternative reading (searched, ranked below
    #: the best one): a rare word misheard in the best reading is often right in another. 0: best only.
    speech_alternatives: int = Field(default=50, ge=0, le=100)
    #: Reading one video's words (every source on, one after another) ends this many seconds after it
    #: began: a source still reading then stops (between two frames, packets or utterances) and it and the
    #: sources after it read nothing of this video, the reason logged; the words read are kept. The job's
    #: crash count (``serve.max_crashes``) bounds a reading that takes its consumer down instead.
    read_deadline_s: float = Field(default=1800.0, gt=0)
    #: A search's words also match words one letter away (same first letter), below exact ones: OCR and
    #: speech misread a letter or a sound now and then. Words in quotes always match exactly.
    search_fuzzy: bool = True

    @property
    def on(self) -> bool:
        """Whether any source is on: only then does anything read, search, check or keep a text table
        (one named by the index while every source is off, after one was on, is left as it is)."""
        return self.subtitles or self.ocr or self.speech

    def pipeline_id(self) -> str:
        """What decides a video's text segments ("none" with every source off): a change of it means
        every video's words are read again (a new text table). It starts with the text rows' layout
        (``storage.texts.TEXT_ROWS``): a table of another layout is never written to."""
        from storage.texts import TEXT_ROWS  # here: the settings load without LanceDB

        parts = [TEXT_ROWS]
        if self.subtitles:
            parts.append("subtitles")
        if self.ocr:
            parts.append(
                f"ocr:tesseract/{self.ocr_language}/{self.ocr_every_s:g}s/c{self.ocr_min_confidence:g}/s{self.ocr_min_side}"
            )
        if self.speech:
            parts.append(f"speech:pocketsphinx/en-us/n{self.speech_alternatives}")
        return "+".join(parts) if len(parts) > 1 else "none"


#: The sources a pipeline id names (``TextSettings.pipeline_id``: "<layout>+<source>[:<how>]+...").
_SOURCES = ("subtitles", "ocr", "speech")


def pipeline_may_read(pipeline: str, audio_tracks: int | None, subtitle_tracks: int | None) -> bool:
    """Whether the text pipeline ``pipeline`` may find words in a video with these tracks: OCR reads any
    picture; speech needs an audio track, subtitles a subtitle track. A video none of its sources may read
    has its words settled as none found by its index job, with no text job (docs/design/text.md). A
    pipeline this release does not name this way (another rows layout, a test's own), or tracks not counted
    (None), may read any video."""
    from storage.texts import TEXT_ROWS  # here: the settings load without LanceDB

    layout, *parts = pipeline.split("+")
    sources = {part.split(":", 1)[0] for part in parts}
    if layout != TEXT_ROWS or not sources or not sources <= set(_SOURCES):
        return True
    return (
        "ocr" in sources
        or ("speech" in sources and (audio_tracks is None or audio_tracks > 0))
        or ("subtitles" in sources and (subtitle_tracks is None or subtitle_tracks > 0))
    )
