"""pipeline/query/search.py: query images are bounded before their pixels are decoded and searched upright;
moments end within their video."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from PIL import Image

from pipeline.query.images import decode_query_image
from pipeline.query.search import SearchResponse, SearchService
from pipeline.settings import Settings
from storage.catalog import VideoRecord, VideoStatus
from storage.errors import InvalidInput, LimitExceeded
from storage.frames import FrameRow, VideoFrames
from storage.tables import IndexStore
from tests.media import ORIENTATIONS, mae, oriented_image


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


# Query images are searched upright (EXIF orientation).

#: A JPEG of flat 16-pixel blocks decodes within this mean absolute error (chroma subsampling at edges).
JPEG_MAE = 8.0


def picture(width: int = 96, height: int = 48, seed: int = 3) -> NDArray[np.uint8]:
    """Flat 16-pixel blocks of random colours: not symmetric under any turn, and JPEG keeps them."""
    blocks = np.random.default_rng(seed).integers(0, 256, size=(height // 16, width // 16, 3), dtype=np.uint8)
    return np.ascontiguousarray(blocks.repeat(16, axis=0).repeat(16, axis=1))


@pytest.mark.parametrize("image_format", ["PNG", "WEBP"])
@pytest.mark.parametrize("orientation", sorted(ORIENTATIONS))
def test_a_query_image_is_turned_upright_by_its_exif_orientation(orientation: int, image_format: str) -> None:
    upright = picture()

    rgb = decode_query_image(oriented_image(upright, orientation, image_format), 1 << 20, 1 << 20)

    np.testing.assert_array_equal(rgb, upright)


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_a_rotated_phone_jpeg_is_decoded_upright(orientation: int) -> None:
    upright = picture()

    rgb = decode_query_image(oriented_image(upright, orientation, "JPEG"), 1 << 20, 1 << 20)

    assert rgb.shape == upright.shape
    assert mae(rgb, upright) < JPEG_MAE
    assert mae(rgb, np.rot90(upright, 2)) > 10 * JPEG_MAE


class BlockEncoder:
    """A stand-in query encoder that sees orientation: the image's 4x4 block means, normalised."""

    def __init__(self) -> None:
        self.images: list[NDArray[np.uint8]] = []

    @staticmethod
    def vector(rgb: NDArray[np.uint8]) -> NDArray[np.float32]:
        small = np.asarray(Image.fromarray(rgb).resize((4, 4), Image.Resampling.BOX), dtype=np.float32).ravel() + 1.0
        return (small / np.linalg.norm(small)).astype(np.float32)

    async def embed_text(self, text: str, model_id: str | None = None) -> NDArray[np.float32]:
        raise AssertionError("not a text search")

    async def embed_image(self, rgb: NDArray[np.uint8], model_id: str | None = None) -> NDArray[np.float32]:
        self.images.append(rgb)
        return self.vector(rgb)


@pytest.fixture
def store(tmp_path: Path) -> IndexStore:
    return IndexStore(Settings().s3, uri=str(tmp_path / "lance"))


def add_video(store: IndexStore, video_id: str, frames: list[tuple[float, NDArray[np.float32]]], **fields: Any) -> None:
    uri = f"s3://videos/{video_id}.mp4"
    rows = [FrameRow(f"{video_id}-{i:07d}", ts_s, vector, None) for i, (ts_s, vector) in enumerate(frames)]
    store.frames.replace(VideoFrames(video_id, uri, "e1", "fp", "test/blocks", rows))
    store.catalog.write(VideoRecord(video_id=video_id, uri=uri, status=VideoStatus.INDEXED, **fields), 0)


def search(store: IndexStore, encoder: BlockEncoder, image: bytes, k: int = 5) -> SearchResponse:
    async def run() -> SearchResponse:
        service = SearchService(Settings(), store, encoder)
        try:
            return await service.search_image(image, k, "http://api")
        finally:
            await service.aclose()

    return asyncio.run(run())


@pytest.mark.parametrize("orientation", [6, 8])
def test_an_exif_rotated_query_is_searched_upright(store: IndexStore, orientation: int) -> None:
    # Given a video showing the picture upright, and one showing it as the phone stored it (sideways)
    upright = picture()
    stored = np.ascontiguousarray(ORIENTATIONS[orientation](upright))
    add_video(store, "upright", [(3.0, BlockEncoder.vector(upright))], duration_s=10.0)
    add_video(store, "sideways", [(3.0, BlockEncoder.vector(stored))], duration_s=10.0)
    encoder = BlockEncoder()
    # When the phone's photo (stored sideways, EXIF says how to turn it) is the query
    response = search(store, encoder, oriented_image(upright, orientation, "JPEG"))
    # Then it is embedded as the upright picture, and finds the upright video first
    (query,) = encoder.images
    assert query.shape == upright.shape and mae(query, upright) < JPEG_MAE
    assert [r.video_id for r in response.results] == ["upright", "sideways"]
    assert response.results[0].score == pytest.approx(1.0, abs=1e-3)


def test_a_moment_at_the_end_of_a_video_ends_with_it(store: IndexStore) -> None:
    # Frames every second; the video is 4.5 s long, so the moment of its last frame ends at 4.5 s
    target = picture(seed=4)
    vector = BlockEncoder.vector(target)
    add_video(store, "short", [(3.0, vector), (4.0, vector)], duration_s=4.5)
    add_video(store, "unknown", [(7.0, vector)])  # no duration recorded: a whole sampling interval
    query = io.BytesIO()
    Image.fromarray(target).save(query, format="PNG")

    response = search(store, BlockEncoder(), query.getvalue())

    moments = {r.video_id: r for r in response.results}
    assert (moments["short"].start_s, moments["short"].end_s) == (3.0, 4.5)
    assert moments["short"].video_url.endswith("#t=3")
    assert (moments["unknown"].start_s, moments["unknown"].end_s) == (7.0, 8.0)
