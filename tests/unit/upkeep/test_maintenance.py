"""pipeline/upkeep/maintenance.py over a local LanceDB: the ANN index appears past the row threshold, once;
optimize folds appended rows in; search finds a just-written frame before and after; the catalog is
compacted every round; one worker maintains."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

from pipeline.upkeep.maintenance import Action, IndexMaintainer, create_vector_index, optimize, vector_index_state
from storage.catalog import VIDEOS, VideoRecord, VideoStatus
from storage.config import IndexSettings, S3Settings
from storage.frames import FrameRow, VideoFrames
from storage.ids import segment_id
from storage.tables import IndexStore
from storage.texts import TextRow, VideoText

DIM = 16
SETTINGS = IndexSettings(ann_min_rows=400, rows_per_partition=256, nprobes=4, refine_factor=5, search_consistency_s=0)


def unit(vectors: NDArray[np.floating]) -> NDArray[np.float32]:
    out: NDArray[np.float32] = (vectors / np.linalg.norm(vectors, axis=-1, keepdims=True)).astype(np.float32)
    return out


def add_video(store: IndexStore, video_id: str, vectors: NDArray[np.float32]) -> None:
    rows = [
        FrameRow(frame_id=f"{video_id}-{i}", ts_s=float(i), vector=v, thumbnail=None) for i, v in enumerate(vectors)
    ]
    store.frames.replace(VideoFrames(video_id, f"s3://videos/{video_id}.mp4", "1", "fp-1", "m", rows))


def fill(store: IndexStore, videos: int, frames: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for n in range(videos):
        centre = rng.standard_normal(DIM)
        add_video(store, f"s{seed}v{n}", unit(centre + 0.3 * rng.standard_normal((frames, DIM))).astype(np.float32))


@pytest.fixture
def store(tmp_path: Path) -> IndexStore:
    return IndexStore(S3Settings(), uri=str(tmp_path / "lance"))


def probe() -> NDArray[np.float32]:
    vector = np.zeros(DIM, dtype=np.float32)
    vector[3] = 1.0  # far from the random frames' directions in no particular way, but exactly itself
    return vector


def assert_found(store: IndexStore, frame_id: str) -> None:
    for rows in (store.frames.search(probe(), 5, SETTINGS), store.frames.search(probe(), 5)):
        assert rows[0]["frame_id"] == frame_id
        assert rows[0]["_distance"] == pytest.approx(0.0, abs=1e-3)


def test_below_the_threshold_no_index_and_search_is_exact(store: IndexStore) -> None:
    maintainer = IndexMaintainer(store, SETTINGS)
    assert maintainer.run_once().action is Action.NO_TABLE
    fill(store, videos=3, frames=100, seed=1)
    add_video(store, "needle", probe()[None, :])
    result = maintainer.run_once()
    assert result.action is Action.FLAT and result.rows == 301
    state = vector_index_state(store)
    assert state is not None and not state.has_index
    assert_found(store, "needle-0")
    # Exact results equal to the brute-force order.
    exact = [r["frame_id"] for r in store.frames.search(probe(), 10, exact=True)]
    assert [r["frame_id"] for r in store.frames.search(probe(), 10, SETTINGS)] == exact


def test_past_the_threshold_the_index_is_created_once_and_optimize_folds_new_rows_in(store: IndexStore) -> None:
    maintainer = IndexMaintainer(store, SETTINGS)
    fill(store, videos=6, frames=100, seed=2)
    created = maintainer.run_once()
    assert created.action is Action.INDEX_CREATED and created.rows == 600
    state = vector_index_state(store)
    assert state is not None and state.has_index and state.indexed_rows == 600 and state.unindexed_rows == 0
    assert maintainer.run_once().action is Action.UP_TO_DATE  # not rebuilt

    # Appended rows are not in the index yet, and search still finds them (flat scan of the tail).
    add_video(store, "needle", probe()[None, :])
    fill(store, videos=1, frames=50, seed=3)
    state = vector_index_state(store)
    assert state is not None and state.unindexed_rows == 51
    assert_found(store, "needle-0")

    optimized = maintainer.run_once()
    assert optimized.action is Action.OPTIMIZED and optimized.unindexed_rows == 51
    state = vector_index_state(store)
    assert state is not None and state.rows == 651 and state.indexed_rows == 651 and state.unindexed_rows == 0
    assert_found(store, "needle-0")
    assert maintainer.run_once().action is Action.UP_TO_DATE

    # Grown past rebuild_growth times the rows it was built on: partitions are retrained.
    fill(store, videos=18, frames=100, seed=8)
    rebuilt = maintainer.run_once()
    assert rebuilt.action is Action.INDEX_REBUILT and rebuilt.rows == 2451
    assert_found(store, "needle-0")


def test_ann_results_agree_with_exact_search(store: IndexStore) -> None:
    fill(store, videos=8, frames=100, seed=4)
    IndexMaintainer(store, SETTINGS).run_once()
    rng = np.random.default_rng(5)
    hits = 0
    for query in unit(rng.standard_normal((20, DIM))).astype(np.float32):
        exact = {r["frame_id"] for r in store.frames.search(query, 10, exact=True)}
        hits += len(exact & {r["frame_id"] for r in store.frames.search(query, 10, SETTINGS)})
    assert hits / 200 >= 0.9


def catalog_fragments(store: IndexStore) -> int:
    table = store.db.open(VIDEOS)
    assert table is not None
    return int(table.stats()["fragment_stats"]["num_fragments"])


def test_the_index_functions_do_nothing_before_the_frames_table_exists(store: IndexStore) -> None:
    assert vector_index_state(store) is None
    create_vector_index(store, SETTINGS)
    for n in range(3):
        assert store.catalog.write(VideoRecord(video_id=f"v{n}", uri="s3://videos/v", status=VideoStatus.QUEUED), 0)
    optimize(store, SETTINGS.keep_versions_s)  # the catalog is still compacted
    assert store.frames.table() is None and catalog_fragments(store) == 1


def test_a_round_with_no_new_frames_still_compacts_the_catalog(store: IndexStore) -> None:
    maintainer = IndexMaintainer(store, SETTINGS)
    fill(store, videos=5, frames=100, seed=9)
    assert maintainer.run_once().action is Action.INDEX_CREATED
    # Status changes keep committing to the catalog (one small fragment each) while frames stand still.
    for n in range(4):
        assert store.catalog.write(VideoRecord(video_id=f"v{n}", uri="s3://videos/v", status=VideoStatus.DELETED), 0)
    assert catalog_fragments(store) == 4
    assert maintainer.run_once().action is Action.UP_TO_DATE
    assert catalog_fragments(store) == 1


def test_only_one_worker_maintains_until_its_lease_lapses(store: IndexStore, tmp_path: Path) -> None:
    now = [1000.0]
    other_store = IndexStore(S3Settings(), uri=str(tmp_path / "lance"))
    first = IndexMaintainer(store, SETTINGS, holder="a", clock=lambda: now[0])
    second = IndexMaintainer(other_store, SETTINGS, holder="b", clock=lambda: now[0])
    fill(store, videos=5, frames=100, seed=6)
    assert first.run_once().action is Action.INDEX_CREATED
    assert second.run_once().action is Action.SKIPPED_NOT_LEADER
    now[0] += SETTINGS.lease_ttl_s / 2
    fill(store, videos=1, frames=10, seed=7)
    assert second.run_once().action is Action.SKIPPED_NOT_LEADER
    assert first.run_once().action is Action.OPTIMIZED  # the holder renews
    now[0] += SETTINGS.lease_ttl_s + 1  # the holder stopped (its replica died): the lease lapses
    assert second.run_once().action is Action.UP_TO_DATE
    assert first.run_once().action is Action.SKIPPED_NOT_LEADER


def test_the_loop_stops_and_survives_a_failing_round(store: IndexStore) -> None:
    calls = []

    class Failing(IndexMaintainer):
        def run_once(self):  # type: ignore[no-untyped-def]
            calls.append(1)
            raise OSError("store unreachable")

    maintainer = Failing(store, SETTINGS.model_copy(update={"optimize_interval_s": 0.01}))
    thread, stop = maintainer.service.start()
    while len(calls) < 3:
        thread.join(0.01)
    stop.set()
    thread.join(5)
    assert not thread.is_alive()


def test_compaction_merges_the_small_fragments_each_commit_left(store: IndexStore) -> None:
    fill(store, videos=12, frames=3, seed=5)  # one commit (one fragment) per video
    for i in range(6):
        store.catalog.write(VideoRecord(video_id=f"c{i}", uri=f"s3://b/c{i}.mp4", status=VideoStatus.INDEXED), 0)
    frames, videos = store.frames.table(), store.db.open(VIDEOS)
    assert frames is not None and videos is not None
    assert len(frames.to_lance().get_fragments()) >= 12 and len(videos.to_lance().get_fragments()) >= 6
    before = [r["frame_id"] for r in store.frames.search(probe(), 5, SETTINGS)]
    update = {"compact_target_rows": 1024, "catalog_compact_fragments": 6}
    maintainer = IndexMaintainer(store, SETTINGS.model_copy(update=update))
    assert maintainer.compact_once()
    assert len(store.frames.table().to_lance().get_fragments()) == 1  # type: ignore[union-attr]
    assert len(store.db.open(VIDEOS).to_lance().get_fragments()) == 1  # type: ignore[union-attr]
    assert store.frames.count() == 36 and store.catalog.get("c3") is not None
    assert [r["frame_id"] for r in store.frames.search(probe(), 5, SETTINGS)] == before


def test_a_quiet_catalog_gains_no_versions_from_upkeep(store: IndexStore) -> None:
    """Compaction ticks leave a catalog with fewer than ``catalog_compact_fragments`` fragments alone, and
    a full round one with nothing written since it was compacted (Lance's optimize commits versions even
    with nothing to merge); at the threshold a tick compacts it. (A full round with writes since still
    compacts: test_a_round_with_no_new_frames_still_compacts_the_catalog.)"""
    maintainer = IndexMaintainer(store, SETTINGS.model_copy(update={"catalog_compact_fragments": 4}))
    fill(store, videos=5, frames=100, seed=3)

    def write(name: str) -> None:
        assert store.catalog.write(VideoRecord(video_id=name, uri="s3://videos/q", status=VideoStatus.INDEXED), 0)

    def version() -> int:
        videos = store.db.open(VIDEOS)
        assert videos is not None
        return int(videos.to_lance().version)

    write("q0")
    assert maintainer.run_once().action is Action.INDEX_CREATED  # and the catalog's scalar index
    assert maintainer.run_once().action is Action.UP_TO_DATE
    quiet = version()
    assert maintainer.run_once().action is Action.UP_TO_DATE and maintainer.compact_once()
    assert version() == quiet  # nothing written since it was compacted: no versions
    while catalog_fragments(store) < 3:
        write(f"q{version()}")
    written = version()
    for _ in range(3):
        assert maintainer.compact_once()
    assert version() == written  # below the threshold (4 fragments)
    write("q-last")
    assert maintainer.compact_once() and catalog_fragments(store) < 4
    compacted = version()
    assert compacted > written + 1
    assert maintainer.run_once().action is Action.UP_TO_DATE
    assert version() == compacted


def _words(video_id: str, *lines: str) -> VideoText:
    rows = [TextRow(segment_id(video_id, n), float(n), n + 1.0, line, "subtitle", 1.0) for n, line in enumerate(lines)]
    return VideoText(video_id, f"s3://videos/{video_id}.mp4", "e1", "fp", "subtitles", rows)


def test_a_round_keeps_the_text_tables_full_text_index_and_folds_new_words_in(store: IndexStore) -> None:
    text = store.text_table("text-abc-g1")
    maintainer = IndexMaintainer(store, SETTINGS, text_tables=lambda: [text.name])
    maintainer.run_once()  # no table yet: nothing to do
    assert text.table() is None
    text.replace_many([_words("v1", "a red boat leaves the harbour")])
    assert text.unindexed_rows() == 0  # the first write built the index
    # Words written after the index are searched by a scan until a round folds them in
    text.replace_many([_words("v2", "the lighthouse keeper lives alone", "a red kite")])
    assert text.unindexed_rows() == 2
    maintainer.run_once()
    assert text.unindexed_rows() == 0
    # And at a compaction tick too (every compact_interval_s, between full rounds)
    text.replace_many([_words("v3", "a red lantern")])
    assert text.unindexed_rows() == 1
    assert maintainer.compact_once() and text.unindexed_rows() == 0
    assert {h.video_id for h in text.search("red", 10)} == {"v1", "v2", "v3"}
    assert [h.text for h in text.search("lighthouse keeper", 10, phrase=True)] == ["the lighthouse keeper lives alone"]
