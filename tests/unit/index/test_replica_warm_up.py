"""pipeline/index/replica.py ``warm_up``: a fused replica runs its model once while it starts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from numpy.typing import NDArray

from pipeline.index.replica import WARM_UP_SIDE, warm_up


class Recording:
    model_id = "test/recording"

    def __init__(self, error: Exception | None = None) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.error = error

    def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]:
        self.shapes += [image.shape for image in images]
        if self.error is not None:
            raise self.error
        return np.zeros((len(images), 4), dtype=np.float32)


def test_warm_up_embeds_one_blank_image() -> None:
    embedder = Recording()
    warm_up(embedder)
    assert embedder.shapes == [(WARM_UP_SIDE, WARM_UP_SIDE, 3)]


def test_a_model_that_wont_load_is_left_to_the_jobs(caplog: pytest.LogCaptureFixture) -> None:
    warm_up(Recording(RuntimeError("weights missing")))
    assert "could not warm up model test/recording: weights missing" in caplog.text
