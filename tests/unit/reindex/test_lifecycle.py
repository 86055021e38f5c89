"""pipeline/reindex/lifecycle.py over a real local LanceDB: the start-up check of the configured model (first
model, legacy ``frames`` adopted or refused, another model refused or backfilled, dimension changes
refused), ``vidx reindex`` start/abort/cleanup (racing starts included), LiveModels' cache and its
fallback on a failed re-read (a fake clock), and status_json's progress."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.reindex.lifecycle import STALE_AFTER_REFRESHES, LiveModels, ModelLifecycle, status_json
from pipeline.settings import Settings
from storage.config import S3Settings
from storage.errors import ModelConfigError, ReindexRefused, TransientError
from storage.frames import FrameRow, VideoFrames
from storage.models import LEGACY_FRAMES, Backfill, ModelRegistry, ModelState, ModelTable
from storage.tables import IndexStore

DIMS = {"model-a": 8, "model-b": 12, "model-c": 4}
T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
#: Longest a racer waits for the others.
RACE_WAIT_S = 30.0


def dim_of(model: str) -> int:
    return DIMS[model]


#: The models' tests run with no text pipeline (its table is the text tests' at the end).
NO_TEXT = {"subtitles": False, "ocr": False, "speech": False}


def settings(model: str = "model-a", auto: bool = False) -> Settings:
    return Settings.model_validate({"model": {"id": model}, "reindex": {"auto": auto}, "text": NO_TEXT})


@pytest.fixture
def store(tmp_path: Path) -> IndexStore:
    return IndexStore(S3Settings(), uri=str(tmp_path / "lance"))


def lifecycle(
    store: IndexStore, model: str = "model-a", auto: bool = False, dims: dict[str, int] = DIMS
) -> ModelLifecycle:
    return ModelLifecycle(store, settings(model, auto), dims.__getitem__)


def write_rows(store: IndexStore, table: str, dim: int, video: str = "v1", n: int = 2, model: str = "m") -> None:
    rng = np.random.default_rng(0)
    rows = [FrameRow(f"{video}-{i:07d}", float(i), rng.random(dim).astype(np.float32), None) for i in range(n)]
    store.frames_table(table).replace(VideoFrames(video, f"s3://videos/{video}.mp4", "e1", "fp", model, rows))


def on(store: IndexStore, state: ModelState) -> ModelState:
    """The index's lifecycle row set to ``state`` (over whatever it held)."""
    written = store.models.write(state, store.models.read().rev)
    assert written is not None
    return written


def answering_a(store: IndexStore) -> ModelState:
    return on(store, ModelState(active=ModelTable.new("model-a", 8)))


# -- preflight ----------------------------------------------------------------------------------------


def test_preflight_on_an_empty_index_sets_the_configured_model_in_a_new_table(store: IndexStore) -> None:
    state = lifecycle(store).preflight()
    assert state.active is not None and (state.active.model, state.active.dim) == ("model-a", 8)
    assert state.active.table.startswith("frames-model-a-") and state.target is None
    assert store.models.read() == state
    # Again: nothing changes.
    assert lifecycle(store).preflight().rev == state.rev


def test_preflight_adopts_a_legacy_frames_table_of_the_same_dimension(store: IndexStore) -> None:
    write_rows(store, LEGACY_FRAMES, 8, model="model-a")
    state = lifecycle(store).preflight()
    assert state.active == ModelTable("model-a", 8, LEGACY_FRAMES)


def test_preflight_adopts_a_legacy_table_under_the_model_that_built_it(store: IndexStore) -> None:
    """The legacy rows say which model made them (``frames.model``): the table is adopted under that
    model, never as the configured model's (searches would compare one model's queries with
    another's vectors), and the configured one is refused until switched to."""
    write_rows(store, LEGACY_FRAMES, 8, model="model-x")
    with pytest.raises(ModelConfigError, match="model-x"):
        lifecycle(store).preflight()
    assert store.models.read().active == ModelTable("model-x", 8, LEGACY_FRAMES)


def test_preflight_refuses_a_legacy_frames_table_of_another_dimension(store: IndexStore) -> None:
    write_rows(store, LEGACY_FRAMES, 8, model="model-a")
    with pytest.raises(ModelConfigError, match=r"vidx reindex --model model-b") as refused:
        lifecycle(store, "model-b").preflight()
    assert "answers with model 'model-a'" in str(refused.value)
    # Adopted under the model that built it (its rows say so): a switch starts from there.
    active = store.models.read().active
    assert active == ModelTable("model-a", 8, LEGACY_FRAMES)


