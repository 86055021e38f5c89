"""A backfill's own jobs against its coordinator, over a real local LanceDB: a backfill job still
running (paused at a step boundary on a thread) holds the switch while a round runs on another
thread, for a bounded time; a backfill job on a consumer whose cached lifecycle predates the
backfill still adds the new model's rows; and a job that finds every live table already holding
the video puts the row's own count back from the active table's entry."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from events.jobs import IndexJob, JobOp, JobSource
from pipeline.index.indexer import Outcome
from pipeline.upkeep.backfill import BackfillCoordinator, BackfillRound
from storage.catalog import VideoStatus
from storage.tables import IndexStore
from tests.media import write_video
from tests.unit.index.test_indexer import MemoryObjects
from tests.unit.index.test_indexer_models import A as WA
from tests.unit.index.test_indexer_models import B as WB
from tests.unit.index.test_indexer_models import World
from tests.unit.upkeep.test_backfill import (
    HOUR,
    WAIT_S,
    A,
    B,
    Clock,
    PauseAt,
    Recorded,
    backfilling,
    coordinator,
    indexer,
    on_thread,
    put,
    store,  # noqa: F401  (the fixture)
)


@pytest.mark.parametrize("claim_after_s", [0.0, 60.0], ids=["claimed", "not-yet-claimed"])
def test_a_running_backfill_job_holds_the_switch_until_it_settles(
    store: IndexStore,  # noqa: F811
    tmp_path: Path,
    claim_after_s: float,
) -> None:
    """Claimed, the running job's row holds the switch (in flight after live_from); not claimed yet (a job
    shorter than ``claim_after_s``), the row still lacks B and the round counts it as needing B."""
    objects = MemoryObjects()
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=2, seed=1))
    backfilling(store, live_from=datetime.now(UTC) - HOUR)
    # Indexed with A only (as before the backfill), then its backfill job runs, long after live_from.
    upload = IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.EVENT)
    assert indexer(store, objects, lambda: [A]).run(upload).outcome is Outcome.INDEXED
    pause = PauseAt("write")
    job = IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.REINDEX)
    finished = on_thread(lambda: indexer(store, objects, lambda: [A, B], pause, claim_after_s=claim_after_s).run(job))
    assert pause.reached.wait(WAIT_S)
    running = store.catalog.get(job.video_id)
    claimed = claim_after_s == 0
    assert running is not None
    assert running.status is (VideoStatus.INDEXING if claimed else VideoStatus.INDEXED)

    # A round while it embeds: switching now would leave the video without rows in the answering table.
    sink = Recorded()
    backfill = coordinator(store, sink, Clock())
    held: BackfillRound = on_thread(backfill.round)()
    assert (held.holding, held.need) == ((1, 0) if claimed else (0, 1)) and not held.switched
    assert sink.keys() == ([] if claimed else ["a.mp4"])  # not claimed: its backfill job, again (harmless)
    assert store.models.read().active == A

    pause.release.set()
    assert finished().outcome is Outcome.INDEXED
    switched = backfill.round()
    assert switched is not None and switched.switched and store.models.read().active == B
    assert store.frames_table(B.table).count(job.video_id) == store.frames_table(A.table).count(job.video_id) == 2


def test_a_backfill_job_on_a_lifecycle_cached_before_the_backfill_adds_the_new_models_rows(tmp_path: Path) -> None:
    world = World(tmp_path)
    world.upload()
    world.live = [WA]
    upload = IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.EVENT)
    assert world.indexer().run(upload).outcome is Outcome.INDEXED
    # The backfill to B begins; this consumer's cached lifecycle (read just before) still says A only.
    world.live = [WA, WB]
    job = IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.REINDEX)
    result = world.indexer(cached=[WA]).run(job)
    record = world.store.catalog.get(job.video_id)
    assert result.outcome is Outcome.INDEXED and record is not None
    assert record.index_in(WB.table) is not None and world.store.frames_table(WB.table).count(job.video_id) == 3
    # An upload's job may go by its cache: the backfill comes back for what it leaves out.
    again = IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.EVENT)
    assert world.indexer(cached=[WA]).run(again).outcome is Outcome.UNCHANGED


def test_a_carried_video_holds_the_switch_only_for_the_resubmit_interval(store: IndexStore) -> None:  # noqa: F811
    """A row left in flight by a job that is gone (its failure never recorded), found by the active
    model: it holds the switch, saying so, then needs a job of its own."""
    backfilling(store, live_from=datetime.now(UTC) - HOUR)
    put(store, "a.mp4", VideoStatus.INDEXING)  # A's entry at its version, not B's
    sink = Recorded()
    backfill = BackfillCoordinator(
        store, sink, interval_s=1.0, max_outstanding=10, resubmit_after_s=1.0, lease_ttl_s=30.0, clock=Clock()
    )
    held = backfill.round()
    assert held is not None and (held.holding, held.need) == (1, 0) and not held.switched and sink.jobs == []
    assert held.waiting_for is not None and "still running" in held.waiting_for
    time.sleep(1.2)
    needed = backfill.round()
    assert needed is not None and (needed.holding, needed.need, needed.submitted) == (0, 1, 1)
    assert sink.keys() == ["a.mp4"] and sink.jobs[0].source is JobSource.REINDEX and not needed.switched


def test_a_job_that_finds_every_live_table_holding_the_video_restores_the_rows_count(tmp_path: Path) -> None:
    """A backfill job whose write failed left the row unsettled (-1 rows, its target entry gone), and
    the backfill was aborted: its retry finds only A live, with A's rows in place, and settles the
    row with A's count, not the -1."""
    world = World(tmp_path)
    world.upload()
    world.live = [WA]
    assert (
        world.indexer().run(IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.EVENT)).frames == 3
    )
    vid = IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.REINDEX).video_id
    indexed = world.store.catalog.get(vid)
    assert indexed is not None and indexed.frames == 3
    unsettled = indexed.evolve(
        status=VideoStatus.INDEXING, frames=-1, fingerprint=None, error="a job left its rows unsettled"
    )
    assert world.store.catalog.write(unsettled, indexed.rev) is not None
    retry = IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.REINDEX)
    result = world.indexer().run(retry)
    record = world.store.catalog.get(vid)
    assert result.outcome is Outcome.UNCHANGED and result.frames == 3 and record is not None
    assert record.status is VideoStatus.INDEXED and record.error is None
    assert (record.frames, record.fingerprint) == (3, indexed.fingerprint)
