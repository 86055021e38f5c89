"""The consumer's view of the Encoder: one call and one deadline per chunk, with the model it asks
for, and the Encoder's batching (callers' chunks in one run per model, each caller's rows back in
order); the ``fused`` layout's in-process embedders."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from pipeline.embedding.encoders import (
    BatchEncoder,
    EmbedFailure,
    HandleEmbedder,
    HandleEmbedders,
    HandleQueryEncoder,
    PoolEmbedders,
    SerialEmbedder,
    split_rows,
)
from pipeline.embedding.pool import ModelPool
from pipeline.metrics import MemoryBackend, Metrics
from pipeline.settings import ModelSettings
from storage.errors import EncoderUnavailable


class SlowResponse:
    """A response that answers after ``delay_s`` (or times out, as Ray's ``result`` does)."""

    def __init__(self, frames: list[Any], model_id: str | None, delay_s: float) -> None:
        self.frames = frames
        self.model_id = model_id
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

    def remote(self, frames: list[Any], model_id: str | None) -> SlowResponse:
        response = SlowResponse(frames, model_id, self.delay_s)
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
    assert handle.responses[0].model_id == "m"


def test_handle_embedders_keep_one_embedder_per_model_and_each_asks_for_its_model() -> None:
    handle = Handle(delay_s=0.0)
    embedders = HandleEmbedders(handle, timeout_s=5)  # type: ignore[arg-type]
    old, new = embedders.for_model("old"), embedders.for_model("new")
    assert embedders.for_model("old") is old and old is not new
    assert (old.model_id, new.model_id) == ("old", "new")
    new.embed_images(frames(1))
    old.embed_images(frames(2))
    assert [r.model_id for r in handle.responses] == ["new", "old"]


class AsyncMethod:
    """A handle method whose ``remote`` records its arguments and answers a zero vector."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def remote(self, *args: Any) -> Any:
        self.calls.append(args)

        async def answer() -> NDArray[np.float32]:
            return np.zeros(2, np.float32)

        return answer()


def test_query_encoder_always_passes_the_model_id_default_included() -> None:
    handle = SimpleNamespace(embed_text=AsyncMethod(), embed_image=AsyncMethod())
    queries = HandleQueryEncoder(handle, timeout_s=5)  # type: ignore[arg-type]
    rgb = np.zeros((2, 2, 3), np.uint8)

    async def calls() -> None:
        await queries.embed_text("a dog")
        await queries.embed_text("a cat", "new")
        await queries.embed_image(rgb, model_id="new")
        await queries.embed_image(rgb)

    asyncio.run(asyncio.wait_for(calls(), 30))
    # Always two arguments: Serve's batching fails a batch whose callers passed different numbers.
    assert handle.embed_text.calls == [("a dog", None), ("a cat", "new")]
    assert [call[1] for call in handle.embed_image.calls] == ["new", None]


def test_rows_split_back_by_chunk_sizes_empty_chunks_included() -> None:
    vectors = np.arange(12, dtype=np.float32).reshape(6, 2)
    parts = split_rows(vectors, [2, 0, 3, 1])
    assert [p.shape[0] for p in parts] == [2, 0, 3, 1]
    assert np.array_equal(np.concatenate(parts), vectors)


class FakeModel:
    """``SiglipEncoder`` in ``dim`` dimensions: a frame's vector is its first pixel (in every column),
    a text's its length; every run is recorded."""

    def __init__(self, model_id: str = "fake", dim: int = 1) -> None:
        self.model_id = model_id
        self.dim = dim
        self.runs: list[int] = []

    def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]:
        self.runs.append(len(images))
        return np.array([[float(image[0, 0, 0])] * self.dim for image in images], dtype=np.float32).reshape(
            len(images), self.dim
        )

    def embed_texts(self, texts: Sequence[str]) -> NDArray[np.float32]:
        self.runs.append(len(texts))
        return np.array([[float(len(text))] * self.dim for text in texts], dtype=np.float32).reshape(-1, self.dim)


def frames(*values: int) -> list[NDArray[np.uint8]]:
    return [np.full((2, 2, 3), v, np.uint8) for v in values]


def fake_pool(*models: FakeModel, max_models: int = 2) -> ModelPool:
    """A pool whose default is the first model; loads are of the given fakes."""
    by_id = {model.model_id: model for model in models}
    settings = ModelSettings(id=models[0].model_id, device="cpu")
    return ModelPool(settings, max_models, load=lambda s: by_id[s.id])  # type: ignore[arg-type,return-value]


def shell(pool: ModelPool) -> tuple[BatchEncoder, MemoryBackend]:
    """What the Encoder deployment holds, over ``pool``, with a recording metrics backend."""
    recorded = MemoryBackend()
    return BatchEncoder(pool, Metrics(recorded)), recorded


def batch_sizes(recorded: MemoryBackend) -> dict[str, float]:
    [batches] = [f for f in recorded.families() if f.name == "ray_vidx_encoder_batch_size"]
    return {s.name: s.value for s in batches.samples if s.name.endswith(("_sum", "_count"))}


def test_the_encoder_runs_a_batch_of_chunks_once_and_answers_each_caller_its_own_rows() -> None:
    # The batch body itself (Ray's @serve.batch gathers the callers' chunks into ``chunks``).
    model = FakeModel()
    encoder, recorded = shell(fake_pool(model))
    answers = asyncio.run(asyncio.wait_for(encoder.embed_chunks([frames(1, 2, 3), frames(), frames(7)]), 30))
    assert [a[:, 0].tolist() for a in answers] == [[1.0, 2.0, 3.0], [], [7.0]]
    assert model.runs == [4]  # one run over the three callers' frames
    assert batch_sizes(recorded) == {
        "ray_vidx_encoder_batch_size_sum": 4.0,
        "ray_vidx_encoder_batch_size_count": 1.0,
    }


