"""storage/tables.py: write failures that retrying can fix become TransientError."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.settings import Settings
from storage.catalog import VideoRecord, VideoStatus
from storage.errors import TransientError
from storage.tables import IndexStore


def test_a_commit_conflict_is_transient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = IndexStore(Settings().s3, uri=str(tmp_path / "lance"))
    table = store._videos_table()

    class ConflictingMerge:
        def __getattr__(self, _: str) -> object:
            return lambda *args, **kwargs: self

        def execute(self, *_: object) -> None:
            raise RuntimeError("lance error: Too many concurrent writers\ncaused by: retry_timeout of 30.000")

    monkeypatch.setattr(table, "merge_insert", lambda *_: ConflictingMerge())
    with pytest.raises(TransientError, match=r"^index table write failed: lance error: Too many concurrent writers$"):
        store.put_video(VideoRecord(video_id="v1", uri="s3://videos/a.mp4", status=VideoStatus.QUEUED))
