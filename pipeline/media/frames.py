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
    """A JPEG of the frame, its longer side at most ``max_side``."""
    image = Image.fromarray(rgb)
    image.thumbnail((max_side, max_side))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=75)
    return out.getvalue()
