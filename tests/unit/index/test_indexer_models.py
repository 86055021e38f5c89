"""pipeline/index/indexer.py with several live models: a job writes every live model's table and its entry,
embeds only with the models whose rows are missing, deletes from every live table and leaves tables
not live alone; two jobs of one video racing (one paused at a step boundary) end with one set of rows
per table, which the checker finds consistent."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from events.deadletters import DeadLetter, FailureKind
from events.jobs import IndexJob, JobOp, JobSource
from pipeline.index.consumer import IndexTaskHandler, TaskContext
from pipeline.index.indexer import Indexer, Outcome
from pipeline.settings import Settings
from pipeline.upkeep.check import Checker
from storage.catalog import VideoStatus
from storage.config import S3Settings
from storage.errors import EncoderUnavailable, TransientError
from storage.ids import fingerprint
from storage.models import ModelTable, table_name
from storage.s3 import ObjectHead
from storage.sampling import Sampling
from storage.tables import IndexStore
from tests.media import write_video
from tests.unit.index.test_indexer import MemoryObjects

A = ModelTable("model-a", 8, table_name("model-a", 8, "g1"))
B = ModelTable("model-b", 12, table_name("model-b", 12, "g2"))
C = ModelTable("model-c", 4, table_name("model-c", 4, "g0"))
#: Longest a paused job is waited for.
WAIT_S = 30.0


class Dim:
    """A stand-in embedder of ``dim``: each frame's mean colour spread over ``dim``, normalised;
    counts the frames it embedded."""

    def __init__(self, model_id: str, dim: int) -> None:
        self.model_id = model_id
        self.dim = dim
        self.frames = 0
        self._lock = threading.Lock()

    def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]:
        with self._lock:
            self.frames += len(images)
        means = np.stack([img.reshape(-1, 3).mean(axis=0) for img in images]).astype(np.float32) + 1.0
        vectors = np.resize(means, (len(images), self.dim)) * np.arange(1, self.dim + 1, dtype=np.float32)
        return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


class Embedders:
    def __init__(self) -> None:
        self.by_id = {m.model: Dim(m.model, m.dim) for m in (A, B, C)}

    def for_model(self, model_id: str) -> Dim:
        return self.by_id[model_id]


class World:
    """A local index, an in-memory bucket, the embedders, and which tables are live now."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.store = IndexStore(S3Settings(), uri=str(tmp_path / "lance"))
        self.objects = MemoryObjects()
        self.embedders = Embedders()
        self.live: list[ModelTable] = [A, B]

    def indexer(
        self, hooks: Callable[[str, IndexJob], None] | None = None, cached: list[ModelTable] | None = None
    ) -> Indexer:
        """``cached``: what the job's cached lifecycle reads return (a cache from before ``live``
        changed, as ``LiveModels.live`` within its refresh interval) until a read afresh
        (``models_now``, ``LiveModels.live_now``) reads ``live`` and refreshes the cache."""
        extra: dict[str, Any] = {"hooks": hooks} if hooks is not None else {}
        stale = [list(cached)] if cached is not None else []

        def models() -> list[ModelTable]:
            return list(stale[0]) if stale else list(self.live)

        def models_now() -> list[ModelTable]:
            stale.clear()
            return list(self.live)

        return Indexer(
            Settings(),
            self.embedders.for_model(A.model),
            self.store,
            self.objects,
            models=models,
            models_now=models_now,
            embedders=self.embedders,
            **extra,
        )

    def upload(self, key: str = "a.mp4", seconds: int = 3, seed: int = 1) -> ObjectHead:
        self.objects.put(key, write_video(self.tmp_path / f"{key}-{seed}.mp4", seconds=seconds, seed=seed))
        head = self.objects.head("videos", key)
        assert head is not None
        return head

    def embedded(self, model: ModelTable) -> int:
        return self.embedders.by_id[model.model].frames

    def dim_of(self, table: ModelTable) -> int:
        opened = self.store.frames_table(table.table).table()
        assert opened is not None
        return int(opened.schema.field("vector").type.list_size)

    def checker(self) -> Checker:
        objects = self.objects

        class Listing:
            def pages(self, bucket: str, prefix: str, start_after: str | None) -> Iterator[list[ObjectHead]]:
                keys = sorted(k for k in objects.files if k.startswith(prefix) and (not start_after or k > start_after))
                yield [h for k in keys if (h := objects.head(bucket, k)) is not None]

        return Checker(
            model_id=A.model,
            sampling=Sampling(1.0),
            extensions=[".mp4"],
            catalog=self.store.catalog,
            frames=self.store.frames,
            lister=Listing(),
            sink=None,
            in_flight_grace_s=60.0,
            new_object_grace_s=60.0,
            models=lambda: list(self.live),
            frames_for=self.store.frames_table,
        )


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def job(key: str = "a.mp4", op: JobOp = JobOp.INDEX) -> IndexJob:
    return IndexJob(op=op, bucket="videos", key=key, source=JobSource.EVENT)


