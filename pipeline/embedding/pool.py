"""The SigLIP models one process keeps loaded, by model id: during a model switch the Encoder (and a
``fused`` consumer) embed with the old and the new model side by side, and each is loaded once."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from pipeline.settings import ModelSettings

if TYPE_CHECKING:
    from pipeline.embedding.siglip import SiglipEncoder

log = logging.getLogger(__name__)


def load_siglip(settings: ModelSettings) -> SiglipEncoder:
    """The pool's loader: ``SiglipEncoder(settings)``; torch is imported only when a model is loaded."""
    from pipeline.embedding.siglip import SiglipEncoder

    return SiglipEncoder(settings)


class _Loading:
    """One load in progress: callers asking for the same model meanwhile wait for its outcome."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.model: SiglipEncoder | None = None
        self.error: BaseException | None = None


class ModelPool:
    """Loaded models by id, at most ``max_models`` of them (the least recently used is dropped).

    Thread-safe. A model is loaded on first ``get``, once however many threads ask at the same time;
    a load that fails is not kept, so the next ``get`` tries again. A dropped model is freed when the
    last caller still embedding with it is done.
    """

    def __init__(
        self,
        settings: ModelSettings,
        max_models: int = 2,
        *,
        load: Callable[[ModelSettings], SiglipEncoder] = load_siglip,
    ) -> None:
        """``settings`` configure every model (device, dtype, batch size); only the id differs.

        Raises:
            ValueError: ``max_models`` is below 1.
        """
        if max_models < 1:
            raise ValueError(f"max_models must be at least 1, got {max_models}")
        self._settings = settings
        self._max_models = max_models
        self._load = load
        self._lock = threading.Lock()
        self._models: OrderedDict[str, SiglipEncoder] = OrderedDict()  # least recently used first
        self._loading: dict[str, _Loading] = {}

    @property
    def default(self) -> str:
        """The configured model (``settings.id``): what ``get(None)`` returns."""
        return self._settings.id

    @property
    def loaded(self) -> list[str]:
        """Ids of the loaded models, least recently used first."""
        with self._lock:
            return list(self._models)

    def get(self, model_id: str | None = None) -> SiglipEncoder:
        """The model ``model_id`` (None: the default), loaded now if it isn't yet.

        Raises:
            ModelUnavailable: the model can't be loaded (also raised to every caller that waited
                for that same load).
        """
        model_id = model_id or self.default
        with self._lock:
            model = self._models.get(model_id)
            if model is not None:
                self._models.move_to_end(model_id)
                return model
            loading = self._loading.get(model_id)
            if loading is None:
                loading = self._loading[model_id] = _Loading()
                owner = True
            else:
                owner = False
        if not owner:
            # Ends when the owner's load does, however that ends (the loader bounds its own downloads).
            loading.done.wait()
            if loading.model is None:
                raise loading.error or RuntimeError(f"loading {model_id!r} ended without a model")
            return loading.model
        return self._load_as_owner(model_id, loading)

    def _load_as_owner(self, model_id: str, loading: _Loading) -> SiglipEncoder:
        try:
            model = self._load(self._settings.model_copy(update={"id": model_id}))
        except BaseException as exc:
            loading.error = exc
            with self._lock:
                del self._loading[model_id]
            loading.done.set()
            raise
        loading.model = model
        with self._lock:
            self._models[model_id] = model
            del self._loading[model_id]
            while len(self._models) > self._max_models:
                evicted, _ = self._models.popitem(last=False)
                log.info("dropped model %s (keeping %d at most)", evicted, self._max_models)
        loading.done.set()
        return model


def preload(pool: ModelPool, model_id: str, *, required: bool) -> bool:
    """Load ``model_id`` before the replica serves; returns whether it loaded.

    ``required`` (the configured model is the one the index answers with): a failure fails the
    replica's start, loudly, at deploy time. Otherwise (the configured model is a backfill's target,
    or one the index switched away from) a failure is logged and the replica serves the index's
    other models; this one's callers fail and retry, and each of their calls tries the load again.

    Raises:
        ModelUnavailable: ``required`` and the model can't be loaded.
    """
    try:
        pool.get(model_id)
    except Exception as exc:
        if required:
            raise
        log.error(
            "the configured model %s could not be loaded (%s): serving the index's other models; "
            "embeddings with it fail and are retried until it loads or the backfill to it is aborted",
            model_id,
            exc,
        )
        return False
    return True
