"""pipeline/index/plan.py on its own: what a job must do, from the row, the object's version, the live
tables and the sampling (no storage)."""

from __future__ import annotations

import pytest

from pipeline.index.plan import IndexPlan, Step, claims, count_crashes, fingerprints, plan_index, plan_removal
from pipeline.jobs.videostate import Attempt
from storage.catalog import VideoRecord, VideoStatus
from storage.ids import fingerprint
from storage.models import ModelIndex, ModelTable
from storage.sampling import Sampling

ACTIVE = ModelTable("model-a", 8, "frames-a")
TARGET = ModelTable("model-b", 12, "frames-b")
EVERY_1S = Sampling(1.0)


def entry(table: ModelTable, version: str = "e1", frames: int = 4, sampling: Sampling = EVERY_1S) -> ModelIndex:
    return ModelIndex(table.table, table.model, fingerprint(version, table.model, sampling), frames, sampling)


def row(status: VideoStatus, version: str | None = "e1", *entries: ModelIndex) -> VideoRecord:
    return VideoRecord("v1", "s3://videos/a.mp4", status, version=version, indexes=entries, rev=3)


def plan(
    seen: VideoRecord | None,
    version: str = "e1",
    live: tuple[ModelTable, ...] = (ACTIVE,),
    *,
    holding: frozenset[str] | None = None,
    settle: bool = False,
    sampling: Sampling = EVERY_1S,
) -> IndexPlan:
    """The plan when every claimed table's rows were looked at and hold (``holding``: only those)."""
    held = holding if holding is not None else frozenset(e.table for e in claims(seen, version, live, sampling))
    return plan_index(seen, version, live, sampling, holding=held, settle=settle)


def test_a_new_video_is_embedded_into_every_live_table_and_the_target_may_be_left_out() -> None:
    p = plan(None, live=(ACTIVE, TARGET))
    assert (p.step, p.kept, p.need) == (Step.EMBED, (), (ACTIVE, TARGET))
    assert not p.searchable
    assert p.optional == {TARGET.table}  # the active model's rows never wait on the target's
    assert p.fingerprints == fingerprints("e1", (ACTIVE, TARGET), EVERY_1S)


def test_the_same_version_held_in_every_live_table_is_left_alone() -> None:
    p = plan(row(VideoStatus.INDEXED, "e1", entry(ACTIVE)))
    assert (p.step, p.kept, p.need) == (Step.LEAVE, (entry(ACTIVE),), ())


def test_a_settling_job_confirms_even_an_indexed_row_so_a_queued_mark_in_flight_loses() -> None:
    assert plan(row(VideoStatus.INDEXED, "e1", entry(ACTIVE)), settle=True).step is Step.CONFIRM


@pytest.mark.parametrize("status", [VideoStatus.FAILED, VideoStatus.QUEUED, VideoStatus.INDEXING])
def test_rows_already_there_under_an_unsettled_row_are_confirmed(status: VideoStatus) -> None:
    assert plan(row(status, "e1", entry(ACTIVE))).step is Step.CONFIRM


def test_an_indexed_row_of_another_version_whose_entry_holds_this_content_is_confirmed() -> None:
    # Same fingerprint, so the same content: only the row's version is behind.
    assert plan(row(VideoStatus.INDEXED, "e0", entry(ACTIVE))).step is Step.CONFIRM


def test_an_entry_is_trusted_only_once_its_rows_were_looked_at() -> None:
    p = plan(row(VideoStatus.INDEXED, "e1", entry(ACTIVE)), holding=frozenset())
    assert (p.step, p.kept, p.need) == (Step.EMBED, (), (ACTIVE,))


def test_a_table_missing_from_the_row_is_backfilled_alone_and_the_video_stays_searchable() -> None:
    p = plan(row(VideoStatus.INDEXED, "e1", entry(ACTIVE)), live=(ACTIVE, TARGET))
    assert (p.step, p.kept, p.need) == (Step.EMBED, (entry(ACTIVE),), (TARGET,))
    assert p.searchable
    assert p.optional == frozenset()  # the target is all the job is for: its failure fails the job


