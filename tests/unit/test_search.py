"""pipeline/search.py: query images are bounded before their pixels are decoded."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from pipeline.search import decode_query_image
from storage.errors import InvalidInput, LimitExceeded


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(out, format="PNG")
    return out.getvalue()


def test_a_small_image_decodes_to_rgb() -> None:
    rgb = decode_query_image(png(32, 16), max_bytes=1 << 20, max_pixels=10_000)
    assert rgb.shape == (16, 32, 3) and rgb.dtype == np.uint8 and tuple(rgb[0, 0]) == (10, 200, 30)


def test_too_many_bytes_is_a_limit() -> None:
    with pytest.raises(LimitExceeded, match="max bytes"):
        decode_query_image(png(32, 32), max_bytes=10, max_pixels=10_000)


def test_too_many_pixels_is_a_limit_even_when_the_file_is_small() -> None:
    data = png(4000, 3000)  # a flat picture compresses to a few kB
    assert len(data) < 100_000
    with pytest.raises(LimitExceeded, match="max pixels"):
        decode_query_image(data, max_bytes=1 << 20, max_pixels=1_000_000)


@pytest.mark.parametrize("data", [b"", b"not an image", png(8, 8)[:40]])
def test_garbage_is_invalid_input(data: bytes) -> None:
    with pytest.raises(InvalidInput):
        decode_query_image(data, max_bytes=1 << 20, max_pixels=10_000)
