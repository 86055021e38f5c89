"""storage/frames.py over a local LanceDB: one commit replaces whole videos and leaves the others alone,
rows carry their index result's fingerprint, summaries count what the table holds (repeats included),
and a write that would be ambiguous is refused before it reaches the table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from storage.config import S3Settings
from storage.db import sql_quote
from storage.errors import TransientError
from storage.frames import FrameRow, FrameSummary, VideoFrames, frames_schema
from storage.tables import IndexStore

DIM = 8


def rows(video_id: str, n: int, *, seed: int, dim: int = DIM) -> list[FrameRow]:
    vectors = np.random.default_rng(seed).normal(size=(n, dim)).astype(np.float32)
    return [FrameRow(f"{video_id}-{i:06d}", float(i), vectors[i], b"jpg" + bytes([seed % 256])) for i in range(n)]


def frames(video_id: str, n: int, *, seed: int, version: str = "v1", dim: int = DIM) -> VideoFrames:
    return VideoFrames(
        video_id=video_id,
        uri=f"s3://videos/{video_id}",
        version=version,
        fingerprint=f"fp-{version}",
        model="m",
        rows=rows(video_id, n, seed=seed, dim=dim),
    )


def column(store: IndexStore, video_id: str, name: str) -> list[object]:
    table = store.frames.table()
    assert table is not None
    got = table.search().where(f"video_id = {sql_quote(video_id)}").select([name]).limit(None).to_list()
    return sorted(r[name] for r in got)


def add_raw(store: IndexStore, video_id: str, frame_ids: list[str], fingerprint: str) -> None:
    """Rows appended as they are, past ``replace``'s checks: repeats as a lost race would leave them."""
    table = store.frames.table()
    assert table is not None
    vector = np.zeros(DIM, dtype=np.float32).tolist()
    data = [
        {
            "frame_id": fid,
            "video_id": video_id,
            "uri": f"s3://videos/{video_id}",
            "version": "v?",
            "fingerprint": fingerprint,
            "ts_s": 0.0,
            "vector": vector,
            "thumbnail": None,
            "model": "m",
        }
        for fid in frame_ids
    ]
    table.add(pa.Table.from_pylist(data, schema=frames_schema(DIM)))


@pytest.fixture
def store(tmp_path: Path) -> IndexStore:
    return IndexStore(S3Settings(), uri=str(tmp_path / "lance"))


# -- writes -------------------------------------------------------------------------------------------


def test_rows_carry_their_videos_fingerprint_and_origin(store: IndexStore) -> None:
    store.frames.replace(frames("a", 3, seed=1, version="e1"))
    store.frames.replace(frames("b", 2, seed=2, version="e2"))
    assert column(store, "a", "fingerprint") == ["fp-e1"] * 3 and column(store, "b", "fingerprint") == ["fp-e2"] * 2
    assert column(store, "a", "version") == ["e1"] * 3
    assert column(store, "a", "uri") == ["s3://videos/a"] * 3 and column(store, "a", "model") == ["m"] * 3
    assert column(store, "a", "ts_s") == [0.0, 1.0, 2.0]


def test_grouped_write_replaces_each_video_and_leaves_others(store: IndexStore) -> None:
    store.frames.replace_many([frames("a", 5, seed=1), frames("b", 4, seed=2), frames("c", 3, seed=3)])
    store.frames.replace_many(
        [frames("a", 2, seed=4, version="v2"), VideoFrames("b", "s3://videos/b", "v2", "fp-v2", "m", [])]
    )
    assert column(store, "a", "frame_id") == ["a-000000", "a-000001"]
    assert column(store, "a", "fingerprint") == ["fp-v2"] * 2
    assert column(store, "b", "frame_id") == []
    assert len(column(store, "c", "frame_id")) == 3 and set(column(store, "c", "version")) == {"v1"}


def test_quotes_in_video_ids_stay_scoped(store: IndexStore) -> None:
    store.frames.replace_many([frames("o'k", 3, seed=1), frames("x", 2, seed=2)])
    store.frames.replace_many([frames("o'k", 1, seed=3, version="v2")])
    assert column(store, "o'k", "frame_id") == ["o'k-000000"]
    assert len(column(store, "x", "frame_id")) == 2


def test_a_video_twice_in_one_write_is_refused(store: IndexStore) -> None:
    with pytest.raises(ValueError, match="twice"):
        store.frames.replace_many([frames("a", 1, seed=5), frames("a", 1, seed=6)])
    assert store.frames.table() is None  # refused before anything was written