def test_a_job_writes_every_live_table_and_an_entry_for_each(world: World) -> None:
    head = world.upload(seconds=3)
    result = world.indexer().run(job())
    assert result.outcome is Outcome.INDEXED and result.frames == 3
    record = world.store.catalog.get(job().video_id)
    assert record is not None and record.status is VideoStatus.INDEXED and record.version == head.version
    assert [i.table for i in record.indexes] == [A.table, B.table]  # active first
    for t in (A, B):
        entry = record.index_in(t.table)
        assert entry is not None and entry.model == t.model and entry.sampling == Sampling(1.0) and entry.frames == 3
        assert entry.fingerprint == fingerprint(head.version, t.model, Sampling(1.0))
        summary = world.store.frames_table(t.table).summary(record.video_id)
        assert summary.rows == 3 and set(summary.fingerprints) == {entry.fingerprint} and summary.duplicate_ids == 0
        assert world.dim_of(t) == t.dim
    assert record.fingerprint == record.indexes[0].fingerprint and record.frames == 3
    assert world.embedded(A) == world.embedded(B) == 3


def test_a_job_embeds_only_the_models_whose_rows_are_missing(world: World) -> None:
    world.upload(seconds=3)
    world.live = [A]
    world.indexer().run(job())
    before = world.store.catalog.get(job().video_id)
    a_table = world.store.frames_table(A.table).table()
    assert before is not None and a_table is not None and world.embedded(A) == 3
    a_version = a_table.version
    world.live = [A, B]  # a backfill to B began

    assert world.indexer().run(job()).outcome is Outcome.INDEXED

    assert world.embedded(A) == 3 and world.embedded(B) == 3  # only B embedded this time
    assert world.objects.downloads == 2
    after = world.store.catalog.get(job().video_id)
    assert after is not None and after.index_in(A.table) == before.index_in(A.table)
    assert after.index_in(B.table) is not None and after.index_in(B.table).frames == 3  # type: ignore[union-attr]
    a_table.checkout_latest()
    assert a_table.version == a_version  # A's rows were not rewritten
    # Both hold now: a further job embeds nothing.
    assert world.indexer().run(job()).outcome is Outcome.UNCHANGED and world.objects.downloads == 2


def test_a_delete_removes_rows_from_every_live_table_only(world: World) -> None:
    world.upload(seconds=2)
    world.live = [C]  # a table of a model no longer live (retired), holding the video
    world.indexer().run(job())
    world.live = [A, B]
    world.indexer().run(job())
    vid = job().video_id
    assert [world.store.frames_table(t.table).count(vid) for t in (A, B, C)] == [2, 2, 2]
    world.objects.files.pop("a.mp4")

    assert world.indexer().run(job(op=JobOp.DELETE)).outcome is Outcome.DELETED

    assert [world.store.frames_table(t.table).count(vid) for t in (A, B, C)] == [0, 0, 2]
    record = world.store.catalog.get(vid)
    assert record is not None and record.status is VideoStatus.DELETED and record.indexes == ()


def test_a_delete_on_a_lifecycle_read_before_a_backfill_began_removes_the_new_tables_rows_too(world: World) -> None:
    world.upload(seconds=2)
    world.indexer().run(job())  # a backfill job wrote the video into B as well as A
    vid = job().video_id
    world.objects.files.pop("a.mp4")

    # The delete job's lifecycle was read before the backfill began: only A is live to it.
    assert world.indexer(cached=[A]).run(job(op=JobOp.DELETE)).outcome is Outcome.DELETED

    assert [world.store.frames_table(t.table).count(vid) for t in (A, B)] == [0, 0]
    record = world.store.catalog.get(vid)
    assert record is not None and record.status is VideoStatus.DELETED and record.indexes == ()


def test_a_job_on_a_lifecycle_read_before_a_backfill_began_settles_with_the_new_table_too(world: World) -> None:
    head = world.upload(seconds=3)

    # Read before the backfill began: A alone; afresh, before it settles: A and B.
    assert world.indexer(cached=[A]).run(job()).outcome is Outcome.INDEXED

    record = world.store.catalog.get(job().video_id)
    assert record is not None and record.status is VideoStatus.INDEXED
    assert [i.table for i in record.indexes] == [A.table, B.table]
    for t in (A, B):
        summary = world.store.frames_table(t.table).summary(record.video_id)
        assert summary.rows == 3 and set(summary.fingerprints) == {fingerprint(head.version, t.model, Sampling(1.0))}
    assert world.checker().run(["videos"]).models == {A.model: 0, B.model: 0}


