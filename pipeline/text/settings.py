"""The text settings (``VIDX_TEXT__*``): which sources read a video's words, and how."""

from __future__ import annotations

from pydantic import BaseModel, Field


class TextSettings(BaseModel):
    """The words in a video (``pipeline.text``): which sources are read, and how. Every source is off by
    default until ``bench.relevance`` meets the relevance bars through the search endpoint
    (docs/design/text.md); ``bench.text_cost`` gives each source's cost."""

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
        every video's words are read again (a new text table)."""
        parts = []
        if self.subtitles:
            parts.append("subtitles")
        if self.ocr:
            parts.append(
                f"ocr:tesseract/{self.ocr_language}/{self.ocr_every_s:g}s/c{self.ocr_min_confidence:g}/s{self.ocr_min_side}"
            )
        if self.speech:
            parts.append("speech:pocketsphinx/en-us")
        return "+".join(parts) or "none"
