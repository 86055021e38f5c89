"""The consumer's view of the Encoder: one deadline per chunk, not per frame."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from pipeline.deployments import HandleEmbedder
from storage.errors import EncoderUnavailable


class SlowResponse:
    """A response that answers after ``delay_s`` (or times out, as Ray's ``result`` does)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.cancelled = False
        self.waits: list[float] = []

    def result(self, timeout_s: float) -> Any:
        self.waits.append(timeout_s)
        if self.delay_s > timeout_s:
            time.sleep(timeout_s)
            raise TimeoutError("timed out")
        time.sleep(self.delay_s)
        return np.ones(4, np.float32)

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    def __init__(self, delay_s: float) -> None:
        self.responses: list[SlowResponse] = []
        self.delay_s = delay_s
        self.embed_image = self

    def remote(self, image: Any) -> SlowResponse:
        response = SlowResponse(self.delay_s)
        self.responses.append(response)
        return response


def test_a_chunk_waits_at_most_its_one_deadline() -> None:
    handle = Handle(delay_s=0.2)
    embedder = HandleEmbedder(handle, "m", timeout_s=0.5)  # type: ignore[arg-type]
    images = [np.zeros((4, 4, 3), np.uint8)] * 8
    started = time.monotonic()
    with pytest.raises(EncoderUnavailable, match=r"8 frames, deadline 0\.5s"):
        embedder.embed_images(images)
    took = time.monotonic() - started
    # Per frame in turn, 8 x 0.2 s would have been waited; one deadline stops it at 0.5 s.
    assert took < 0.9, took
    assert all(r.cancelled for r in handle.responses)
    # Each frame waited only for what was left of the chunk's deadline.
    assert sum(w for r in handle.responses for w in r.waits[:1]) < 1.5


def test_a_chunk_within_its_deadline_is_stacked_in_order() -> None:
    handle = Handle(delay_s=0.0)
    vectors = HandleEmbedder(handle, "m", timeout_s=5).embed_images([np.zeros((4, 4, 3), np.uint8)] * 3)  # type: ignore[arg-type]
    assert vectors.shape == (3, 4) and not any(r.cancelled for r in handle.responses)
