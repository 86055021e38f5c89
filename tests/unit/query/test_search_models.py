"""pipeline/query/search.py with a model lifecycle: searches read the active model's table only, embed the
query with the active model, say which model answered, follow a switch; moments are merged with
each video's own sampling interval in the table searched."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

from pipeline.query.search import SearchResponse, SearchService
from pipeline.settings import Settings
from storage.catalog import VideoRecord, VideoStatus
from storage.frames import FRAMES, FrameRow, VideoFrames
from storage.models import ModelIndex, ModelTable, table_name
from storage.sampling import Sampling
from storage.tables import IndexStore

A = ModelTable("model-a", 8, table_name("model-a", 8, "g1"))
B = ModelTable("model-b", 12, table_name("model-b", 12, "g2"))
DIMS = {A.model: A.dim, B.model: B.dim}


def unit(dim: int, seed: int = 0) -> NDArray[np.float32]:
    v = np.random.default_rng(seed).random(dim).astype(np.float32) + 0.1
    return (v / np.linalg.norm(v)).astype(np.float32)


class ModelEncoder:
    """A query encoder that answers every query with one vector of the model's size; records the
    model ids it was asked for."""

    def __init__(self) -> None:
        self.models: list[str | None] = []

    async def embed_text(self, text: str, model_id: str | None = None) -> NDArray[np.float32]:
        self.models.append(model_id)
        assert model_id is not None, "the search must name the model"
        return unit(DIMS[model_id])

    async def embed_image(self, rgb: NDArray[np.uint8], model_id: str | None = None) -> NDArray[np.float32]:
        raise AssertionError("not an image search")


class Active:
    """A stand-in for LiveModels: the active model is whatever the test sets."""

    def __init__(self, table: ModelTable) -> None:
        self.table = table

    def active(self) -> ModelTable:
        return self.table


@pytest.fixture
def store(tmp_path: Path) -> IndexStore:
    return IndexStore(Settings().s3, uri=str(tmp_path / "lance"))


def add(
    store: IndexStore,
    vid: str,
    table: str,
    dim: int,
    times_s: list[float],
    entries: tuple[ModelIndex, ...] = (),
    catalog: bool = True,
) -> None:
    uri = f"s3://videos/{vid}.mp4"
    rows = [FrameRow(f"{vid}-{i:07d}", ts, unit(dim), None) for i, ts in enumerate(times_s)]
    store.frames_table(table).replace(VideoFrames(vid, uri, "e1", "fp", "m", rows))
    if catalog:
        seen = store.catalog.get(vid)
        record = VideoRecord(vid, uri, VideoStatus.INDEXED, version="e1", indexes=entries)
        assert store.catalog.write(record.evolve(rev=seen.rev) if seen else record, seen.rev if seen else 0)


def entry(table: ModelTable, every_s: float, frames: int = 2) -> ModelIndex:
    return ModelIndex(table.table, table.model, "fp", frames, Sampling(every_s))


def search(service: SearchService, q: str = "a dog", k: int = 10) -> SearchResponse:
    """One search on a loop of its own (the signing client is closed with it, reopened by the next)."""

    async def run() -> SearchResponse:
        try:
            return await service.search_text(q, k, "http://api")
        finally:
            await service.aclose()

    return asyncio.run(run())


def service(store: IndexStore, encoder: ModelEncoder, models: Active, every_s: float = 1.0) -> SearchService:
    settings = Settings.model_validate({"sampling": {"every_s": every_s}})
    return SearchService(settings, store, encoder, models=models)


def test_the_active_table_answers_with_the_active_model_and_a_switch_is_followed(store: IndexStore) -> None:
    add(store, "in-a", A.table, A.dim, [1.0], (entry(A, 1.0, 1),))
    add(store, "in-b", B.table, B.dim, [1.0], (entry(B, 1.0, 1),))
    # The legacy table holds vectors of A's size matching the query exactly: never to be read here.
    add(store, "in-frames", FRAMES, A.dim, [1.0], catalog=False)
    encoder, active = ModelEncoder(), Active(A)
    svc = service(store, encoder, active)

    first = search(svc)
    assert first.model == A.model and encoder.models == [A.model]
    assert [r.video_id for r in first.results] == ["in-a"]

    active.table = B  # the backfill switched
    second = search(svc)
    assert second.model == B.model and encoder.models == [A.model, B.model]
    assert [r.video_id for r in second.results] == ["in-b"]


def test_moments_merge_with_each_videos_own_sampling_interval(store: IndexStore) -> None:
    # Both videos match at 0 s and 5 s. The deployment samples every 3 s now (so neither video's own
    # interval is the setting): 5 s apart merges for a video sampled every 5 s, not for one every 1 s.
    add(store, "slow", A.table, A.dim, [0.0, 5.0], (entry(A, 5.0),))
    add(store, "fast", A.table, A.dim, [0.0, 5.0], (entry(A, 1.0),))
    svc = service(store, ModelEncoder(), Active(A), every_s=3.0)

    response = search(svc)

    spans = sorted((r.video_id, r.start_s, r.end_s) for r in response.results)
    assert spans == [("fast", 0.0, 1.0), ("fast", 5.0, 6.0), ("slow", 0.0, 10.0)]


def test_the_interval_comes_from_the_entry_of_the_table_searched(store: IndexStore) -> None:
    # One video indexed every 5 s into A and every 1 s into B (the setting changed with the model).
    entries = (entry(A, 5.0), entry(B, 1.0))
    add(store, "v", A.table, A.dim, [0.0, 5.0], entries)
    add(store, "v", B.table, B.dim, [0.0, 5.0], entries)
    active = Active(A)
    svc = service(store, ModelEncoder(), active, every_s=3.0)
    assert [(r.start_s, r.end_s) for r in search(svc).results] == [(0.0, 10.0)]
    active.table = B
    assert sorted((r.start_s, r.end_s) for r in search(svc).results) == [(0.0, 1.0), (5.0, 6.0)]


def test_a_video_without_an_entry_for_the_table_uses_the_setting(store: IndexStore) -> None:
    add(store, "legacy", A.table, A.dim, [0.0, 5.0], ())
    svc = service(store, ModelEncoder(), Active(A), every_s=4.0)
    assert [(r.start_s, r.end_s) for r in search(svc).results] == [(0.0, 9.0)]