def test_preflight_refuses_a_model_the_index_is_not_on_naming_the_command(store: IndexStore) -> None:
    before = answering_a(store)
    with pytest.raises(ModelConfigError, match=r"vidx reindex --model model-b"):
        lifecycle(store, "model-b").preflight()
    assert store.models.read() == before


def test_preflight_follows_the_index_when_the_configured_model_was_switched_away_from(store: IndexStore) -> None:
    switched = ModelState(active=ModelTable.new("model-b", 12), retired=(ModelTable.new("model-a", 8),))
    assert store.models.write(switched, store.models.read().rev) is not None
    before = store.models.read()
    assert lifecycle(store, "model-a").preflight() == before  # a warning, nothing written
    with pytest.raises(ModelConfigError, match="model-c"):
        lifecycle(store, "model-c").preflight()  # never the index's model: refused


def test_preflight_with_auto_starts_a_backfill_to_the_configured_model(store: IndexStore) -> None:
    before = answering_a(store)
    state = lifecycle(store, "model-b", auto=True).preflight()
    assert state.active == before.active
    assert state.target is not None and (state.target.model, state.target.dim) == ("model-b", 12)
    assert state.target.table.startswith("frames-model-b-")
    assert state.backfill is not None and state.backfill.auto is True
    assert state.backfill.live_from > state.backfill.started_at
    assert store.models.read() == state


def test_preflight_refuses_a_dimension_change_behind_one_id(store: IndexStore) -> None:
    answering_a(store)
    with pytest.raises(ModelConfigError, match="checkpoint"):
        lifecycle(store, dims={**DIMS, "model-a": 16}).preflight()


def test_preflight_refuses_a_table_whose_vectors_differ_from_its_row(store: IndexStore) -> None:
    state = answering_a(store)
    assert state.active is not None
    write_rows(store, state.active.table, 4)
    with pytest.raises(ModelConfigError, match="8-dimensional"):
        lifecycle(store).preflight()


def test_preflight_accepts_the_target_as_configured_mid_backfill(store: IndexStore) -> None:
    answering_a(store)
    mid = lifecycle(store, "model-b").start("model-b")
    for auto in (False, True):
        assert lifecycle(store, "model-b", auto=auto).preflight() == mid
    # The old model still configured (a rolling restart) is accepted too: it is live.
    assert lifecycle(store, "model-a").preflight() == mid


def test_preflight_with_auto_refuses_a_third_model_mid_backfill(store: IndexStore) -> None:
    answering_a(store)
    lifecycle(store).start("model-b")
    with pytest.raises(ModelConfigError, match="reindex --abort"):
        lifecycle(store, "model-c", auto=True).preflight()


class PausedReads:
    """The registry, but the first read of each racer waits at a barrier: every racer has read the
    empty row before any of them writes."""

    def __init__(self, registry: ModelRegistry, barrier: threading.Barrier) -> None:
        self._registry = registry
        self._barrier = barrier
        self._paused: set[int] = set()

    def read(self) -> ModelState:
        state = self._registry.read()
        me = threading.get_ident()
        if me not in self._paused:
            self._paused.add(me)
            self._barrier.wait(RACE_WAIT_S)
        return state

    def write(self, state: ModelState, expected_rev: int) -> ModelState | None:
        return self._registry.write(state, expected_rev)


