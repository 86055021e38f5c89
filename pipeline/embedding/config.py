"""What a model's configuration says, without torch: where a checkpoint is found (a local directory,
the Hugging Face cache, the hub) and the size of its embeddings (``model_dim``), so the lifecycle
(``pipeline.reindex.lifecycle``) can check a model where no model runs (the CLI, the router, the API)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from storage.errors import ModelUnavailable

log = logging.getLogger(__name__)

_MAX_CAUSE_CHARS = 200
_T = TypeVar("_T")


def unavailable_error(model_id: str, cause: str) -> ModelUnavailable:
    """The error for a model that can't be loaded: one line (the first line of the library's message,
    bounded) that names the setting to change."""
    lines = cause.strip().splitlines() or [""]
    cause = " ".join(lines[0].split())[:_MAX_CAUSE_CHARS]
    return ModelUnavailable(
        f"can't load model {model_id!r} ({cause}); set VIDX_MODEL__ID to a local checkpoint "
        "directory or build an offline test model with 'vidx tiny-model DIR'"
    )


def from_local_or_hub(model_id: str, load: Callable[[str, bool], _T]) -> _T:
    """``load(source, local_files_only)`` from a local directory, else the HF cache, else the hub.

    Raises:
        ModelUnavailable: ``model_id`` looks like a path but is no directory, or ``load`` raised it.
    """
    path = Path(model_id).expanduser()
    if path.is_dir():
        return load(str(path), True)
    if path.exists() or model_id.startswith(("/", "./", "../", "~")):
        raise unavailable_error(model_id, f"{path} is not a directory")
    try:
        # The cache first: offline, the hub (and its retries) is only tried on a cache miss.
        return load(model_id, True)
    except ModelUnavailable:
        log.info("%s is not in the Hugging Face cache; trying the hub", model_id)
        return load(model_id, False)


def embedding_dim(model_id: str, config: Any) -> int:
    """The size of a SigLIP checkpoint's embeddings, from its configuration.

    Raises:
        ModelUnavailable: not a dual-encoder configuration, or its text and image embeddings differ in size.
    """
    text_config, vision_config = getattr(config, "text_config", None), getattr(config, "vision_config", None)
    if text_config is None or vision_config is None:
        raise unavailable_error(model_id, f"{type(config).__name__} is not a SigLIP image-text configuration")
    text_dim = getattr(text_config, "projection_size", None) or text_config.hidden_size
    dim = int(vision_config.hidden_size)
    if text_dim != dim:
        raise unavailable_error(model_id, f"text ({text_dim}) and image ({dim}) embeddings differ in size")
    return dim


def model_dim(model_id: str) -> int:
    """The embedding size ``SiglipEncoder`` will have for ``model_id``, read from its configuration
    alone (no weights, no torch model): a table for a model can be made before any replica loads it.

    Raises:
        ModelUnavailable: the configuration can't be read (missing directory, not in the HF cache and
            the hub unreachable) or isn't a SigLIP dual encoder's; the message names VIDX_MODEL__ID.
    """

    from transformers import AutoConfig

    def read(source: str, local_files_only: bool) -> Any:
        try:
            return AutoConfig.from_pretrained(source, local_files_only=local_files_only)
        except (OSError, ValueError, KeyError, ImportError, RuntimeError) as exc:
            raise unavailable_error(model_id, f"{type(exc).__name__}: {exc}") from exc

    return embedding_dim(model_id, from_local_or_hub(model_id, read))
