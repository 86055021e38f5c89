"""Embed images and texts with a SigLIP-family checkpoint into one L2-normalised space.

``SiglipEncoder`` is the plain class the Ray Serve encoder deployment holds. It loads any
checkpoint that ``AutoModel``, ``AutoTokenizer`` and ``AutoImageProcessor`` can load and that has
``get_image_features``/``get_text_features``: ``google/siglip-*``, ``google/siglip2-*`` (fixed
resolution and NaFlex) and the offline test model of ``pipeline.tinymodel``.

Text follows how SigLIP was trained (big_vision): lowercased, padded on the right to
``text_max_length`` tokens, and encoded without an attention mask (the tower pools the last
position, which attends to the padding as in training). Lowercasing is done here because the
SigLIP 2 Gemma tokenizer doesn't do it and SigLIP 2 was trained on lowercased text; SigLIP's own
tokenizer lowercases anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from numpy.typing import NDArray
from PIL import Image
from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

from pipeline.errors import InvalidInput, ModelUnavailable
from pipeline.settings import ModelSettings

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MAX_CAUSE_CHARS = 200
_T = TypeVar("_T")


def resolve_device(device: str) -> str:
    """``auto`` → ``cuda`` when torch sees a GPU, else ``cpu``; other values pass through."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """``auto`` → bfloat16 on CUDA, float32 elsewhere; other values name a torch dtype."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return _DTYPES[dtype]


