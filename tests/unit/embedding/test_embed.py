"""SiglipEncoder against the tiny offline SigLIP checkpoint (``tiny_model_dir`` in tests/conftest.py)."""

from __future__ import annotations

import inspect
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from numpy.typing import NDArray
from PIL import Image

from infra.dev.tinymodel import HIDDEN_SIZE, build_tiny_siglip
from pipeline.embedding.siglip import SiglipEncoder
from pipeline.query.images import decode_query_image
from pipeline.settings import ModelSettings
from storage.errors import InvalidInput, ModelUnavailable
from tests.media import ORIENTATIONS, oriented_image


def _settings(model_dir: Path, **overrides: object) -> ModelSettings:
    return ModelSettings.model_validate({"id": str(model_dir), "device": "cpu", **overrides})


@pytest.fixture(scope="module")
def encoder(tiny_model_dir: Path) -> SiglipEncoder:
    return SiglipEncoder(_settings(tiny_model_dir, max_batch_size=3))


def _block_images(n: int, *, seed: int = 1, size: int = 48) -> list[NDArray[np.uint8]]:
    """``n`` different images: random 4×4 grids of coloured blocks, upscaled to ``size``."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, 4, 4, 3), dtype=np.uint8)
    scale = size // 4
    return [np.ascontiguousarray(b.repeat(scale, axis=0).repeat(scale, axis=1)) for b in blocks]


def test_loads_tiny_checkpoint(encoder: SiglipEncoder, tiny_model_dir: Path) -> None:
    assert encoder.model_id == str(tiny_model_dir)
    assert encoder.dim == HIDDEN_SIZE
    assert encoder.device == "cpu"
    assert encoder.dtype_name == "float32"
    assert encoder.text_max_length == 64


def test_image_embeddings_shape_and_unit_norm(encoder: SiglipEncoder) -> None:
    # 7 images with max_batch_size=3: three internal batches.
    vectors = encoder.embed_images(_block_images(7))
    assert vectors.shape == (7, encoder.dim)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)


def test_text_embeddings_shape_and_unit_norm(encoder: SiglipEncoder) -> None:
    texts = ["", "a dog", "A person walking a dog in the park at night, in the rain! " * 8, "ünïcödé ☃ text"]
    vectors = encoder.embed_texts(texts)
    assert vectors.shape == (4, encoder.dim)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)


def test_empty_inputs_give_empty_arrays(encoder: SiglipEncoder) -> None:
    assert encoder.embed_images([]).shape == (0, encoder.dim)
    assert encoder.embed_texts([]).shape == (0, encoder.dim)
    assert encoder.embed_texts([]).dtype == np.float32


def test_same_input_same_vector(encoder: SiglipEncoder) -> None:
    images = _block_images(2)
    np.testing.assert_array_equal(encoder.embed_images(images), encoder.embed_images(images))
    np.testing.assert_array_equal(encoder.embed_texts(["a cat"]), encoder.embed_texts(["a cat"]))


def test_batching_does_not_change_vectors(encoder: SiglipEncoder) -> None:
    images = _block_images(5)
    together = encoder.embed_images(images)
    alone = np.concatenate([encoder.embed_images([image]) for image in images])
    np.testing.assert_allclose(together, alone, atol=1e-5)


def test_text_is_lowercased(encoder: SiglipEncoder) -> None:
    np.testing.assert_array_equal(encoder.embed_texts(["A Red CAR"]), encoder.embed_texts(["a red car"]))


def test_image_is_closest_to_itself(encoder: SiglipEncoder) -> None:
    images = _block_images(6)
    vectors = encoder.embed_images(images)
    similarity = vectors @ vectors.T
    assert (similarity.argmax(axis=1) == np.arange(len(images))).all()
    assert (similarity.max(axis=1) < 1 + 1e-5).all()


def test_array_and_pil_give_the_same_vector(encoder: SiglipEncoder) -> None:
    array = _block_images(1)[0]
    from_array = encoder.embed_images([array])
    from_pil = encoder.embed_images([Image.fromarray(array)])
    np.testing.assert_array_equal(from_array, from_pil)


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_an_exif_rotated_query_image_embeds_as_the_upright_one(encoder: SiglipEncoder, orientation: int) -> None:
    # A photo stored sideways by a phone, decoded the way an image query is (pipeline/query/search.py).
    upright = np.ascontiguousarray(np.concatenate(_block_images(2, seed=4), axis=1))
    query = decode_query_image(oriented_image(upright, orientation, "PNG"), 1 << 20, 1 << 20)

    np.testing.assert_array_equal(encoder.embed_images([query]), encoder.embed_images([upright]))
    stored = np.ascontiguousarray(ORIENTATIONS[orientation](upright))
    assert not np.allclose(encoder.embed_images([stored]), encoder.embed_images([upright]), atol=1e-3)


def test_rejects_non_rgb_arrays(encoder: SiglipEncoder) -> None:
    with pytest.raises(InvalidInput):
        encoder.embed_images([np.zeros((8, 8), dtype=np.uint8)])
    with pytest.raises(InvalidInput):
        encoder.embed_images([np.zeros((8, 8, 3), dtype=np.float32)])


def test_same_seed_builds_give_same_embeddings(tmp_path: Path, tiny_model_dir: Path, encoder: SiglipEncoder) -> None:
    rebuilt = SiglipEncoder(_settings(build_tiny_siglip(tmp_path / "again", seed=0)))
    images = _block_images(3)
    np.testing.assert_array_equal(rebuilt.embed_images(images), encoder.embed_images(images))
    np.testing.assert_array_equal(rebuilt.embed_texts(["a dog"]), encoder.embed_texts(["a dog"]))


def test_other_seed_gives_other_embeddings(tmp_path: Path, encoder: SiglipEncoder) -> None:
    other = SiglipEncoder(_settings(build_tiny_siglip(tmp_path / "other", seed=1)))
    images = _block_images(2)
    assert not np.allclose(other.embed_images(images), encoder.embed_images(images))


def test_missing_model_path_raises_model_unavailable(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelUnavailable, match="VIDX_MODEL__ID") as caught:
        SiglipEncoder(_settings(missing))
    assert str(missing) in str(caught.value)
    assert "\n" not in str(caught.value)


def test_directory_without_checkpoint_raises_model_unavailable(tmp_path: Path) -> None:
    with pytest.raises(ModelUnavailable, match="VIDX_MODEL__ID"):
        SiglipEncoder(_settings(tmp_path))


def test_tiny_model_rejects_bad_patch_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of patch_size"):
        build_tiny_siglip(tmp_path, image_size=60, patch_size=16)


def test_hub_id_tries_the_cache_before_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []

    class _Offline:
        @staticmethod
        def from_pretrained(source: str, **kwargs: Any) -> None:
            calls.append(kwargs["local_files_only"])
            raise OSError(f"We couldn't connect to 'https://huggingface.co' for {source}.\nCheck your connection.")

    monkeypatch.setattr("pipeline.embedding.siglip.AutoModel", _Offline)
    with pytest.raises(ModelUnavailable) as caught:
        SiglipEncoder(ModelSettings(id="google/siglip2-base-patch16-224", device="cpu"))
    assert calls == [True, False]
    message = str(caught.value)
    assert message.startswith("can't load model 'google/siglip2-base-patch16-224' (OSError: We couldn't connect")
    assert "VIDX_MODEL__ID" in message
    assert "\n" not in message


def test_cuda_without_a_gpu_raises_model_unavailable(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ModelUnavailable, match="VIDX_MODEL__DEVICE"):
        SiglipEncoder(_settings(tiny_model_dir, device="cuda"))


# -- preprocessing on the model's device ---------------------------------------------------------
_ONE_LEVEL = 2 / 255  # one grey level after rescale (1/255) and normalise (std 0.5)


def _mixed_images() -> list[NDArray[np.uint8]]:
    """Frames of several shapes, as one batch of several videos holds them: larger, smaller, not
    square, and exactly the model's size."""
    rng = np.random.default_rng(3)
    smooth = [np.kron(rng.integers(0, 256, (h // 8, w // 8, 3)), np.ones((8, 8, 1))) for h, w in [(96, 160), (48, 48)]]
    noisy = [rng.integers(0, 256, (h, w, 3)) for h, w in [(64, 64), (20, 36), (200, 120)]]
    return [np.ascontiguousarray(a, dtype=np.uint8) for a in [*smooth, *noisy, smooth[0]]]


def _library_pixels(processor: Any, images: list[NDArray[np.uint8]]) -> Any:
    return processor(images=[Image.fromarray(i) for i in images], return_tensors="pt")["pixel_values"]


def test_tiny_model_preprocesses_on_the_device(encoder: SiglipEncoder) -> None:
    assert encoder.preprocesses_on_device


def test_device_preprocessing_matches_the_image_processor(encoder: SiglipEncoder) -> None:
    images = _mixed_images()
    pixels = encoder._preprocess(images)  # type: ignore[misc]
    expected = _library_pixels(encoder._image_processor, images)
    assert pixels.shape == expected.shape and pixels.device.type == "cpu"
    diff = (pixels - expected).abs()
    assert float(diff.max()) <= 2 * _ONE_LEVEL + 1e-5
    assert float(diff.mean()) <= 0.1 * _ONE_LEVEL


def test_device_preprocessing_matches_a_bicubic_processor() -> None:
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    from pipeline.embedding.siglip import DevicePreprocessor

    processor = SiglipImageProcessorPil(size={"height": 224, "width": 224}, resample=3)
    preprocess = DevicePreprocessor.from_processor(processor, "cpu", torch.float32)
    assert preprocess is not None and preprocess.mode == "bicubic"
    images = _mixed_images()
    diff = (preprocess(images) - _library_pixels(processor, images)).abs()
    assert float(diff.max()) <= 2 * _ONE_LEVEL + 1e-5
    assert float(diff.mean()) <= 0.1 * _ONE_LEVEL


def test_unsupported_processors_keep_the_library_path() -> None:
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    from pipeline.embedding.siglip import DevicePreprocessor

    nearest = SiglipImageProcessorPil(size={"height": 32, "width": 32}, resample=0)
    assert DevicePreprocessor.from_processor(nearest, "cpu", torch.float32) is None

    naflex = SimpleNamespace(size={"height": 32, "width": 32}, max_num_patches=256)
    assert DevicePreprocessor.from_processor(naflex, "cpu", torch.float32) is None


def test_device_and_library_preprocessing_give_the_same_vectors(
    encoder: SiglipEncoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    images = _mixed_images()
    on_device = encoder.embed_images(images)
    monkeypatch.setattr(encoder, "_preprocess", None)
    library = encoder.embed_images(images)
    assert (np.sum(on_device * library, axis=1) > 0.999).all()


def test_mixed_shapes_in_one_batch_embed_as_alone(encoder: SiglipEncoder) -> None:
    images = _mixed_images()
    together = encoder.embed_images(images)
    alone = np.concatenate([encoder.embed_images([image]) for image in images])
    np.testing.assert_allclose(together, alone, atol=1e-5)
    np.testing.assert_array_equal(together[0], together[-1])


@pytest.fixture
def fresh_batch_queues() -> Iterator[None]:
    """Ray keeps a ``@serve.batch`` method's queue on the class (made on first call, unpicklable):
    drop it after the test, or a later test can no longer serialize the Encoder class, as Serve does."""
    from pipeline.serve.encoder import Encoder

    yield
    for name in ("embed_image", "embed_text", "embed_chunk"):
        method = getattr(Encoder.func_or_class, name)  # type: ignore[attr-defined]
        enqueue = inspect.getclosurevars(method).nonlocals.get("enqueue_request")
        wrapper = inspect.getclosurevars(enqueue).nonlocals.get("lazy_batch_queue_wrapper") if enqueue else None
        assert wrapper is not None, name  # Ray's layout changed: this reset no longer resets anything
        if wrapper._queue is not None:
            # Its task ran on the test's loop, closed by now; without a task, the queue's __del__ does
            # not make an event loop of its own (which would be left unclosed, a ResourceWarning later).
            wrapper._queue._handle_batch_task = None
        wrapper._queue = None


@pytest.mark.usefixtures("fresh_batch_queues")
def test_encoder_deployment_batches_concurrent_calls_as_configured(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Serve shell applies ``max_batch_size``/``batch_wait_timeout_s`` to its ``@serve.batch``
    method: concurrent one-frame calls (several videos' frames) are embedded in batches of that size."""
    import asyncio

    from pipeline.serve.encoder import Encoder

    # Outside a replica: the batch queue only reads max_ongoing_requests from the replica context.
    replica = SimpleNamespace(_deployment_config=SimpleNamespace(max_ongoing_requests=256))
    monkeypatch.setattr("ray.serve.get_replica_context", lambda: replica)

    shell = Encoder.func_or_class(_settings(tiny_model_dir, max_batch_size=3, batch_wait_timeout_s=1.0))
    sizes: list[int] = []
    embed = shell.models.default.embed_images

    def counted(images: Any) -> NDArray[np.float32]:
        sizes.append(len(images))
        return embed(images)

    shell.models.default.embed_images = counted
    images = _mixed_images()[:5] + _block_images(2)

    async def calls() -> list[NDArray[np.float32]]:
        return list(await asyncio.gather(*(shell.embed_image(image) for image in images)))

    vectors = asyncio.run(calls())
    assert sizes == [3, 3, 1]
    np.testing.assert_allclose(np.stack(vectors), embed(images), atol=1e-5)


def test_preprocessing_runs_on_the_model_device(tiny_model_dir: Path, encoder: SiglipEncoder) -> None:
    # Runs everywhere: on the GPU when there is one (bf16), else on the CPU through the same path.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    on_device = SiglipEncoder(_settings(tiny_model_dir, device=device))
    images = _mixed_images()
    pixels = on_device._preprocess(images)  # type: ignore[misc]
    assert pixels.device.type == device
    assert pixels.dtype == (torch.bfloat16 if device == "cuda" else torch.float32)
    reference = encoder._preprocess(images)  # type: ignore[misc]
    assert float((pixels.float().cpu() - reference).abs().max()) <= 2 * _ONE_LEVEL + 0.01  # bf16 rounding
    cosine = np.sum(on_device.embed_images(images) * encoder.embed_images(images), axis=1)
    assert (cosine > 0.99).all()


# -- several models: dimensions from configurations, one Encoder serving two models ---------------
OTHER_SIZE = 48


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny checkpoint, of another embedding size (the new model of a switch)."""
    return build_tiny_siglip(tmp_path_factory.mktemp("tiny-siglip-48"), seed=1, hidden_size=OTHER_SIZE)


def test_tiny_model_rejects_a_width_the_heads_do_not_divide(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        build_tiny_siglip(tmp_path, hidden_size=33)


def test_model_dim_reads_each_models_size_without_building_a_model(
    tiny_model_dir: Path, other_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.embedding.config import model_dim

    def no_model(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("model_dim built a model")

    monkeypatch.setattr("pipeline.embedding.siglip.AutoModel.from_pretrained", no_model)
    monkeypatch.setattr("transformers.SiglipModel.from_pretrained", no_model)
    assert model_dim(str(tiny_model_dir)) == HIDDEN_SIZE
    assert model_dim(str(other_model_dir)) == OTHER_SIZE
    # The configuration alone is enough: no weights (nor tokenizer, nor image processor) are read.
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(other_model_dir / "config.json", config_only)
    assert model_dim(str(config_only)) == OTHER_SIZE


def test_model_dim_is_the_loaded_encoders_dim(other_model_dir: Path) -> None:
    from pipeline.embedding.config import model_dim

    assert model_dim(str(other_model_dir)) == SiglipEncoder(_settings(other_model_dir)).dim


def test_model_dim_of_a_missing_or_empty_directory_raises_model_unavailable(tmp_path: Path) -> None:
    from pipeline.embedding.config import model_dim

    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelUnavailable, match="VIDX_MODEL__ID") as caught:
        model_dim(str(missing))
    assert str(missing) in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ModelUnavailable, match="VIDX_MODEL__ID"):
        model_dim(str(tmp_path))


def test_model_dim_refuses_towers_of_different_sizes(tmp_path: Path) -> None:
    from transformers import SiglipConfig

    from pipeline.embedding.config import model_dim

    SiglipConfig(text_config={"hidden_size": 32}, vision_config={"hidden_size": 48}).save_pretrained(tmp_path)
    with pytest.raises(ModelUnavailable, match=r"text \(32\) and image \(48\) embeddings differ in size"):
        model_dim(str(tmp_path))


def test_model_dim_of_a_hub_id_tries_the_cache_before_the_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.embedding.config import model_dim

    calls: list[bool] = []

    def offline(source: str, **kwargs: Any) -> None:
        calls.append(kwargs["local_files_only"])
        raise OSError(f"We couldn't connect to 'https://huggingface.co' for {source}.\nCheck your connection.")

    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", offline)
    with pytest.raises(ModelUnavailable, match="VIDX_MODEL__ID") as caught:
        model_dim("google/siglip2-base-patch16-224")
    assert calls == [True, False]
    assert str(caught.value).startswith("can't load model 'google/siglip2-base-patch16-224' (OSError: We couldn't")


def _serve_encoder(model_dir: Path, monkeypatch: pytest.MonkeyPatch, **overrides: object) -> Any:
    """The Encoder's Serve shell outside a replica (the batch queue reads max_ongoing_requests from
    the replica context)."""
    from pipeline.serve.encoder import Encoder

    replica = SimpleNamespace(_deployment_config=SimpleNamespace(max_ongoing_requests=256))
    monkeypatch.setattr("ray.serve.get_replica_context", lambda: replica)
    return Encoder.func_or_class(_settings(model_dir, **overrides))  # type: ignore[attr-defined]


@pytest.mark.usefixtures("fresh_batch_queues")
def test_encoder_batches_callers_of_two_models_and_answers_each_with_its_models_vectors(
    tiny_model_dir: Path, other_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through Serve's batching: callers of both models (the model id positional, by keyword, or
    None for the configured one) in the same batches; each gets its own model's vectors, in order."""
    import asyncio

    shell = _serve_encoder(tiny_model_dir, monkeypatch, max_batch_size=8, max_batch_chunks=8, batch_wait_timeout_s=1.0)
    old, new = str(tiny_model_dir), str(other_model_dir)
    images = _block_images(4)
    chunks = [images[:2], images[2:3], images[3:]]

    async def calls() -> tuple[list[Any], list[Any], list[Any]]:
        return (
            list(await asyncio.gather(shell.embed_image(images[0], new), shell.embed_image(images[1], model_id=None))),
            list(await asyncio.gather(shell.embed_text("a dog", None), shell.embed_text("a dog", model_id=new))),
            list(await asyncio.gather(*(shell.embed_chunk(c, new if i % 2 else old) for i, c in enumerate(chunks)))),
        )

    by_image, by_text, by_chunk = asyncio.run(asyncio.wait_for(calls(), 60))
    old_model, new_model = SiglipEncoder(_settings(tiny_model_dir)), SiglipEncoder(_settings(other_model_dir))
    np.testing.assert_allclose(by_image[0], new_model.embed_images(images[:1])[0], atol=1e-5)
    np.testing.assert_allclose(by_image[1], old_model.embed_images(images[1:2])[0], atol=1e-5)
    np.testing.assert_allclose(by_text[0], old_model.embed_texts(["a dog"])[0], atol=1e-5)
    np.testing.assert_allclose(by_text[1], new_model.embed_texts(["a dog"])[0], atol=1e-5)
    assert [c.shape for c in by_chunk] == [(2, HIDDEN_SIZE), (1, OTHER_SIZE), (1, HIDDEN_SIZE)]
    np.testing.assert_allclose(by_chunk[1], new_model.embed_images(images[2:3]), atol=1e-5)
    assert asyncio.run(shell.info(new)) == {"model_id": new, "dim": OTHER_SIZE}
    assert asyncio.run(shell.info()) == {"model_id": old, "dim": HIDDEN_SIZE}


@pytest.mark.usefixtures("fresh_batch_queues")
def test_a_batch_whose_callers_pass_different_numbers_of_arguments_fails(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why every handle passes the model id, None included: Serve's batching zips arguments by position."""
    import asyncio

    shell = _serve_encoder(tiny_model_dir, monkeypatch, max_batch_size=8, batch_wait_timeout_s=1.0)

    async def calls() -> list[Any]:
        return list(await asyncio.gather(shell.embed_text("a"), shell.embed_text("b", None), return_exceptions=True))

    outcomes = asyncio.run(asyncio.wait_for(calls(), 60))
    assert all(isinstance(outcome, AssertionError) for outcome in outcomes)
