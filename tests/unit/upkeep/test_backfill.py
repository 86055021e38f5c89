"""pipeline/upkeep/backfill.py over a real local LanceDB and a recording task queue: what a round submits
(the window, resubmission after its interval on an injected clock), what holds the switch back, the
switch as one lifecycle write, progress, a new coordinator carrying on; and a real index job
paused mid-flight while a round runs on another thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from events.jobs import IndexJob, JobOp, JobSource
from pipeline.index.indexer import Indexer
from pipeline.settings import Settings
from pipeline.upkeep.backfill import BackfillCoordinator, BackfillRound
from pipeline.upkeep.maintenance import create_vector_index
from storage.catalog import VideoRecord, VideoStatus
from storage.config import IndexSettings, S3Settings
from storage.frames import FrameRow, VideoFrames
from storage.ids import fingerprint, video_id
from storage.models import Backfill, ModelIndex, ModelRegistry, ModelState, ModelTable, table_name
from storage.sampling import Sampling
from storage.tables import IndexStore
from tests.media import write_video
from tests.unit.index.test_indexer import MemoryObjects

A = ModelTable("model-a", 8, table_name("model-a", 8, "g1"))
B = ModelTable("model-b", 12, table_name("model-b", 12, "g2"))
OLD = ModelTable("model-0", 4, table_name("model-0", 4, "g0"))
#: Longest a paused job or a round on a thread is waited for.
WAIT_S = 30.0
HOUR = timedelta(hours=1)


class Recorded:
    """A task queue that keeps what it was given."""

    def __init__(self) -> None:
        self.jobs: list[IndexJob] = []

    def submit(self, job: IndexJob) -> str:
        self.jobs.append(job)
        return f"t{len(self.jobs)}"

    def keys(self) -> list[str]:
        return [j.key for j in self.jobs]


class CountedWrites:
    """The lifecycle registry, counting its writes."""

    def __init__(self, registry: ModelRegistry) -> None:
        self._registry = registry
        self.writes: list[ModelState] = []

    def read(self) -> ModelState:
        return self._registry.read()

    def write(self, state: ModelState, expected_rev: int) -> ModelState | None:
        self.writes.append(state)
        return self._registry.write(state, expected_rev)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> IndexStore:
    s = IndexStore(S3Settings(), uri=str(tmp_path / "lance"))
    s.models = CountedWrites(s.models)  # type: ignore[assignment]
    return s


def writes(store: IndexStore) -> list[ModelState]:
    return store.models.writes  # type: ignore[attr-defined]


def coordinator(store: IndexStore, sink: Recorded, clock: Clock, max_outstanding: int = 10) -> BackfillCoordinator:
    return BackfillCoordinator(
        store,
        sink,
        interval_s=1.0,
        max_outstanding=max_outstanding,
        resubmit_after_s=60.0,
        lease_ttl_s=30.0,
        clock=clock,
    )


def backfilling(store: IndexStore, live_from: datetime | None = None, **fields: Any) -> ModelState:
    """The index answering with A, backfilling to B (``live_from`` an hour ago unless given)."""
    now = datetime.now(UTC)
    backfill = Backfill(started_at=now - 2 * HOUR, live_from=live_from or now - HOUR)
    state = ModelState(active=A, target=B, backfill=backfill, retired=(OLD,), **fields)
    written = store.models.write(state, store.models.read().rev)
    assert written is not None
    return written


def entry(table: ModelTable, version: str, frames: int = 3) -> ModelIndex:
    return ModelIndex(table.table, table.model, fingerprint(version, table.model, Sampling(1.0)), frames, Sampling(1.0))


def put(store: IndexStore, key: str, status: VideoStatus = VideoStatus.INDEXED, **fields: Any) -> VideoRecord:
    """A catalog row for ``s3://videos/key`` (rewritten over what it held)."""
    vid = video_id("videos", key)
    seen = store.catalog.get(vid)
    fields.setdefault("version", "e1")
    fields.setdefault("indexes", (entry(A, fields["version"]),))
    record = VideoRecord(vid, f"s3://videos/{key}", status, **fields)
    written = store.catalog.write(record.evolve(rev=seen.rev) if seen else record, seen.rev if seen else 0)
    assert written is not None
    return written


