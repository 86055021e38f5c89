"""storage/catalog.py ``get_many``: the rows of many videos in one query (search reads their durations)."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.catalog import VideoRecord, VideoStatus
from storage.config import S3Settings
from storage.tables import IndexStore


@pytest.fixture
def store(tmp_path: Path) -> IndexStore:
    return IndexStore(S3Settings(), uri=str(tmp_path / "lance"))


def test_get_many_returns_the_rows_that_exist_by_id(store: IndexStore) -> None:
    # More ids than a LanceDB query returns by default (10), and one with a quote in it.
    ids = [f"v{i:02d}" for i in range(25)] + ["v'quote"]
    for i, video_id in enumerate(ids):
        record = VideoRecord(video_id=video_id, uri=f"s3://b/{i}.mp4", status=VideoStatus.INDEXED, duration_s=i + 0.5)
        assert store.catalog.write(record, 0) is not None

    found = store.catalog.get_many([*ids, "missing", ids[0]])

    assert sorted(found) == sorted(ids)
    assert found["v07"].duration_s == 7.5 and found["v'quote"].uri == "s3://b/25.mp4"
    assert found["v07"] == store.catalog.get("v07")


def test_get_many_of_nothing_is_empty(store: IndexStore) -> None:
    assert store.catalog.get_many([]) == {}
    assert store.catalog.get_many(iter(["missing"])) == {}