def race(*calls: Any) -> list[Any]:
    """Run ``calls`` on a thread each at once; their results (or exceptions), in order."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RACE_WAIT_S * 2)
    assert not any(t.is_alive() for t in threads)
    return results


def racers(tmp_path: Path, n: int, model: str = "model-a") -> list[ModelLifecycle]:
    barrier = threading.Barrier(n)
    out = []
    for _ in range(n):
        s = IndexStore(S3Settings(), uri=str(tmp_path / "lance"))
        s.models = PausedReads(s.models, barrier)  # type: ignore[assignment]
        out.append(ModelLifecycle(s, settings(model), dim_of))
    return out


def test_racing_preflights_on_an_empty_index_agree_on_one_table(tmp_path: Path, store: IndexStore) -> None:
    store.models.read()  # the table exists: the race is for the row
    results = race(*(lc.preflight for lc in racers(tmp_path, 4)))
    assert all(isinstance(r, ModelState) for r in results), results
    assert len({r.active.table for r in results}) == 1
    assert store.models.read().rev == 1 and store.models.read().active == results[0].active


def test_racing_starts_of_two_models_start_exactly_one(tmp_path: Path, store: IndexStore) -> None:
    answering_a(store)
    b, c = racers(tmp_path, 2)
    results = race(lambda: b.start("model-b"), lambda: c.start("model-c"))
    started = [r for r in results if isinstance(r, ModelState)]
    refused = [r for r in results if isinstance(r, ReindexRefused)]
    assert len(started) == 1 and len(refused) == 1, results
    assert store.models.read().target == started[0].target
    assert "reindex --abort" in str(refused[0])


# -- start, abort, cleanup ----------------------------------------------------------------------------


def test_start_is_refused_on_an_empty_index_and_for_the_active_model(store: IndexStore) -> None:
    with pytest.raises(ReindexRefused, match="no model yet"):
        lifecycle(store).start("model-b")
    answering_a(store)
    with pytest.raises(ReindexRefused, match="already the active model"):
        lifecycle(store).start("model-a")


def test_start_is_refused_while_another_backfill_runs_and_idempotent_for_the_same(store: IndexStore) -> None:
    answering_a(store)
    first = lifecycle(store).start("model-b")
    assert first.target is not None and first.target.model == "model-b" and first.backfill is not None
    assert first.backfill.auto is False
    assert lifecycle(store).start("model-b") == first  # nothing changes: same table, same revision
    with pytest.raises(ReindexRefused, match="model-b"):
        lifecycle(store).start("model-c")
    assert store.models.read() == first


def test_start_of_another_model_than_configured_with_auto_on_is_refused(store: IndexStore) -> None:
    answering_a(store)
    with pytest.raises(ReindexRefused, match="VIDX_REINDEX__AUTO"):
        lifecycle(store, "model-a", auto=True).start("model-b")


def test_abort_drops_the_target_table_and_clears_the_target(store: IndexStore) -> None:
    before = answering_a(store)
    assert before.active is not None
    write_rows(store, before.active.table, 8)
    started = lifecycle(store).start("model-b")
    assert started.target is not None
    write_rows(store, started.target.table, 12)  # a backfill job wrote into it
    assert store.db.open(started.target.table) is not None
    left = lifecycle(store).abort()
    assert left.target is None and left.backfill is None and left.active == before.active
    assert store.db.open(started.target.table) is None
    assert store.frames_table(before.active.table).count() == 2  # the active table is untouched
    with pytest.raises(ReindexRefused, match="no backfill"):
        lifecycle(store).abort()


def test_cleanup_drops_retired_and_stray_tables_never_live_ones(store: IndexStore) -> None:
    active, target = ModelTable.new("model-a", 8), ModelTable.new("model-b", 12)
    old, legacy = ModelTable.new("model-c", 4), ModelTable("model-0", 8, LEGACY_FRAMES)
    stray = ModelTable.new("model-c", 4)  # an aborted backfill's late write, named by no state
    # A retired entry naming a live table (never written so, but never dropped either).
    on(store, ModelState(active=active, target=target, retired=(old, legacy, ModelTable("x", 8, active.table))))
    for t in (active, target, old, legacy, stray):
        write_rows(store, t.table, t.dim)
    store.catalog.get("warm")  # the catalog's table exists too

    dropped = lifecycle(store).cleanup()

    assert sorted(dropped) == sorted([old.table, LEGACY_FRAMES, stray.table])
    for t in (old, legacy, stray):
        assert store.db.open(t.table) is None
    for t in (active, target):
        assert store.frames_table(t.table).count() == 2
    assert store.db.open("videos") is not None and store.db.open("models") is not None
    state = store.models.read()
    assert state.retired == () and state.active == active and state.target == target
    assert lifecycle(store).cleanup() == []


def test_the_grace_covers_the_oldest_lifecycle_a_job_may_run_on(store: IndexStore) -> None:
    """``LiveModels`` serves a state up to ``STALE_AFTER_REFRESHES`` intervals old when re-reads fail:
    the grace covers that, so no job claims a video after ``live_from`` on a lifecycle read from
    before the backfill began (the switch would go ahead while it writes only the old table)."""
    s = Settings.model_validate({"model": {"id": "model-a"}, "reindex": {"live_refresh_s": 2.0, "clock_skew_s": 0}})
    answering_a(store)
    registry, clock = CountedRegistry(store.models), FakeClock()
    live = LiveModels(registry, refresh_s=s.reindex.live_refresh_s, clock=clock)  # type: ignore[arg-type]
    read_at = clock.now
    live.state()
    registry.failing = True
    clock.now = read_at + STALE_AFTER_REFRESHES * s.reindex.live_refresh_s
    served = live.state()  # still the state read before; its age:
    age_s = clock.now - read_at
    assert served.target is None
    grace_s = ModelLifecycle(store, s, dim_of).live_grace_s()
    assert age_s + s.writer.catalog_write_timeout_s <= grace_s


# -- LiveModels ---------------------------------------------------------------------------------------


class CountedRegistry:
    """A registry that counts reads and, while ``failing``, fails them as the store would."""

    def __init__(self, registry: ModelRegistry) -> None:
        self._registry = registry
        self.reads = 0
        self.failing = False

    def read(self) -> ModelState:
        self.reads += 1
        if self.failing:
            raise TransientError("index table read failed: connection reset")
        return self._registry.read()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_live_models_reads_once_per_refresh_interval(store: IndexStore) -> None:
    first = answering_a(store)
    registry, clock = CountedRegistry(store.models), FakeClock()
    live = LiveModels(registry, refresh_s=2.0, clock=clock)  # type: ignore[arg-type]
    assert live.active() == first.active and registry.reads == 1
    switched = on(store, first.evolve(active=ModelTable.new("model-b", 12), retired=(first.active,)))
    clock.now += 1.9
    assert live.active() == first.active and live.live() == [first.active] and registry.reads == 1
    clock.now += 0.1
    assert live.active() == switched.active and registry.reads == 2


def test_live_models_falls_back_on_the_cached_state_then_raises(store: IndexStore) -> None:
    first = answering_a(store)
    registry, clock = CountedRegistry(store.models), FakeClock()
    live = LiveModels(registry, refresh_s=2.0, clock=clock)  # type: ignore[arg-type]
    read_at = clock.now
    assert live.state() == first
    registry.failing = True
    clock.now = read_at + 5.0
    assert live.state() == first and registry.reads == 2
    clock.now = read_at + STALE_AFTER_REFRESHES * 2.0
    assert live.state() == first and registry.reads == 3  # a failed read is not cached: each call tries
    clock.now += 0.5
    with pytest.raises(TransientError):
        live.state()
    registry.failing = False
    assert live.state() == first  # and recovers once reads work again


def test_live_models_raises_when_nothing_was_ever_read_or_no_model_is_set(store: IndexStore) -> None:
    registry = CountedRegistry(store.models)
    registry.failing = True
    with pytest.raises(TransientError):
        LiveModels(registry, refresh_s=2.0, clock=FakeClock()).state()  # type: ignore[arg-type]
    empty = LiveModels(store.models, refresh_s=2.0, clock=FakeClock())
    with pytest.raises(TransientError, match="no active model"):
        empty.live()
    with pytest.raises(TransientError, match="no active model"):
        empty.active()


# -- status_json --------------------------------------------------------------------------------------


def backfilling(**fields: Any) -> ModelState:
    backfill = Backfill(started_at=T0, live_from=T0 + timedelta(seconds=30), **fields)
    return ModelState(
        active=ModelTable("model-a", 8, "frames-a"), target=ModelTable("model-b", 12, "frames-b"), backfill=backfill
    )


def test_status_progress_counts_the_rate_from_the_resume() -> None:
    resumed = T0 + timedelta(seconds=100)
    state = backfilling(total=70, done=30, failed=2, done_at_resume=10, resumed_at=resumed, progress_at=resumed)
    out = status_json(state, "model-b", now=resumed + timedelta(seconds=40))
    assert out["state"] == "backfilling" and out["configured"] == "model-b"
    assert out["target"] == {"model": "model-b", "dim": 12, "table": "frames-b"}
    progress = out["progress"]
    # 20 done in the 40 s since the resume; 40 left.
    assert (progress["done"], progress["total"], progress["failed"]) == (30, 70, 2)
    assert progress["rate_per_s"] == 0.5 and progress["eta_s"] == 80.0
    assert progress["started_at"] == T0.isoformat() and progress["auto"] is False


def test_status_without_a_resume_counts_from_the_start_and_no_gain_has_no_eta() -> None:
    out = status_json(backfilling(total=10, done=5), now=T0 + timedelta(seconds=10))
    assert out["progress"]["rate_per_s"] == 0.5 and out["progress"]["eta_s"] == 10.0
    stalled = status_json(backfilling(total=10, done=5, done_at_resume=5, resumed_at=T0), now=T0 + timedelta(hours=1))
    assert stalled["progress"]["rate_per_s"] == 0.0 and stalled["progress"]["eta_s"] is None


def test_status_of_an_idle_and_an_empty_index() -> None:
    assert status_json(ModelState())["state"] == "empty"
    idle = status_json(ModelState(active=ModelTable("model-a", 8, "frames-a"), retired=(ModelTable("m", 4, "t"),)))
    assert (
        idle["state"] == "idle"
        and idle["progress"] is None
        and idle["retired"] == [{"model": "m", "dim": 4, "table": "t"}]
    )


# -- the text pipeline's table --------------------------------------------------------------------------


ALL_TEXT = {"subtitles": True, "ocr": True, "speech": True}


def text_lifecycle(store: IndexStore, **text: Any) -> ModelLifecycle:
    sources = {**ALL_TEXT, **text}
    return ModelLifecycle(store, Settings.model_validate({"model": {"id": "model-a"}, "text": sources}), dim_of)


def test_preflight_names_a_text_table_for_the_configured_text_pipeline_after_the_models(store: IndexStore) -> None:
    state = text_lifecycle(store).preflight()
    assert state.text is not None and state.text.is_text and state.text.table.startswith("text-")
    assert state.text.pipeline is not None and "ocr" in state.text.pipeline and "speech" in state.text.pipeline
    assert state.tables() == [state.active, state.text] and state.live() == [state.active]
    assert store.models.read() == state
    assert text_lifecycle(store).preflight().rev == state.rev  # again: nothing changes


def test_a_changed_text_pipeline_gets_a_new_table_and_retires_the_old(store: IndexStore) -> None:
    first = text_lifecycle(store).preflight()
    second = text_lifecycle(store, ocr_every_s=2.0).preflight()
    assert second.text is not None and first.text is not None and second.text.table != first.text.table
    assert first.text in second.retired and second.active == first.active
    # A replica of the old configuration restarting mid-rollout follows the index: no switch back.
    assert text_lifecycle(store).preflight() == second
    # A configuration with no source on reads no words and writes nothing: the table stays for the others.
    assert text_lifecycle(store, ocr_every_s=2.0, subtitles=False, ocr=False, speech=False).preflight() == second


def test_a_replica_of_an_old_configuration_follows_a_switch_made_while_it_was_down(store: IndexStore) -> None:
    first = text_lifecycle(store, speech=False).preflight()
    second = text_lifecycle(store).preflight()
    # The old configuration restarts: it follows the index (a warning), and the new one's restart writes nothing.
    assert text_lifecycle(store, speech=False).preflight() == second
    assert text_lifecycle(store).preflight() == second and first.text in second.retired


def test_cleanup_drops_retired_text_tables_but_neither_the_live_one_nor_one_the_row_does_not_name(
    store: IndexStore,
) -> None:
    """A text table the row does not name may be the live one of a row an older release rewrote without
    its ``text``: only retired ones go."""
    from storage.texts import TextRow, TextTable, VideoText, text_table_name

    first = text_lifecycle(store).preflight()
    second = text_lifecycle(store, ocr=False).preflight()
    assert first.text is not None and second.text is not None
    stray = text_table_name("orphaned", "x1")
    for name in (first.text.table, second.text.table, stray):
        rows = [TextRow("v-t000000", 0.0, 1.0, "words", "ocr", 0.9)]
        TextTable(store.db, name).replace_many([VideoText("v", "s3://b/v.mp4", "e1", "fp", "p", rows)])
    dropped = text_lifecycle(store, ocr=False).cleanup()
    assert dropped == [first.text.table]
    assert {second.text.table, stray} <= set(store.db.table_names())