def test_a_round_without_a_backfill_does_nothing(store: IndexStore) -> None:
    store.models.write(ModelState(active=A), 0)
    put(store, "a.mp4")
    sink = Recorded()
    assert coordinator(store, sink, Clock()).round() is None
    assert sink.jobs == [] and len(writes(store)) == 1


def test_indexed_videos_lacking_the_target_are_submitted_within_the_window(store: IndexStore) -> None:
    backfilling(store)
    for key in ("a.mp4", "b.mp4", "c.mp4"):
        put(store, key)
    put(store, "done.mp4", indexes=(entry(A, "e1"), entry(B, "e1")))
    put(store, "gone.mp4", VideoStatus.DELETED, indexes=())
    put(store, "bad.mp4", VideoStatus.FAILED, indexes=())
    sink, clock = Recorded(), Clock()
    backfill = coordinator(store, sink, clock, max_outstanding=2)

    first = backfill.round()
    assert first is not None and (first.total, first.done, first.need, first.failed) == (4, 1, 3, 1)
    assert first.submitted == 2 and not first.switched
    assert all(j.op is JobOp.INDEX and j.source is JobSource.REINDEX for j in sink.jobs)
    assert backfill.round().submitted == 0  # type: ignore[union-attr]  # the window is full
    clock.now += 59.0
    assert backfill.round().submitted == 0  # type: ignore[union-attr]
    # One of them done: its slot is free for the third.
    submitted = sink.keys()
    (third,) = {"a.mp4", "b.mp4", "c.mp4"} - set(submitted)
    put(store, submitted[0], indexes=(entry(A, "e1"), entry(B, "e1")))
    assert backfill.round().submitted == 1 and sink.keys()[-1] == third  # type: ignore[union-attr]
    # Not done within resubmit_after_s of its submit: submitted again (the third is still out).
    clock.now += 1.0
    again = backfill.round()
    assert again is not None and again.submitted == 1 and sink.keys()[-1] == submitted[1]
    clock.now += 59.0
    assert backfill.round().submitted == 1 and sink.keys()[-1] == third  # type: ignore[union-attr]


def test_a_target_entry_of_an_older_version_is_needed_again(store: IndexStore) -> None:
    backfilling(store)
    put(store, "a.mp4", version="e2", indexes=(entry(A, "e2"), entry(B, "e1")))
    sink = Recorded()
    found = coordinator(store, sink, Clock()).round()
    assert found is not None and (found.need, found.done) == (1, 0) and sink.keys() == ["a.mp4"]
    assert store.models.read().target == B


def test_in_flight_rows_from_before_live_from_hold_the_switch_later_ones_do_not(store: IndexStore) -> None:
    put(store, "early.mp4", VideoStatus.INDEXING)  # claimed before live_from
    backfilling(store, live_from=datetime.now(UTC))
    sink = Recorded()
    backfill = coordinator(store, sink, Clock())
    held = backfill.round()
    assert held is not None and (held.holding, held.need) == (1, 0) and not held.switched
    assert store.models.read().target == B and sink.jobs == []
    # Settled with both entries, and a new upload claimed after live_from (its job writes B too).
    put(store, "early.mp4", indexes=(entry(A, "e1"), entry(B, "e1")))
    put(store, "late.mp4", VideoStatus.QUEUED, indexes=())
    done = backfill.round()
    assert done is not None and done.holding == 0 and done.switched


def test_no_switch_before_live_from_even_when_every_video_has_the_target(store: IndexStore) -> None:
    backfilling(store, live_from=datetime.now(UTC) + HOUR)
    put(store, "a.mp4", indexes=(entry(A, "e1"), entry(B, "e1")))
    found = coordinator(store, Recorded(), Clock()).round()
    assert found is not None and found.done == 1 and not found.switched
    assert store.models.read().target == B


