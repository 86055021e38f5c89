"""What is done with sampled frames on their way to the index: chunks for the encoder, thumbnails."""

from __future__ import annotations

import io
from collections.abc import Iterator
from itertools import islice

import numpy as np
from numpy.typing import NDArray
from PIL import Image

from pipeline.media.decode import SampledFrame


def chunks(frames: Iterator[SampledFrame], size: int) -> Iterator[list[SampledFrame]]:
    """``frames`` in lists of ``size`` (the last may be shorter)."""
    while chunk := list(islice(frames, size)):
        yield chunk


def thumbnail_jpeg(rgb: NDArray[np.uint8], max_side: int) -> bytes:
    """A JPEG of the frame, its longer side at most ``max_side``. The frame is first shrunk by the largest
    whole factor (``reduce``: a box average, ~0.1 ms for a 384 px frame), and only what is left of the
    ratio goes through a bicubic filter: a bicubic pass over the whole frame took ~1 ms, 14 % of an index
    consumer's CPU in ``bench.cpu``'s profile (docs/benchmarks.md)."""
    image = Image.fromarray(rgb)
    image.thumbnail((max_side, max_side), reducing_gap=1.0)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=75)
    return out.getvalue()