def test_replace_many_rejects_duplicate_frame_ids_in_one_write(store: IndexStore) -> None:
    store.frames.replace(frames("a", 2, seed=1))
    # Within one video, and across two videos of one grouped write (a merge on frame_id would be ambiguous).
    twice = frames("a", 2, seed=2, version="v2")
    repeated = VideoFrames("a", twice.uri, "v2", "fp-v2", "m", [twice.rows[0], twice.rows[0]])
    with pytest.raises(ValueError, match="share a frame_id"):
        store.frames.replace_many([repeated])
    stolen = VideoFrames("b", "s3://videos/b", "v1", "fp-v1", "m", [twice.rows[1]])
    with pytest.raises(ValueError, match="share a frame_id"):
        store.frames.replace_many([twice, stolen])
    assert column(store, "a", "fingerprint") == ["fp-v1"] * 2 and store.frames.count() == 2


def test_vectors_of_different_sizes_in_one_write_are_refused(store: IndexStore) -> None:
    with pytest.raises(ValueError, match="different sizes"):
        store.frames.replace_many([frames("a", 1, seed=1), frames("b", 1, seed=2, dim=DIM + 1)])
    assert store.frames.table() is None


def test_removing_rows_before_the_table_exists_creates_nothing(store: IndexStore) -> None:
    store.frames.replace(VideoFrames("a", "s3://videos/a", "", "", "", []))
    store.frames.delete("a")
    assert store.frames.table() is None and store.frames.count() == 0 and store.frames.count("a") == 0


def test_delete_and_count_are_scoped_to_one_video(store: IndexStore) -> None:
    store.frames.replace_many([frames("a", 3, seed=1), frames("b", 2, seed=2)])
    assert store.frames.count() == 5 and store.frames.count("a") == 3
    store.frames.delete("a")
    assert store.frames.count("a") == 0 and store.frames.count("b") == 2


def test_thumbnail_by_frame_id(store: IndexStore) -> None:
    store.frames.replace(frames("a", 2, seed=7))
    assert store.frames.thumbnail("a-000001") == b"jpg\x07"
    assert store.frames.thumbnail("nope") is None


def test_a_failed_commit_is_transient(store: IndexStore, monkeypatch: pytest.MonkeyPatch) -> None:
    store.frames.replace(frames("a", 1, seed=1))
    table = store.frames.table()

    def gone(*_: object) -> None:
        raise OSError("object store went away")

    monkeypatch.setattr(table, "merge_insert", gone)
    with pytest.raises(TransientError, match=r"^index table write failed: object store went away$"):
        store.frames.replace(frames("a", 2, seed=2, version="v2"))


# -- summaries ----------------------------------------------------------------------------------------


def test_summary_counts_rows_fingerprints_and_duplicate_frame_ids(store: IndexStore) -> None:
    assert store.frames.summary("a").rows == 0  # no table yet
    store.frames.replace_many([frames("a", 3, seed=1), frames("b", 2, seed=2)])
    clean = store.frames.summary("a")
    assert (clean.rows, dict(clean.fingerprints), clean.duplicate_ids) == (3, {"fp-v1": 3}, 0)
    # A stale writer's rows next to them: one repeats a frame id, one is new.
    add_raw(store, "a", ["a-000001", "a-000099"], "fp-old")
    mixed = store.frames.summary("a")
    assert (mixed.rows, dict(mixed.fingerprints), mixed.duplicate_ids) == (5, {"fp-v1": 3, "fp-old": 2}, 1)
    other = store.frames.summary("b")
    assert (other.rows, dict(other.fingerprints), other.duplicate_ids) == (2, {"fp-v1": 2}, 0)
    assert store.frames.summary("nothing").rows == 0


def test_summaries_count_every_video_across_batches(store: IndexStore) -> None:
    assert list(store.frames.summaries()) == []  # no table yet
    store.frames.replace_many([frames("a", 3, seed=1), frames("b", 2, seed=2, version="v2")])
    add_raw(store, "a", ["a-000000", "a-000000"], "fp-old")  # the same id twice more
    add_raw(store, "c", ["c-000000"], "fp-c")
    # Batches of two rows: a video's rows are spread over several batches.
    got: dict[str, FrameSummary] = dict(store.frames.summaries(batch_rows=2))
    counted = {vid: (s.rows, dict(s.fingerprints), s.duplicate_ids) for vid, s in got.items()}
    assert counted == {
        "a": (5, {"fp-v1": 3, "fp-old": 2}, 2),
        "b": (2, {"fp-v2": 2}, 0),
        "c": (1, {"fp-c": 1}, 0),
    }
    for vid, summary in got.items():
        single = store.frames.summary(vid)
        assert (single.rows, single.fingerprints, single.duplicate_ids) == (
            summary.rows,
            summary.fingerprints,
            summary.duplicate_ids,
        )