def test_the_switch_is_one_lifecycle_write(store: IndexStore) -> None:
    before = backfilling(store)
    put(store, "a.mp4", indexes=(entry(A, "e1"), entry(B, "e1")))
    put(store, "gone.mp4", VideoStatus.DELETED, indexes=())
    counted = len(writes(store))
    found = coordinator(store, Recorded(), Clock()).round()
    assert found is not None and found.switched
    after = store.models.read()
    assert len(writes(store)) == counted + 1 and after.rev == before.rev + 1
    assert after.active == B and after.target is None and after.backfill is None
    assert after.retired == (A, OLD) and after.switched_at is not None
    # Just after the switch a round sweeps (nothing to do here); none once sweep_s has passed.
    swept = coordinator(store, Recorded(), Clock()).round()
    assert swept is not None and (swept.need, swept.done, swept.submitted) == (0, 1, 0)
    late = BackfillCoordinator(
        store, Recorded(), interval_s=1.0, max_outstanding=10, resubmit_after_s=60.0, lease_ttl_s=30.0, sweep_s=0.0
    )
    assert late.round() is None


def test_after_the_switch_a_video_that_settled_without_the_new_models_rows_gets_a_job(store: IndexStore) -> None:
    """A job that left out the target (it could not embed it) and settled in the instant of the
    switch: the sweep after the switch gives it a job at once, once per ``resubmit_after_s``."""
    backfilling(store)
    put(store, "a.mp4", indexes=(entry(A, "e1"), entry(B, "e1")))
    sink, clock = Recorded(), Clock()
    backfill = coordinator(store, sink, clock)
    assert backfill.round().switched  # type: ignore[union-attr]
    put(store, "late.mp4", indexes=(entry(A, "e1"),))  # indexed with the old model only
    swept = backfill.round()
    assert swept is not None and swept.need == 1 and sink.keys() == ["late.mp4"]
    assert backfill.round().submitted == 0  # type: ignore[union-attr]  # not again within resubmit_after_s


def test_progress_is_written_with_the_resume_point_on_the_first_round(store: IndexStore) -> None:
    backfilling(store)
    put(store, "a.mp4")
    put(store, "b.mp4", indexes=(entry(A, "e1"), entry(B, "e1")))
    put(store, "bad.mp4", VideoStatus.FAILED, indexes=())
    backfill = coordinator(store, Recorded(), Clock())
    backfill.round()
    b = store.models.read().backfill
    assert b is not None and (b.total, b.done, b.failed, b.done_at_resume) == (2, 1, 1, 1)
    assert b.resumed_at is not None and b.progress_at is not None
    rev = store.models.read().rev
    backfill.round()  # nothing changed: nothing written
    assert store.models.read().rev == rev
    put(store, "c.mp4", indexes=(entry(A, "e1"), entry(B, "e1")))
    backfill.round()
    b2 = store.models.read().backfill
    assert b2 is not None and (b2.total, b2.done, b2.done_at_resume, b2.resumed_at) == (3, 2, 1, b.resumed_at)


def test_a_new_coordinator_resubmits_what_is_still_needed(store: IndexStore) -> None:
    backfilling(store)
    put(store, "a.mp4")
    put(store, "b.mp4")
    first_sink, clock = Recorded(), Clock()
    coordinator(store, first_sink, clock).round()
    assert sorted(first_sink.keys()) == ["a.mp4", "b.mp4"]
    put(store, "a.mp4", indexes=(entry(A, "e1"), entry(B, "e1")))  # one job ran before the first stopped
    resumed_at = store.models.read().backfill.resumed_at  # type: ignore[union-attr]
    # A new coordinator (as after a restart, or the lease moving): same clock, nothing in memory.
    second_sink = Recorded()
    found = coordinator(store, second_sink, clock).round()
    assert found is not None and second_sink.keys() == ["b.mp4"]
    b = store.models.read().backfill
    assert b is not None and b.done_at_resume == 1 and b.resumed_at != resumed_at