class SiglipEncoder:
    """A loaded SigLIP checkpoint that turns images and texts into unit-norm float32 vectors."""

    def __init__(self, settings: ModelSettings) -> None:
        """Load the checkpoint named by ``settings.id`` onto the configured device.

        Raises:
            ModelUnavailable: the checkpoint can't be loaded (missing directory, not in the HF
                cache and the hub unreachable, not a SigLIP dual encoder) or ``cuda`` was asked
                for without a CUDA device; the message names the setting to change.
        """
        self.model_id = settings.id
        self.device = resolve_device(settings.device)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ModelUnavailable(
                f"can't load model {self.model_id!r} on cuda: torch sees no CUDA device; "
                "set VIDX_MODEL__DEVICE to 'cpu' or 'auto'"
            )
        self._dtype = resolve_dtype(settings.dtype, self.device)
        self.dtype_name = str(self._dtype).removeprefix("torch.")
        self._max_batch_size = settings.max_batch_size
        if settings.cpu_threads > 0:
            torch.set_num_threads(settings.cpu_threads)

        self._model, self._tokenizer, self._image_processor = self._load()
        config = self._model.config
        text_dim = getattr(config.text_config, "projection_size", None) or config.text_config.hidden_size
        self.dim: int = int(config.vision_config.hidden_size)
        if text_dim != self.dim:
            raise self._unavailable(f"text ({text_dim}) and image ({self.dim}) embeddings differ in size")
        positions = int(config.text_config.max_position_embeddings)
        self.text_max_length = min(settings.text_max_length, positions)
        if settings.text_max_length > positions:
            log.warning(
                "text_max_length %d > the model's %d positions; using %d",
                settings.text_max_length,
                positions,
                positions,
            )
        # Right padding: the text tower pools the last position, as in training.
        self._tokenizer.padding_side = "right"
        log.info("loaded %s on %s (%s), dim %d", self.model_id, self.device, self.dtype_name, self.dim)

    def _unavailable(self, cause: str) -> ModelUnavailable:
        # One line: the first line of the library's message, bounded.
        lines = cause.strip().splitlines() or [""]
        cause = " ".join(lines[0].split())[:_MAX_CAUSE_CHARS]
        return ModelUnavailable(
            f"can't load model {self.model_id!r} ({cause}); set VIDX_MODEL__ID to a local checkpoint "
            "directory or build an offline test model with 'vidx tiny-model DIR'"
        )

    def _load(self) -> tuple[Any, Any, Any]:
        """Load model, tokenizer and image processor: a local directory, else the HF cache, else the hub."""
        path = Path(self.model_id).expanduser()
        if path.is_dir():
            model, tokenizer, image_processor = self._load_from(str(path), local_files_only=True)
        elif path.exists() or self.model_id.startswith(("/", "./", "../", "~")):
            raise self._unavailable(f"{path} is not a directory")
        else:
            try:
                # The cache first: offline, the hub (and its retries) is only tried on a cache miss.
                model, tokenizer, image_processor = self._load_from(self.model_id, local_files_only=True)
            except ModelUnavailable:
                log.info("%s is not in the Hugging Face cache; trying the hub", self.model_id)
                model, tokenizer, image_processor = self._load_from(self.model_id, local_files_only=False)
        if not (hasattr(model, "get_image_features") and hasattr(model, "get_text_features")):
            raise self._unavailable(f"{type(model).__name__} is not a SigLIP image-text model")
        model.to(self.device)
        model.eval()
        return model, tokenizer, image_processor

    def _load_from(self, source: str, *, local_files_only: bool) -> tuple[Any, Any, Any]:
        try:
            model = AutoModel.from_pretrained(source, dtype=self._dtype, local_files_only=local_files_only)
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
            image_processor = AutoImageProcessor.from_pretrained(source, local_files_only=local_files_only)
        except (OSError, ValueError, KeyError, ImportError, RuntimeError) as exc:
            raise self._unavailable(f"{type(exc).__name__}: {exc}") from exc
        return model, tokenizer, image_processor

    def embed_images(self, images: Sequence[NDArray[np.uint8] | Image.Image]) -> NDArray[np.float32]:
        """Embed RGB images (``H×W×3`` uint8 arrays or PIL images) into ``(n, dim)`` unit rows.

        Raises:
            InvalidInput: an array is not ``H×W×3`` uint8.
        """
        pil_images = [_to_pil(image) for image in images]
        return self._embed_batches(pil_images, self._image_batch)

    def embed_texts(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Embed texts (lowercased, padded/truncated to ``text_max_length``) into ``(n, dim)`` unit rows."""
        return self._embed_batches([text.lower() for text in texts], self._text_batch)

    def _embed_batches(self, items: list[_T], embed: Callable[[list[_T]], torch.Tensor]) -> NDArray[np.float32]:
        if not items:
            return np.zeros((0, self.dim), dtype=np.float32)
        chunks: list[NDArray[np.float32]] = []
        with torch.inference_mode():
            for start in range(0, len(items), self._max_batch_size):
                features = embed(items[start : start + self._max_batch_size]).float()
                features = torch.nn.functional.normalize(features, dim=-1)
                chunks.append(features.cpu().numpy().astype(np.float32, copy=False))
        return np.concatenate(chunks)

    def _image_batch(self, images: list[Image.Image]) -> torch.Tensor:
        inputs = self._image_processor(images=images, return_tensors="pt")
        # NaFlex (siglip2) processors also return a patch mask and spatial shapes; pass all through.
        tensors = {
            key: value.to(self.device, self._dtype) if value.is_floating_point() else value.to(self.device)
            for key, value in inputs.items()
        }
        return _pooled(self._model.get_image_features(**tensors))

    def _text_batch(self, texts: list[str]) -> torch.Tensor:
        tokens = self._tokenizer(
            texts, padding="max_length", max_length=self.text_max_length, truncation=True, return_tensors="pt"
        )
        # No attention mask: SigLIP's text tower was trained attending to the padding.
        return _pooled(self._model.get_text_features(input_ids=tokens["input_ids"].to(self.device)))


def _pooled(output: Any) -> torch.Tensor:
    """The projected embeddings: transformers 5 returns a ``BaseModelOutputWithPooling`` whose
    ``pooler_output`` holds them; older versions returned the tensor itself."""
    if isinstance(output, torch.Tensor):
        return output
    pooled = getattr(output, "pooler_output", None)
    if not isinstance(pooled, torch.Tensor):
        raise TypeError(f"unexpected feature output {type(output).__name__}")
    return pooled


def _to_pil(image: NDArray[np.uint8] | Image.Image) -> Image.Image:
    """One RGB PIL image; arrays must be ``H×W×3`` uint8."""
    if isinstance(image, Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")
    array = np.asarray(image)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
        raise InvalidInput(f"expected an H×W×3 uint8 RGB array, got {array.dtype} {array.shape}")
    return Image.fromarray(array)