def test_a_batch_of_chunks_for_two_models_runs_once_per_model_and_answers_in_the_callers_order() -> None:
    old, new = FakeModel("old", dim=2), FakeModel("new", dim=3)
    encoder, recorded = shell(fake_pool(old, new))
    chunks = [frames(1, 2), frames(3), frames(5, 6), frames(), frames(4)]
    answers = asyncio.run(asyncio.wait_for(encoder.embed_chunks(chunks, ["old", None, "new", "old", "new"]), 30))
    assert [a.shape for a in answers] == [(2, 2), (1, 2), (2, 3), (0, 2), (1, 3)]
    assert [a[:, 0].tolist() for a in answers] == [[1.0, 2.0], [3.0], [5.0, 6.0], [], [4.0]]
    assert old.runs == [3] and new.runs == [3]  # None is the default model: one group with "old"
    assert batch_sizes(recorded)["ray_vidx_encoder_batch_size_count"] == 2.0


def test_batches_of_images_and_texts_for_two_models_answer_each_caller_with_its_model() -> None:
    old, new = FakeModel("old", dim=2), FakeModel("new", dim=3)
    encoder, _ = shell(fake_pool(old, new))
    images = [frames(v)[0] for v in (1, 2, 3)]
    vectors = asyncio.run(asyncio.wait_for(encoder.embed_images(images, ["new", "old", "new"]), 30))
    assert [v.tolist() for v in vectors] == [[1.0] * 3, [2.0] * 2, [3.0] * 3]
    texts = ["a", "bb", "ccc"]
    vectors = asyncio.run(asyncio.wait_for(encoder.embed_texts(texts, [None, "new", "old"]), 30))
    assert [v.tolist() for v in vectors] == [[1.0] * 2, [2.0] * 3, [3.0] * 2]
    assert old.runs == [1, 2] and new.runs == [2, 1]


def test_a_model_that_cannot_load_fails_only_its_own_callers_in_a_mixed_batch() -> None:
    old = FakeModel("old", dim=2)
    encoder, _ = shell(fake_pool(old))  # "broken" is no model the pool can load
    answers = asyncio.run(
        asyncio.wait_for(encoder.embed_chunks([frames(1), frames(2), frames(3)], ["old", "broken", None]), 30)
    )
    assert [a[:, 0].tolist() for a in (answers[0], answers[2])] == [[1.0], [3.0]]
    assert isinstance(answers[1], EmbedFailure) and answers[1].model_id == "broken"
    # Through a handle, the failed caller gets EncoderUnavailable (retried), naming the model.
    handle = SimpleNamespace(
        embed_chunk=SimpleNamespace(remote=lambda *a: SimpleNamespace(result=lambda timeout_s: answers[1]))
    )
    with pytest.raises(EncoderUnavailable, match="could not load model 'broken'"):
        HandleEmbedder(handle, "broken", timeout_s=5).embed_images(frames(2))  # type: ignore[arg-type]


def test_info_and_load_answer_for_the_model_asked_loading_it() -> None:
    old, new = FakeModel("old", dim=2), FakeModel("new", dim=3)
    pool = fake_pool(old, new)
    encoder, _ = shell(pool)
    assert asyncio.run(encoder.info()) == {"model_id": "old", "dim": 2}
    assert pool.loaded == ["old"]
    assert asyncio.run(encoder.load("new")) == 3
    assert asyncio.run(encoder.info("new")) == {"model_id": "new", "dim": 3}
    assert pool.loaded == ["old", "new"]


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
    from pipeline.serve.resources import FUSED_GPU_SHARE, gpu_shares
    from pipeline.settings import ServeSettings, Settings

    split, fused = Settings(), Settings(serve=ServeSettings(layout="fused"))
    assert gpu_shares(split, cluster_has_gpu=True) == (1.0, 0.0)
    assert gpu_shares(fused, cluster_has_gpu=True) == (FUSED_GPU_SHARE, FUSED_GPU_SHARE)
    assert gpu_shares(fused, cluster_has_gpu=False) == (0.0, 0.0)
    pinned = Settings(serve=ServeSettings(layout="fused", encoder_num_gpus=0, consumer_num_gpus=1))
    assert gpu_shares(pinned, cluster_has_gpu=True) == (0.0, 1.0)


def test_pool_embedders_take_turns_on_one_lock_across_models() -> None:
    active, overlaps = [0], []
    counter = threading.Lock()

    class Slow(FakeModel):
        def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]:
            with counter:
                active[0] += 1
                overlaps.append(active[0])
            time.sleep(0.02)
            with counter:
                active[0] -= 1
            return super().embed_images(images)

    old, new = Slow("old", dim=2), Slow("new", dim=3)
    embedders = PoolEmbedders(fake_pool(old, new))
    by_model = [embedders.for_model(model_id) for model_id in ("old", "new")]
    assert [e.model_id for e in by_model] == ["old", "new"]

    async def threads() -> list[NDArray[np.float32]]:
        calls = (asyncio.to_thread(by_model[i % 2].embed_images, frames(i)) for i in range(6))
        return list(await asyncio.gather(*calls))

    vectors = asyncio.run(asyncio.wait_for(threads(), 30))
    assert max(overlaps) == 1 and len(overlaps) == 6
    assert [v.shape for v in vectors] == [(1, 2), (1, 3)] * 3
    assert len(old.runs) == 3 and len(new.runs) == 3
