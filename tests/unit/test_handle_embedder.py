"""The consumer's view of the Encoder: one call and one deadline per chunk, and the Encoder's chunk
batching (chunks of several callers in one run, each caller's rows back in order)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from pipeline.encoders import Encoder, HandleEmbedder, SerialEmbedder, split_rows
from pipeline.metrics import MemoryBackend, Metrics
from storage.errors import EncoderUnavailable


class SlowResponse:
    """A response that answers after ``delay_s`` (or times out, as Ray's ``result`` does)."""

    def __init__(self, frames: list[Any], delay_s: float) -> None:
        self.frames = frames
        self.delay_s = delay_s
        self.cancelled = False
        self.waits: list[float] = []

    def result(self, timeout_s: float) -> Any:
        self.waits.append(timeout_s)
        if self.delay_s > timeout_s:
            time.sleep(timeout_s)
            raise TimeoutError("timed out")
        time.sleep(self.delay_s)
        return np.ones((len(self.frames), 4), np.float32)

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    def __init__(self, delay_s: float) -> None:
        self.responses: list[SlowResponse] = []
        self.delay_s = delay_s
        self.embed_chunk = self

    def remote(self, frames: list[Any]) -> SlowResponse:
        response = SlowResponse(frames, self.delay_s)
        self.responses.append(response)
        return response


def test_a_chunk_is_one_call_that_waits_at_most_its_one_deadline() -> None:
    handle = Handle(delay_s=2.0)
    embedder = HandleEmbedder(handle, "m", timeout_s=0.3)  # type: ignore[arg-type]
    images = [np.zeros((4, 4, 3), np.uint8)] * 8
    started = time.monotonic()
    with pytest.raises(EncoderUnavailable, match=r"8 frames, deadline 0\.3s"):
        embedder.embed_images(images)
    assert time.monotonic() - started < 1.0
    assert len(handle.responses) == 1 and handle.responses[0].waits == [0.3]
    assert handle.responses[0].cancelled


def test_a_chunk_within_its_deadline_is_one_call_with_every_frame() -> None:
    handle = Handle(delay_s=0.0)
    images = [np.full((4, 4, 3), i, np.uint8) for i in range(3)]
    vectors = HandleEmbedder(handle, "m", timeout_s=5).embed_images(images)  # type: ignore[arg-type]
    assert vectors.shape == (3, 4) and len(handle.responses) == 1
    assert [int(f[0, 0, 0]) for f in handle.responses[0].frames] == [0, 1, 2]
    assert not handle.responses[0].cancelled


def test_rows_split_back_by_chunk_sizes_empty_chunks_included() -> None:
    vectors = np.arange(12, dtype=np.float32).reshape(6, 2)
    parts = split_rows(vectors, [2, 0, 3, 1])
    assert [p.shape[0] for p in parts] == [2, 0, 3, 1]
    assert np.array_equal(np.concatenate(parts), vectors)


class FakeModel:
    """``SiglipEncoder``'s image side: a frame's vector is its first pixel; every run is recorded."""

    def __init__(self) -> None:
        self.runs: list[int] = []

    @property
    def model_id(self) -> str:
        return "fake"

    def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]:
        self.runs.append(len(images))
        return np.array([[float(image[0, 0, 0])] for image in images], dtype=np.float32).reshape(len(images), 1)


def frames(*values: int) -> list[NDArray[np.uint8]]:
    return [np.full((2, 2, 3), v, np.uint8) for v in values]


def test_the_encoder_runs_a_batch_of_chunks_once_and_answers_each_caller_its_own_rows() -> None:
    # The batch body itself (Ray's @serve.batch gathers the callers' chunks into ``chunks``).
    encoder: Any = object.__new__(Encoder.func_or_class)  # type: ignore[attr-defined]
    model = FakeModel()
    encoder._encoder = model
    recorded = MemoryBackend()
    encoder._metrics = Metrics(recorded)
    body = Encoder.func_or_class.embed_chunk.__wrapped__  # type: ignore[attr-defined]
    answers = asyncio.run(asyncio.wait_for(body(encoder, [frames(1, 2, 3), frames(), frames(7)]), 30))
    assert [a[:, 0].tolist() for a in answers] == [[1.0, 2.0, 3.0], [], [7.0]]
    assert model.runs == [4]  # one run over the three callers' frames
    [batches] = [f for f in recorded.families() if f.name == "ray_vidx_encoder_batch_size"]
    assert {s.name: s.value for s in batches.samples if s.name.endswith(("_sum", "_count"))} == {
        "ray_vidx_encoder_batch_size_sum": 4.0,
        "ray_vidx_encoder_batch_size_count": 1.0,
    }


def test_the_fused_layouts_embedder_runs_one_chunk_at_a_time() -> None:
    model, active, overlaps = FakeModel(), [0], []

    class Slow(FakeModel):
        def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]:
            active[0] += 1
            overlaps.append(active[0])
            time.sleep(0.02)
            active[0] -= 1
            return model.embed_images(images)

    serial = SerialEmbedder(Slow())

    async def threads() -> None:
        await asyncio.gather(*(asyncio.to_thread(serial.embed_images, frames(i)) for i in range(4)))

    asyncio.run(asyncio.wait_for(threads(), 30))
    assert max(overlaps) == 1 and serial.model_id == "fake" and len(model.runs) == 4


def test_gpu_shares_follow_the_layout() -> None:
    from pipeline.deployments import FUSED_GPU_SHARE, gpu_shares
    from pipeline.settings import ServeSettings, Settings

    split, fused = Settings(), Settings(serve=ServeSettings(layout="fused"))
    assert gpu_shares(split, cluster_has_gpu=True) == (1.0, 0.0)
    assert gpu_shares(fused, cluster_has_gpu=True) == (FUSED_GPU_SHARE, FUSED_GPU_SHARE)
    assert gpu_shares(fused, cluster_has_gpu=False) == (0.0, 0.0)
    pinned = Settings(serve=ServeSettings(layout="fused", encoder_num_gpus=0, consumer_num_gpus=1))
    assert gpu_shares(pinned, cluster_has_gpu=True) == (0.0, 1.0)