def test_a_backfill_job_that_fails_writing_the_new_table_keeps_the_active_models_entry(world: World) -> None:
    world.upload(seconds=2)
    world.live = [A]
    world.indexer().run(job())
    vid = job().video_id
    world.live = [A, B]

    def fail_b(table: str) -> Any:
        class Failing:
            def replace(self, frames: Any) -> None:
                raise TransientError("the store did not take the commit")

        return Failing() if table == B.table else world.store.frames_table(table)

    indexer = Indexer(
        Settings(),
        world.embedders.for_model(A.model),
        world.store,
        world.objects,
        models=lambda: list(world.live),
        embedders=world.embedders,
        writer_for=fail_b,
    )
    with pytest.raises(TransientError):
        indexer.run(job())

    record = world.store.catalog.get(vid)
    assert record is not None and record.status is VideoStatus.INDEXING and record.frames == -1
    # A's rows were not touched: its entry stays, so the video is still searchable and, failed or
    # not, still needs the new model before any switch (pipeline/upkeep/backfill.py).
    assert record.index_in(A.table) is not None and record.index_in(B.table) is None
    assert world.checker().run(["videos"]).models[A.model] == 0


def test_a_new_upload_is_indexed_with_the_active_model_when_the_target_cannot_embed(world: World) -> None:
    world.upload(seconds=2)
    indexer = broken_target(world)
    assert indexer.run(job()).outcome is Outcome.INDEXED
    record = world.store.catalog.get(job().video_id)
    assert record is not None and [i.table for i in record.indexes] == [A.table]
    assert world.store.frames_table(B.table).count(record.video_id) == 0


def test_indexing_leaves_rows_of_tables_not_live_alone(world: World) -> None:
    world.upload("c.mp4", seconds=2, seed=3)
    world.live = [C]
    world.indexer().run(job("c.mp4"))
    c_rows = world.store.frames_table(C.table).summary(job("c.mp4").video_id)
    world.live = [A, B]
    world.upload("c.mp4", seconds=3, seed=4)  # overwritten: new content
    world.indexer().run(job("c.mp4"))
    assert world.store.frames_table(C.table).summary(job("c.mp4").video_id) == c_rows
    assert world.embedded(C) == 2


def test_a_job_with_only_the_active_model_live_writes_only_its_entry(world: World) -> None:
    world.upload(seconds=2)
    world.live = [A]
    assert world.indexer().run(job()).outcome is Outcome.INDEXED
    record = world.store.catalog.get(job().video_id)
    assert record is not None and [i.table for i in record.indexes] == [A.table]
    assert world.store.frames_table(B.table).count() == 0 and world.embedded(B) == 0


class PauseAt:
    """Hooks that hold the job at ``step`` (the first time) until released."""

    def __init__(self, step: str) -> None:
        self.step = step
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, step: str, _job: IndexJob) -> None:
        if step == self.step and not self.reached.is_set():
            self.reached.set()
            assert self.release.wait(WAIT_S), "never released"


@pytest.mark.parametrize("step", ["claim", "write", "written", "finish"])
def test_two_jobs_of_one_video_racing_leave_one_set_of_rows_per_table(world: World, step: str) -> None:
    head = world.upload(seconds=3)
    pause = PauseAt(step)
    results: list[Any] = []

    def first() -> None:
        try:
            results.append(world.indexer(pause).run(job(), "t1"))
        except BaseException as exc:
            results.append(exc)

    paused = threading.Thread(target=first)
    paused.start()
    assert pause.reached.wait(WAIT_S)
    # The second job (a redelivery, another consumer) runs whole while the first is held at ``step``.
    second = world.indexer().run(job(), "t2")
    pause.release.set()
    paused.join(WAIT_S)
    assert not paused.is_alive()
    (first_result,) = results
    assert not isinstance(first_result, BaseException), first_result
    assert second.outcome is Outcome.INDEXED and first_result.outcome in (Outcome.INDEXED, Outcome.UNCHANGED)

    vid = job().video_id
    record = world.store.catalog.get(vid)
    assert record is not None and record.status is VideoStatus.INDEXED and record.version == head.version
    for t in (A, B):
        summary = world.store.frames_table(t.table).summary(vid)
        entry = record.index_in(t.table)
        assert entry is not None and entry.fingerprint == fingerprint(head.version, t.model, Sampling(1.0))
        assert summary.rows == entry.frames == 3 and summary.duplicate_ids == 0
        assert set(summary.fingerprints) == {entry.fingerprint}
    report = world.checker().run(["videos"])
    assert report.inconsistencies == 0, report.found
    assert report.in_sync == 1 and report.models == {A.model: 0, B.model: 0}


