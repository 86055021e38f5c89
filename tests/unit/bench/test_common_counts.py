"""bench/common.py: which catalog commits are upkeep's (the version's Lance operation)."""

from __future__ import annotations

from pathlib import Path

from bench.common import upkeep_commits
from storage.catalog import VideoRecord, VideoStatus
from storage.config import S3Settings
from storage.tables import IndexStore


def test_upkeep_commits_are_the_versions_no_write_made(tmp_path: Path) -> None:
    store = IndexStore(S3Settings(), uri=str(tmp_path / "lance"))
    for i in range(3):
        assert store.catalog.write(VideoRecord(video_id=f"v{i}", uri="s3://b/k", status=VideoStatus.INDEXED), 0)
    first = store.catalog.version()
    row = store.catalog.get("v1")
    assert row is not None and store.catalog.write(row.evolve(status=VideoStatus.FAILED), row.rev)
    store.catalog.optimize(3600)
    last = store.catalog.version()
    # One compare-and-set write, and what the optimize committed (compaction, index upkeep).
    assert last - first >= 2 and upkeep_commits(store, first, last) == last - first - 1