@pytest.mark.parametrize("searchable", [False, True], ids=["nothing-searchable", "still-searchable-with-A"])
def test_a_failed_backfill_job_frees_its_window_slot(store: IndexStore, searchable: bool) -> None:
    """A video whose backfill job failed holds no slot of the window: with every slot taken by
    failures the backfill would stall until ``resubmit_after_s``. One still searchable with the
    active model at its version still needs the target (switching would lose it); one that isn't
    counts as failed."""
    backfilling(store)
    put(store, "a.mp4")
    put(store, "b.mp4")
    sink, clock = Recorded(), Clock()
    backfill = coordinator(store, sink, clock, max_outstanding=1)
    backfill.round()
    (first,) = sink.keys()
    indexes = (entry(A, "e1"),) if searchable else ()
    put(store, first, VideoStatus.FAILED, indexes=indexes, error="gave up after 4 attempts")
    found = backfill.round()
    assert found is not None
    assert (found.failed, found.need) == ((0, 2) if searchable else (1, 1))
    assert found.submitted == 1 and len(sink.keys()) == 2


# -- a real job paused mid-flight while a round runs ------------------------------------------------


class Dim:
    """A stand-in embedder of ``dim``: each frame's mean colour spread over ``dim``, normalised."""

    def __init__(self, model_id: str, dim: int) -> None:
        self.model_id = model_id
        self.dim = dim

    def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]:
        means = np.stack([img.reshape(-1, 3).mean(axis=0) for img in images]).astype(np.float32) + 1.0
        vectors = np.resize(means, (len(images), self.dim)) * np.arange(1, self.dim + 1, dtype=np.float32)
        return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


class Embedders:
    def __init__(self, *embedders: Dim) -> None:
        self.by_id = {e.model_id: e for e in embedders}

    def for_model(self, model_id: str) -> Dim:
        return self.by_id[model_id]


class PauseAt:
    """Hooks that hold a job at ``step`` until released (the first time only)."""

    def __init__(self, step: str) -> None:
        self.step = step
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, step: str, _job: IndexJob) -> None:
        if step == self.step and not self.reached.is_set():
            self.reached.set()
            assert self.release.wait(WAIT_S), "never released"


def indexer(
    store: IndexStore,
    objects: MemoryObjects,
    live: Callable[[], list[ModelTable]],
    hooks: Any = None,
    *,
    claim_after_s: float | None = None,
) -> Indexer:
    """``claim_after_s``: the jobs' ``serve.claim_after_s`` (None: the default)."""
    extra = {"hooks": hooks} if hooks is not None else {}
    embedders = Embedders(Dim("model-a", 8), Dim("model-b", 12))
    settings = Settings.model_validate({"serve": {} if claim_after_s is None else {"claim_after_s": claim_after_s}})
    return Indexer(settings, Dim("model-a", 8), store, objects, models=live, embedders=embedders, **extra)


