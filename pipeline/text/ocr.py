"""On-screen text by OCR (Tesseract's LSTM engine through tesserocr) on sampled frames.

A frame whose picture has not changed since the last one read is not read again: its text is the last
frame's. "Not changed": the frame cut into a 32×32 grid of cells, no cell's mean grey level moved by
more than ``same_level`` (a caption that appears, goes or changes moves the cells it covers by tens of
levels; compression noise averages out in a cell). Successive frames with the same words become one
segment. Words under ``min_confidence`` go (textures read as letters); a frame left with no word shows
no text."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from pipeline.media.sampler import SampledFrame
from pipeline.text.segments import NO_DEADLINE, TextSegment, TextSource, WordsDeadline, clean_text
from storage.errors import ModelUnavailable

#: Where Debian's (and most distributions') tesseract-ocr-eng puts its models, newest first.
TESSDATA_DIRS = (
    "/usr/share/tesseract-ocr/5/tessdata",
    "/usr/share/tesseract-ocr/4.00/tessdata",
    "/usr/share/tessdata",
    "/usr/local/share/tessdata",
)
#: Cells per side of the grid two frames are compared by.
_GRID = 32


class OcrUnavailable(ModelUnavailable):
    """tesserocr or the language's model is missing (the text settings say OCR is on)."""


def find_tessdata(configured: str | None = None, lang: str = "eng") -> str:
    """The tessdata folder holding ``<lang>.traineddata``: ``configured``, else ``TESSDATA_PREFIX``,
    else the usual system folders.

    Raises:
        OcrUnavailable: no folder holds the model.
    """
    candidates = [configured] if configured else [os.environ.get("TESSDATA_PREFIX", ""), *TESSDATA_DIRS]
    for folder in candidates:
        if folder and (Path(folder) / f"{lang}.traineddata").is_file():
            return folder
    where = configured or ", ".join(TESSDATA_DIRS)
    raise OcrUnavailable(f"no {lang}.traineddata in {where} (Debian: apt install tesseract-ocr-{lang})")


@dataclass
class OcrStats:
    frames: int = 0
    read: int = 0
    seconds: float = 0.0


class OcrReader:
    """Reads the text of frames; one Tesseract engine per reader, used by one thread at a time."""

    def __init__(
        self,
        tessdata: str | None = None,
        lang: str = "eng",
        min_confidence: float = 60.0,
        same_level: float = 6.0,
        min_side: int = 720,
    ) -> None:
        try:
            import tesserocr
        except ImportError as exc:  # pragma: no cover - a dependency of the package
            raise OcrUnavailable("tesserocr is not installed") from exc
        self._tesserocr = tesserocr
        self._api = tesserocr.PyTessBaseAPI(path=find_tessdata(tessdata, lang), lang=lang, psm=tesserocr.PSM.AUTO)
        self._lock = threading.Lock()
        self._min_confidence = min_confidence
        self._same_level = same_level
        self._min_side = min_side
        self.stats = OcrStats()

    def close(self) -> None:
        self._api.End()

    def read_frames(
        self, frames: Iterable[SampledFrame], every_s: float, deadline: WordsDeadline = NO_DEADLINE
    ) -> list[TextSegment]:
        """Segments of the text shown in ``frames`` (sampled every ``every_s`` seconds, in time order).

        Raises:
            LimitExceeded: the ``deadline`` passed (asked before each frame).
        """
        import time

        segments: list[TextSegment] = []
        open_seg: tuple[float, float, str, float] | None = None  # start, last seen, text, confidence
        last_thumb: NDArray[np.float32] | None = None
        last: tuple[str, float] = ("", 0.0)
        for frame in frames:
            deadline.check()
            self.stats.frames += 1
            thumb = _thumb(frame.rgb)
            if last_thumb is None or float(np.abs(thumb - last_thumb).max()) > self._same_level:
                started = time.perf_counter()
                last = self.read_image(frame.rgb)
                self.stats.seconds += time.perf_counter() - started
                self.stats.read += 1
                last_thumb = thumb
            text, confidence = last
            if open_seg is not None and open_seg[2] != text:
                segments.append(_segment(open_seg, every_s))
                open_seg = None
            if text:
                open_seg = (
                    open_seg[0] if open_seg else frame.ts_s,
                    frame.ts_s,
                    text,
                    max(confidence, open_seg[3] if open_seg else 0.0),
                )
        if open_seg is not None:
            segments.append(_segment(open_seg, every_s))
        return segments

    def read_image(self, rgb: NDArray[np.uint8]) -> tuple[str, float]:
        """The words Tesseract reads in ``rgb`` at ``min_confidence`` or more, and their mean confidence (0..1)."""
        from PIL import Image

        # Grey in: Tesseract thresholds a colour image less steadily over a busy picture (measured: a
        # boxed caption over a moving gradient read in 4 of 4 frames grey, 0 to 3 of 4 in colour).
        image = Image.fromarray(rgb).convert("L")
        short = min(image.size)
        if short < self._min_side:  # small text reads better larger (Tesseract wants ~20 px capitals)
            scale = self._min_side / short
            image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC)
        with self._lock:
            self._api.SetImage(image)  # a picture Tesseract can't take raises here: the frame shows nothing
            found = self._api.Recognize() and self._api.GetUTF8Text().strip()
            words = self._api.MapWordConfidences() if found else []
        kept = [(w, c) for w, c in words if c >= self._min_confidence and any(ch.isalnum() for ch in w)]
        if not kept:
            return "", 0.0
        return clean_text(" ".join(w for w, _ in kept)), sum(c for _, c in kept) / len(kept) / 100.0


def _thumb(rgb: NDArray[np.uint8]) -> NDArray[np.float32]:
    """The mean grey level of each cell of a ``_GRID``×``_GRID`` grid over the frame (edges that don't
    fill a cell are left out)."""
    grey = rgb.mean(axis=2, dtype=np.float32)
    h, w = grey.shape
    ch, cw = max(1, h // _GRID), max(1, w // _GRID)
    rows, cols = min(_GRID, h // ch), min(_GRID, w // cw)
    cells = grey[: rows * ch, : cols * cw].reshape(rows, ch, cols, cw)
    return cells.mean(axis=(1, 3))


def _segment(open_seg: tuple[float, float, str, float], every_s: float) -> TextSegment:
    start, last_seen, text, confidence = open_seg
    return TextSegment(start, last_seen + every_s, text, TextSource.OCR, round(confidence, 3))