def test_a_newer_version_is_embedded_again_into_every_live_table() -> None:
    p = plan(row(VideoStatus.INDEXED, "e1", entry(ACTIVE, "e1"), entry(TARGET, "e1")), "e2", (ACTIVE, TARGET))
    assert (p.step, p.kept, p.need) == (Step.EMBED, (), (ACTIVE, TARGET))
    assert p.fingerprints[ACTIVE.table] == fingerprint("e2", ACTIVE.model, EVERY_1S)


def test_another_sampling_is_embedded_again() -> None:
    p = plan(row(VideoStatus.INDEXED, "e1", entry(ACTIVE)), sampling=Sampling(2.0))
    assert (p.step, p.need) == (Step.EMBED, (ACTIVE,))


def test_the_entries_of_a_finished_job_follow_the_live_order_with_the_kept_ones() -> None:
    p = plan(row(VideoStatus.INDEXED, "e1", entry(TARGET)), live=(ACTIVE, TARGET))
    written = p.written({ACTIVE.table: 4})
    assert written == (entry(ACTIVE),)
    assert p.indexes(written) == (entry(ACTIVE), entry(TARGET))


def test_the_models_moved_when_a_table_came_live_unheld_or_the_active_one_is_not_held() -> None:
    p = plan(None, live=(ACTIVE,))
    assert not p.models_moved((ACTIVE,), {ACTIVE.table})
    assert p.models_moved((ACTIVE, TARGET), {ACTIVE.table})  # a backfill began meanwhile
    assert p.models_moved((TARGET, ACTIVE), {ACTIVE.table})  # a switch made another table active


def test_a_twin_finished_only_when_the_row_is_indexed_with_these_fingerprints() -> None:
    written = (entry(ACTIVE),)
    assert IndexPlan.twin_finished(row(VideoStatus.INDEXED, "e1", entry(ACTIVE)), written)
    assert not IndexPlan.twin_finished(row(VideoStatus.INDEXING, "e1", entry(ACTIVE)), written)
    assert not IndexPlan.twin_finished(row(VideoStatus.INDEXED, "e0", entry(ACTIVE, "e0")), written)
    assert not IndexPlan.twin_finished(None, written)


def test_no_live_table_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one table"):
        plan(None, live=())


@pytest.mark.parametrize(
    ("seen", "rows", "settle", "step"),
    [
        (None, 0, False, Step.LEAVE),
        (None, 0, True, Step.SETTLE_REMOVED),
        (row(VideoStatus.DELETED), 0, False, Step.LEAVE),
        (row(VideoStatus.DELETED), 0, True, Step.SETTLE_REMOVED),
        (row(VideoStatus.DELETED), 3, False, Step.REMOVE),  # rows a racing job wrote
        (row(VideoStatus.INDEXED), 0, False, Step.REMOVE),  # the row must say deleted
        (row(VideoStatus.FAILED), 4, True, Step.REMOVE),
        (None, 2, False, Step.REMOVE),
    ],
)
def test_a_deleted_object_removes_rows_or_settles_the_row(
    seen: VideoRecord | None, rows: int, settle: bool, step: Step
) -> None:
    assert plan_removal(seen, rows, settle=settle) is step


def test_a_start_is_a_crash_only_when_this_tasks_claim_was_left_by_a_dead_process() -> None:
    claimed = VideoRecord("v1", "u", VideoStatus.INDEXING, task_id="t1", holder="proc:old", crashes=1)
    attempt = Attempt("t1", "proc:me")
    assert count_crashes(claimed, attempt, "proc:me", lambda h: False) == 2
    assert count_crashes(claimed, attempt, "proc:me", lambda h: True) == 1
    assert count_crashes(claimed.evolve(holder="proc:me"), attempt, "proc:me", lambda h: False) == 1
    assert count_crashes(claimed, Attempt("t2", "proc:me"), "proc:me", lambda h: False) == 0
    assert count_crashes(claimed.evolve(status=VideoStatus.FAILED), attempt, "proc:me", lambda h: False) == 1
    assert count_crashes(None, attempt, "proc:me", lambda h: False) == 0