def on_thread(call: Callable[[], Any]) -> Callable[[], Any]:
    """Start ``call`` on a thread; the returned function joins it and returns its result (or raises)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()

    def join() -> Any:
        thread.join(WAIT_S)
        assert not thread.is_alive() and out
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    return join


@pytest.mark.parametrize("job_live", [[A, B], [A]], ids=["job-knew-the-target", "job-read-before-the-backfill"])
def test_a_job_in_flight_from_before_live_from_holds_the_switch(
    store: IndexStore, tmp_path: Path, job_live: list[ModelTable]
) -> None:
    objects = MemoryObjects()
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=2, seed=1))
    backfilling(store, live_from=datetime.now(UTC) + HOUR)
    pause = PauseAt("write")
    job = IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.EVENT)
    # A job that claims (a first start claims only past claim_after_s; a shorter one is in no flight to
    # hold the switch back: its finish checks the live models again, test_indexer_models.py
    # test_a_job_on_a_lifecycle_read_before_a_backfill_began_settles_with_the_new_table_too)
    finished = on_thread(lambda: indexer(store, objects, lambda: job_live, pause, claim_after_s=0).run(job))
    assert pause.reached.wait(WAIT_S)
    # The job has claimed the video; time passes beyond live_from while it is still writing.
    state = store.models.read()
    assert state.backfill is not None
    store.models.write(state.evolve(backfill=Backfill(state.backfill.started_at, datetime.now(UTC))), state.rev)
    sink = Recorded()
    backfill = coordinator(store, sink, Clock())
    held: BackfillRound = on_thread(backfill.round)()
    assert held.holding == 1 and not held.switched
    assert store.models.read().target == B and store.models.read().active == A

    pause.release.set()
    finished()
    vid = job.video_id
    if job_live == [A]:  # it wrote only A: the next round submits the backfill job, which adds B
        needed = backfill.round()
        assert needed is not None and needed.need == 1 and not needed.switched and sink.keys() == ["a.mp4"]
        indexer(store, objects, lambda: store.models.read().live()).run(sink.jobs[0])
    switched = backfill.round()
    assert switched is not None and switched.switched and store.models.read().active == B
    record = store.catalog.get(vid)
    assert record is not None and record.status is VideoStatus.INDEXED
    assert record.index_in(A.table) is not None and record.index_in(B.table) is not None
    assert store.frames_table(B.table).count(vid) == store.frames_table(A.table).count(vid) == 2


ANN_MIN_ROWS = 256


def fill_target(store: IndexStore, rows: int) -> None:
    """``rows`` frames of a.mp4 in B's table (random unit vectors of B's dimension)."""
    vectors = np.random.default_rng(7).standard_normal((rows, B.dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    frames = [FrameRow(frame_id=f"a-{i}", ts_s=float(i), vector=v, thumbnail=None) for i, v in enumerate(vectors)]
    vid = video_id("videos", "a.mp4")
    fp = fingerprint("e1", B.model, Sampling(1.0))
    store.frames_table(B.table).replace(VideoFrames(vid, "s3://videos/a.mp4", "e1", fp, B.model, frames))


def index_waiting(store: IndexStore, sink: Recorded, clock: Clock, wait_s: float = 100.0) -> BackfillCoordinator:
    return BackfillCoordinator(
        store,
        sink,
        interval_s=1.0,
        max_outstanding=10,
        resubmit_after_s=60.0,
        lease_ttl_s=30.0,
        ann_min_rows=ANN_MIN_ROWS,
        index_wait_s=wait_s,
        clock=clock,
    )


def test_the_switch_waits_for_the_new_tables_ann_index_once_it_is_past_the_threshold(store: IndexStore) -> None:
    backfilling(store)
    put(store, "a.mp4", indexes=(entry(A, "e1"), entry(B, "e1", frames=300)))
    fill_target(store, 300)
    backfill = index_waiting(store, Recorded(), Clock())
    held = backfill.round()
    assert held is not None and not held.switched and held.done == held.total == 1
    assert held.waiting_for is not None and "vector index" in held.waiting_for
    state = store.models.read()
    assert state.target == B and state.backfill is not None and state.backfill.waiting_for == held.waiting_for
    # Index maintenance builds it (as the router's maintainer does for every live table): the next round switches.
    settings = IndexSettings(ann_min_rows=ANN_MIN_ROWS, rows_per_partition=256)
    create_vector_index(store, settings, store.frames_table(B.table))
    switched = backfill.round()
    assert switched is not None and switched.switched and switched.waiting_for is None
    assert store.models.read().active == B


def test_a_new_table_below_the_threshold_switches_without_an_index(store: IndexStore) -> None:
    backfilling(store)
    put(store, "a.mp4", indexes=(entry(A, "e1"), entry(B, "e1", frames=ANN_MIN_ROWS - 1)))
    fill_target(store, ANN_MIN_ROWS - 1)
    found = index_waiting(store, Recorded(), Clock()).round()
    assert found is not None and found.switched and store.models.read().active == B


def waited(store: IndexStore, seconds: float) -> None:
    """Move the start of the switch's wait, as the row records it, ``seconds`` into the past."""
    state = store.models.read()
    assert state.backfill is not None and state.backfill.waiting_since is not None
    since = datetime.now(UTC) - timedelta(seconds=seconds)
    assert store.models.write(state.evolve(backfill=replace(state.backfill, waiting_since=since)), state.rev)


