"""Embed images and texts with a SigLIP-family checkpoint into one L2-normalised space.

``SiglipEncoder`` is the plain class the Ray Serve encoder deployment holds. It loads any
checkpoint that ``AutoModel``, ``AutoTokenizer`` and ``AutoImageProcessor`` can load and that has
``get_image_features``/``get_text_features``: ``google/siglip-*``, ``google/siglip2-*`` (fixed
resolution and NaFlex) and the offline test model of ``infra.dev.tinymodel``.

Text follows how SigLIP was trained (big_vision): lowercased, padded on the right to
``text_max_length`` tokens, and encoded without an attention mask (the tower pools the last
position, which attends to the padding as in training). Lowercasing is done here because the
SigLIP 2 Gemma tokenizer doesn't do it and SigLIP 2 was trained on lowercased text; SigLIP's own
tokenizer lowercases anyway.

Images of fixed-size processors (SigLIP, SigLIP 2 at a fixed resolution) are preprocessed on the
model's device (``DevicePreprocessor``): frames of one shape go up as one uint8 tensor and are
resized, rescaled and normalised there as a batch, matching the checkpoint's image processor to
within one grey level. NaFlex processors keep the library's own (PIL) path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from numpy.typing import NDArray
from PIL import Image
from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

from pipeline.embedding.config import embedding_dim, from_local_or_hub, unavailable_error
from pipeline.settings import ModelSettings
from storage.errors import InvalidInput, ModelUnavailable

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: PIL resampling codes the device path reproduces (torch's antialiased modes follow PIL's filters).
_RESAMPLE_MODES = {2: "bilinear", 3: "bicubic"}
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
        self._preprocess = DevicePreprocessor.from_processor(self._image_processor, self.device, self._dtype)
        config = self._model.config
        self.dim: int = embedding_dim(self.model_id, config)
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

    def _load(self) -> tuple[Any, Any, Any]:
        """Load model, tokenizer and image processor: a local directory, else the HF cache, else the hub."""
        model, tokenizer, image_processor = from_local_or_hub(self.model_id, self._load_from)
        if not (hasattr(model, "get_image_features") and hasattr(model, "get_text_features")):
            raise unavailable_error(self.model_id, f"{type(model).__name__} is not a SigLIP image-text model")
        model.to(self.device)
        model.eval()
        return model, tokenizer, image_processor

    def _load_from(self, source: str, local_files_only: bool) -> tuple[Any, Any, Any]:
        try:
            model = AutoModel.from_pretrained(source, dtype=self._dtype, local_files_only=local_files_only)
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)
            image_processor = AutoImageProcessor.from_pretrained(source, local_files_only=local_files_only)
        except (OSError, ValueError, KeyError, ImportError, RuntimeError) as exc:
            raise unavailable_error(self.model_id, f"{type(exc).__name__}: {exc}") from exc
        return model, tokenizer, image_processor

    def embed_images(self, images: Sequence[NDArray[np.uint8] | Image.Image]) -> NDArray[np.float32]:
        """Embed RGB images (``H×W×3`` uint8 arrays or PIL images) into ``(n, dim)`` unit rows.

        Raises:
            InvalidInput: an array is not ``H×W×3`` uint8.
        """
        arrays = [_to_array(image) for image in images]
        return self._embed_batches(arrays, self._image_batch)

    @property
    def preprocesses_on_device(self) -> bool:
        return self._preprocess is not None

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

    def _image_batch(self, images: list[NDArray[np.uint8]]) -> torch.Tensor:
        if self._preprocess is not None:
            return _pooled(self._model.get_image_features(pixel_values=self._preprocess(images)))
        inputs = self._image_processor(images=[Image.fromarray(image) for image in images], return_tensors="pt")
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


def _to_array(image: NDArray[np.uint8] | Image.Image) -> NDArray[np.uint8]:
    """One ``H×W×3`` uint8 RGB array (PIL images are converted to RGB).

    Raises:
        InvalidInput: an array is not ``H×W×3`` uint8.
    """
    if isinstance(image, Image.Image):
        return np.asarray(image if image.mode == "RGB" else image.convert("RGB"))
    array = np.asarray(image)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
        raise InvalidInput(f"expected an H×W×3 uint8 RGB array, got {array.dtype} {array.shape}")
    return array


class DevicePreprocessor:
    """A fixed-size image processor's resize, rescale and normalise, done as tensor ops on the model's
    device for a whole batch: frames of one shape are stacked and uploaded as uint8 (a quarter of
    the bytes of float input), so no per-frame work runs on the host beyond the stack."""

    def __init__(
        self,
        *,
        height: int,
        width: int,
        mode: str | None,
        scale: float,
        mean: Sequence[float],
        std: Sequence[float],
        device: str,
        dtype: torch.dtype,
    ) -> None:
        self.height, self.width, self.mode = height, width, mode
        self.device, self.dtype = device, dtype
        std_t = torch.tensor(std, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        # (x * scale - mean) / std as one multiply-add.
        self._mul = scale / std_t
        self._add = -torch.tensor(mean, dtype=torch.float32, device=device).view(1, 3, 1, 1) / std_t

    @classmethod
    def from_processor(cls, processor: Any, device: str, dtype: torch.dtype) -> DevicePreprocessor | None:
        """The device path for ``processor``, or None when it isn't a fixed-size RGB processor whose
        steps this reproduces (NaFlex, center crops, other filters): those keep the library's path."""
        size = getattr(processor, "size", None)
        get = size.get if isinstance(size, dict) else (lambda key: getattr(size, key, None))
        height, width = get("height"), get("width")
        if not (isinstance(height, int) and isinstance(width, int)) or hasattr(processor, "max_num_patches"):
            return None
        if getattr(processor, "do_center_crop", False) or getattr(processor, "do_pad", False):
            return None
        do_resize = bool(getattr(processor, "do_resize", True))
        mode = _RESAMPLE_MODES.get(int(getattr(processor, "resample", 3) or 0))
        if do_resize and mode is None:
            return None
        scale = float(processor.rescale_factor) if getattr(processor, "do_rescale", True) else 1.0
        if getattr(processor, "do_normalize", True):
            mean, std = list(processor.image_mean), list(processor.image_std)
        else:
            mean, std = [0.0] * 3, [1.0] * 3
        if len(mean) != 3 or len(std) != 3:
            return None
        return cls(
            height=height,
            width=width,
            mode=mode if do_resize else None,
            scale=scale,
            mean=mean,
            std=std,
            device=device,
            dtype=dtype,
        )

    def __call__(self, images: Sequence[NDArray[np.uint8]]) -> torch.Tensor:
        """``(n, 3, height, width)`` pixel values in the model's dtype on its device.

        Raises:
            InvalidInput: without resizing, an image that isn't ``height×width``.
        """
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, image in enumerate(images):
            by_shape.setdefault(image.shape, []).append(i)
        out = torch.empty((len(images), 3, self.height, self.width), dtype=self.dtype, device=self.device)
        for shape, indices in by_shape.items():
            stacked = np.stack([images[i] for i in indices])
            pixels = torch.from_numpy(stacked).to(self.device).permute(0, 3, 1, 2).float()
            if shape[:2] != (self.height, self.width):
                if self.mode is None:
                    raise InvalidInput(f"expected {self.height}×{self.width} images, got {shape[0]}×{shape[1]}")
                pixels = self._resize(pixels, self.mode)
            values = pixels * self._mul + self._add
            out[torch.tensor(indices, device=self.device)] = values.to(self.dtype)
        return out

    def _resize(self, pixels: torch.Tensor, mode: str) -> torch.Tensor:
        """Resize as PIL does 8-bit images: width, then height, each pass rounded and clipped to
        0–255 (PIL keeps the intermediate image in 8 bits, which clips a filter's overshoot)."""
        for size in ((pixels.shape[2], self.width), (self.height, self.width)):
            if tuple(pixels.shape[2:]) != size:
                pixels = (
                    torch.nn.functional.interpolate(pixels, size=size, mode=mode, align_corners=False, antialias=True)
                    .round_()
                    .clamp_(0, 255)
                )
        return pixels
