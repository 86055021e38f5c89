"""ModelPool: one load per model however many threads ask, at most ``max_models`` kept (least
recently used dropped), failed loads not kept; and the ``fused`` layout's embedders over real tiny
checkpoints of two sizes."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from infra.dev.tinymodel import HIDDEN_SIZE, build_tiny_siglip
from pipeline.embedding.encoders import PoolEmbedders
from pipeline.embedding.pool import ModelPool, preload
from pipeline.settings import ModelSettings
from storage.errors import ModelUnavailable

OTHER_SIZE = 48


class Loads:
    """A loader that records the ids it loads; each load takes ``delay_s`` and fails while ``failing``."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.ids: list[str] = []
        self.delay_s = delay_s
        self.failing = False
        self._lock = threading.Lock()

    def __call__(self, settings: ModelSettings) -> Any:
        with self._lock:
            self.ids.append(settings.id)
        time.sleep(self.delay_s)
        if self.failing:
            raise ModelUnavailable(f"can't load model {settings.id!r}")
        return object()


def pool_of(loads: Loads, max_models: int = 2) -> ModelPool:
    return ModelPool(ModelSettings(id="a", device="cpu"), max_models, load=loads)


def race(n: int, call: Any) -> list[Any]:
    """``call()`` in ``n`` threads started together; each thread's result or exception."""
    barrier = threading.Barrier(n)

    def racer() -> Any:
        barrier.wait(timeout=10)
        try:
            return call()
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(n) as threads:
        return [f.result(timeout=30) for f in [threads.submit(racer) for _ in range(n)]]


def test_concurrent_gets_of_one_model_load_it_once() -> None:
    loads = Loads(delay_s=0.2)  # the racers all arrive while the first load is still running
    pool = pool_of(loads)
    models = race(8, lambda: pool.get("b"))
    assert loads.ids == ["b"]
    assert all(model is models[0] for model in models)
    assert pool.loaded == ["b"]


def test_a_failed_load_fails_its_waiters_and_is_not_kept() -> None:
    loads = Loads(delay_s=0.2)
    loads.failing = True
    pool = pool_of(loads)
    outcomes = race(4, lambda: pool.get("b"))
    assert all(isinstance(outcome, ModelUnavailable) for outcome in outcomes)
    assert loads.ids == ["b"] and pool.loaded == []
    loads.failing = False
    model = pool.get("b")
    assert loads.ids == ["b", "b"] and pool.get("b") is model


def test_a_required_preload_that_fails_fails_the_replicas_start() -> None:
    loads = Loads()
    loads.failing = True
    with pytest.raises(ModelUnavailable, match="can't load model 'a'"):
        preload(pool_of(loads), "a", required=True)


def test_an_optional_preload_that_fails_leaves_the_pool_serving_other_models(caplog: pytest.LogCaptureFixture) -> None:
    """With ``reindex.auto`` the configured model may be the new one a backfill switches to: its
    weights failing to load must not keep the Encoder (and the active model's searches) down."""

    class OnlyB(Loads):
        def __call__(self, settings: ModelSettings) -> Any:
            self.failing = settings.id == "a"
            return super().__call__(settings)

    loads = OnlyB()
    pool = pool_of(loads)
    assert preload(pool, "a", required=False) is False
    assert "the configured model a could not be loaded" in caplog.text
    assert pool.get("b") is not None and pool.loaded == ["b"]
    with pytest.raises(ModelUnavailable):
        pool.get("a")  # each call tries the load again
    assert loads.ids == ["a", "b", "a"]


def test_past_max_models_the_least_recently_used_is_dropped() -> None:
    loads = Loads()
    pool = pool_of(loads, max_models=2)
    a = pool.get("a")
    pool.get("b")
    assert pool.get("a") is a  # "b" is now the least recently used
    pool.get("c")
    assert pool.loaded == ["a", "c"]
    pool.get("b")
    assert pool.loaded == ["c", "b"]
    assert loads.ids == ["a", "b", "c", "b"]


def test_none_means_the_configured_model() -> None:
    loads = Loads()
    pool = pool_of(loads)
    assert pool.default == "a"
    assert pool.get() is pool.get("a") is pool.get(None)
    assert loads.ids == ["a"]


def test_a_pool_keeps_at_least_one_model() -> None:
    with pytest.raises(ValueError, match="max_models"):
        pool_of(Loads(), max_models=0)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_siglip(tmp_path_factory.mktemp("tiny-siglip-48"), seed=1, hidden_size=OTHER_SIZE)


def test_pool_embedders_embed_with_each_models_own_checkpoint(tiny_model_dir: Path, other_model_dir: Path) -> None:
    pool = ModelPool(ModelSettings(id=str(tiny_model_dir), device="cpu", max_batch_size=2))
    embedders = PoolEmbedders(pool)
    images = [np.full((64, 64, 3), v, np.uint8) for v in (0, 80, 160)]
    old = embedders.for_model(str(tiny_model_dir)).embed_images(images)
    new = embedders.for_model(str(other_model_dir)).embed_images(images)
    assert old.shape == (3, HIDDEN_SIZE) and new.shape == (3, OTHER_SIZE)
    np.testing.assert_allclose(np.linalg.norm(new, axis=1), 1.0, rtol=1e-5)
    assert pool.loaded == [str(tiny_model_dir), str(other_model_dir)]
    # Every model gets the pool's settings but its own id.
    assert pool.get(str(other_model_dir)).device == "cpu" and pool.get(str(other_model_dir)).dim == OTHER_SIZE


def test_the_encoder_requires_the_configured_model_only_when_the_index_answers_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import storage.tables
    from pipeline.embedding.encoders import answers_with
    from storage.config import S3Settings
    from storage.models import ModelState, ModelTable, table_name
    from storage.tables import IndexStore

    store = IndexStore(S3Settings(), uri=str(tmp_path / "lance"))
    monkeypatch.setattr(storage.tables, "IndexStore", lambda s3: store)
    assert answers_with(S3Settings(), "a")  # no model yet: the configured one becomes it
    active = ModelTable("a", 8, table_name("a", 8, "g1"))
    target = ModelTable("b", 12, table_name("b", 12, "g2"))
    assert store.models.write(ModelState(active=active, target=target), 0) is not None
    assert answers_with(S3Settings(), "a")
    assert not answers_with(S3Settings(), "b")  # a backfill's target: best effort
    assert answers_with(None, "b")

    def unreachable(s3: S3Settings) -> IndexStore:
        raise OSError("no route to the store")

    monkeypatch.setattr(storage.tables, "IndexStore", unreachable)
    assert answers_with(S3Settings(), "b")  # can't tell: the configured model must load


def test_the_encoders_read_of_the_active_model_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import storage.tables
    from pipeline.embedding.encoders import answers_with
    from storage.config import S3Settings

    release = threading.Event()

    def hanging(s3: S3Settings) -> Any:
        release.wait(10)  # a store that doesn't answer
        raise OSError("gone")

    monkeypatch.setattr(storage.tables, "IndexStore", hanging)
    began = time.monotonic()
    try:
        assert answers_with(S3Settings(), "b", timeout_s=0.2)  # can't tell in time: the configured model must load
        assert time.monotonic() - began < 5
    finally:
        release.set()