def test_the_wait_for_the_ann_index_is_bounded_across_coordinators(store: IndexStore) -> None:
    """An index that is never built (maintenance failing on the new model, say) holds the switch
    only for ``index_wait_s``, counted from the first round that held it as the row records it: a
    coordinator started afresh (a restarted replica, the lease moving) goes on with the same wait."""
    backfilling(store)
    put(store, "a.mp4", indexes=(entry(A, "e1"), entry(B, "e1", frames=300)))
    fill_target(store, 300)
    held = index_waiting(store, Recorded(), Clock(), wait_s=100.0).round()
    assert held is not None and not held.switched and held.waiting_since is not None
    assert store.models.read().backfill.waiting_since == held.waiting_since  # type: ignore[union-attr]
    waited(store, 90.0)
    again = index_waiting(store, Recorded(), Clock(), wait_s=100.0).round()
    assert again is not None and not again.switched
    waited(store, 101.0)
    late = index_waiting(store, Recorded(), Clock(), wait_s=100.0).round()
    assert late is not None and late.switched and store.models.read().active == B


def test_a_new_table_whose_index_state_cant_be_read_waits_within_the_same_bound(
    store: IndexStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(*args: Any) -> None:
        raise OSError("the store refused")

    monkeypatch.setattr("pipeline.upkeep.backfill.vector_index_state", failing)
    backfilling(store)
    put(store, "a.mp4", indexes=(entry(A, "e1"), entry(B, "e1")))
    held = index_waiting(store, Recorded(), Clock(), wait_s=100.0).round()
    assert held is not None and not held.switched
    assert held.waiting_for is not None and "could not be read (OSError: the store refused)" in held.waiting_for
    waited(store, 101.0)
    late = index_waiting(store, Recorded(), Clock(), wait_s=100.0).round()
    assert late is not None and late.switched


def test_the_wait_for_the_ann_index_keeps_its_start_while_videos_need_jobs_again(store: IndexStore) -> None:
    backfilling(store)
    put(store, "a.mp4", indexes=(entry(A, "e1"), entry(B, "e1", frames=300)))
    fill_target(store, 300)
    backfill = index_waiting(store, Recorded(), Clock(), wait_s=100.0)
    held = backfill.round()
    assert held is not None and held.waiting_since is not None
    put(store, "new.mp4")  # an upload indexed with A only, say: the backfill needs a job again
    busy = backfill.round()
    assert busy is not None and busy.need == 1 and busy.waiting_for is None
    assert store.models.read().backfill.waiting_since == held.waiting_since  # type: ignore[union-attr]
    put(store, "new.mp4", indexes=(entry(A, "e1"), entry(B, "e1")))
    waited(store, 101.0)
    assert backfill.round().switched  # type: ignore[union-attr]


def test_the_coordinators_loop_runs_rounds_only_once_it_holds_the_backfill_lease(store: IndexStore) -> None:
    backfilling(store)
    put(store, "a.mp4")
    sink = Recorded()
    lapses_at = time.time() + 0.3
    assert store.leases.acquire("backfill", "another worker", 0.3, lapses_at - 0.3)
    backfill = BackfillCoordinator(
        store, sink, interval_s=0.01, max_outstanding=10, resubmit_after_s=60.0, lease_ttl_s=30.0
    )
    thread, stop = backfill.service.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while backfill.service.last is None:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert time.time() > lapses_at  # no round ran while the other worker held the lease
        assert backfill.service.last.need == 1 and sink.keys() == ["a.mp4"] and backfill.service.last_error is None
    finally:
        stop.set()
        thread.join(WAIT_S)
    assert not thread.is_alive() and thread.name == "backfill"
