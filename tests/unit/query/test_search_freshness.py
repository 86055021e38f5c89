"""A search with the default settings sees every frame committed before it began, while other
searches share its manifest checks on other threads (``search_consistency_s`` 0, storage/frames.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

from storage.config import IndexSettings, S3Settings
from storage.frames import FrameRow, VideoFrames
from storage.tables import IndexStore

DIM = 16


def direction(n: int) -> NDArray[np.float32]:
    vector = np.zeros(DIM, dtype=np.float32)
    vector[n] = 1.0
    return vector


def write_needle(store: IndexStore, n: int) -> None:
    row = FrameRow(frame_id=f"needle{n}-0", ts_s=0.0, vector=direction(n), thumbnail=None)
    store.frames.replace(VideoFrames(f"needle{n}", f"s3://videos/needle{n}.mp4", "1", "fp", "m", [row]))


@pytest.fixture
def stores(tmp_path: Path) -> tuple[IndexStore, IndexStore]:
    """A writer and a searcher, each on connections of its own (two processes in the app)."""
    uri = str(tmp_path / "lance")
    return IndexStore(S3Settings(), uri=uri), IndexStore(S3Settings(), uri=uri)


def test_a_search_before_the_table_exists_finds_nothing_and_the_next_after_a_write_finds_it(
    stores: tuple[IndexStore, IndexStore],
) -> None:
    writer, searcher = stores
    assert searcher.frames.search(direction(0), 5, IndexSettings()) == []
    write_needle(writer, 0)
    assert searcher.frames.search(direction(0), 1, IndexSettings())[0]["frame_id"] == "needle0-0"


def test_a_search_sees_every_commit_finished_before_it_began_while_others_search(
    stores: tuple[IndexStore, IndexStore],
) -> None:
    writer, searcher = stores
    settings = IndexSettings()
    assert settings.search_consistency_s == 0  # the default is read-your-writes
    write_needle(writer, 0)
    assert searcher.frames.search(direction(0), 1, settings)[0]["frame_id"] == "needle0-0"  # the handle is warm
    stop = threading.Event()
    errors: list[BaseException] = []

    def others() -> None:  # searches in flight all the time: checks begun before a write ended
        try:
            for _ in range(10_000):
                if stop.is_set():
                    return
                searcher.frames.search(direction(0), 1, settings)
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=others) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        for n in range(1, 9):
            write_needle(writer, n)
            top = searcher.frames.search(direction(n), 1, settings)
            assert top[0]["frame_id"] == f"needle{n}-0", f"the search after write {n} missed it"
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert not errors, errors