def backfill_job(key: str = "a.mp4") -> IndexJob:
    return IndexJob(op=JobOp.INDEX, bucket="videos", key=key, source=JobSource.REINDEX)


class Letters:
    """A dead-letter queue that keeps what it was given."""

    def __init__(self) -> None:
        self.letters: list[DeadLetter] = []

    def publish(self, letter: DeadLetter) -> None:
        self.letters.append(letter)


def broken_target(
    world: World, hooks: Callable[[str, IndexJob], None] | None = None, *, claim_after_s: float | None = None
) -> Indexer:
    """An indexer on ``world`` whose target model B won't load (the Encoder answers it with a failure);
    ``claim_after_s``: the jobs' ``serve.claim_after_s`` (None: the default)."""

    class Broken:
        model_id = B.model

        def embed_images(self, images: Any) -> Any:
            raise EncoderUnavailable("the encoder could not load model 'model-b'")

    class Embedders:
        def for_model(self, model_id: str) -> Any:
            return Broken() if model_id == B.model else world.embedders.for_model(model_id)

    serve = {} if claim_after_s is None else {"claim_after_s": claim_after_s}
    return Indexer(
        Settings.model_validate({"serve": serve}),
        world.embedders.for_model(A.model),
        world.store,
        world.objects,
        models=lambda: list(world.live),
        models_now=lambda: list(world.live),
        embedders=Embedders(),
        **({"hooks": hooks} if hooks is not None else {}),
    )


@pytest.mark.parametrize("unsettled", [False, True], ids=["indexed", "left-unsettled-by-an-earlier-attempt"])
def test_a_backfill_job_whose_new_model_wont_load_leaves_the_video_indexed(world: World, unsettled: bool) -> None:
    """The target can't embed (its model won't load) and only the target was missing: the row goes
    back to indexed with the active model's entry instead of staying claimed, and the consumer's last
    attempt dead-letters the job without marking the video failed (the backfill submits it again).
    Also when an earlier attempt had left the row unsettled (frames -1) after writing B's rows."""
    world.upload(seconds=2)
    world.live = [A]
    world.indexer().run(job())
    vid = job().video_id
    before = world.store.catalog.get(vid)
    assert before is not None and before.status is VideoStatus.INDEXED and before.frames == 2
    world.live = [A, B]
    if unsettled:
        gone = world.store.catalog.get(vid)
        assert gone is not None
        left = gone.evolve(status=VideoStatus.INDEXING, frames=-1, fingerprint=None, error="a job left its rows")
        assert world.store.catalog.write(left, gone.rev) is not None

    indexer = broken_target(world)
    with pytest.raises(EncoderUnavailable):
        indexer.run(backfill_job())
    record = world.store.catalog.get(vid)
    assert record is not None and record.status is VideoStatus.INDEXED and record.version == before.version
    assert record.indexes == before.indexes and (record.frames, record.fingerprint) == (2, before.fingerprint)
    assert record.error is None

    letters = Letters()
    handler = IndexTaskHandler(indexer, letters, max_retries=0)
    answer = handler.handle(backfill_job().model_dump(mode="json"), TaskContext("t-1", retries=0))
    assert answer["outcome"] == "failed" and [letter.kind for letter in letters.letters] == [FailureKind.EXHAUSTED]
    after = world.store.catalog.get(vid)
    assert after is not None and after.status is VideoStatus.INDEXED and after.indexes == before.indexes
    report = world.checker().run(["videos"])
    assert report.inconsistencies == 0 and report.models[A.model] == 0


def test_a_backfill_job_failing_across_a_switch_leaves_the_row_claimed_for_its_retry(world: World) -> None:
    """The switch made B active while the job embedded: putting the row back to indexed with A's
    entry only would settle it without the active model's rows, so it stays claimed (in flight). The
    job claims at once (a first start shorter than ``claim_after_s`` writes no claim, and the switch
    waits for its row, which still lacks B)."""
    world.upload(seconds=2)
    world.live = [A]
    world.indexer().run(job())
    world.live = [A, B]

    def switch(step: str, job: IndexJob) -> None:
        if step == "fetch":  # the switch lands while the job fetches and embeds
            world.live = [B]

    indexer = broken_target(world, hooks=switch, claim_after_s=0)
    with pytest.raises(EncoderUnavailable):
        indexer.run(backfill_job())
    record = world.store.catalog.get(job().video_id)
    assert record is not None and record.status is VideoStatus.INDEXING
