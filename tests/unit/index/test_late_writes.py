"""A catalog write whose caller gave up (a stalled CatalogWriter) that lands after the task's next start
has run: the real ``IndexTaskHandler`` and ``Indexer`` over a local LanceDB, the stalled writer a
stand-in that holds writes and lands them — each a compare-and-set on the revision its caller read —
when released (as a SIGSTOPped writer does once resumed)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from events.jobs import JobOp
from infra.dev.samples import write_video
from pipeline.index.consumer import IndexTaskHandler, TaskContext
from pipeline.index.indexer import Indexer
from pipeline.settings import Settings
from storage.catalog import VideoRecord, VideoStatus
from storage.commits.catalog import DirectWrites, GroupedCatalogWriter, PendingWrite
from storage.errors import TransientError
from storage.tables import IndexStore
from tests.unit.index.test_indexer import MeanColour, MemoryObjects, job


class _GaveUp:
    def result(self, timeout_s: float) -> VideoRecord | None:
        raise TransientError(f"catalog write failed: TimeoutError (deadline {timeout_s:g}s)")


class StalledWriter:
    """Catalog writes taken while ``stalled()``: the caller gets no outcome (it gives up), the write is
    kept; ``resume`` lands them in order, each a compare-and-set on the revision its caller read."""

    def __init__(self, store: IndexStore, stalled: Callable[[], bool]) -> None:
        self.direct = DirectWrites(store.catalog)
        self.stalled = stalled
        self.held: list[tuple[VideoRecord, int]] = []

    def submit(self, record: VideoRecord, expected_rev: int) -> PendingWrite:
        if self.stalled():
            self.held.append((record, expected_rev))
            return _GaveUp()
        return self.direct.submit(record, expected_rev)

    def resume(self) -> list[bool]:
        landed = [self.direct.submit(r, rev).result(0) is not None for r, rev in self.held]
        self.held.clear()
        return landed


@pytest.mark.parametrize("claim_after_s", [0.0, 60.0], ids=["claimed", "one-write"])
@pytest.mark.parametrize("writer_back", [True, False], ids=["writer-back-for-the-retry", "still-stalled"])
def test_a_claim_landing_after_its_retry_found_the_object_gone_is_not_the_rows_last_word(
    tmp_path: Path, writer_back: bool, claim_after_s: float
) -> None:
    # The first start's write the stalled writer holds: its claim, or (a start shorter than
    # claim_after_s writes no claim) its one settling write.
    settings = Settings.model_validate({"serve": {"claim_after_s": claim_after_s}})
    store = IndexStore(settings.s3, uri=str(tmp_path / "lance"))
    objects = MemoryObjects()
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=2, seed=1))
    stalled = [True]
    writes = StalledWriter(store, lambda: stalled[0])
    indexer = Indexer(settings, MeanColour(), store, objects, catalog_writes=writes)
    letters: list[object] = []
    handler = IndexTaskHandler(indexer, SimpleNamespace(publish=letters.append), max_retries=3)
    upload = job("a.mp4").model_dump(mode="json")
    # Given an upload's first start whose claim the stalled writer took without an answer
    with pytest.raises(TransientError):
        handler.handle(upload, TaskContext("t-up", retries=0))
    # Held: the claim; or the settle and, its outcome in doubt, the job's unsettle after it.
    held = [VideoStatus.INDEXING] if claim_after_s == 0 else [VideoStatus.INDEXED, VideoStatus.INDEXING]
    assert [r.status for r, _ in writes.held] == held
    # And the object deleted before its retry (the delete's own job not run yet, or routed unmarked)
    del objects.files["a.mp4"]
    stalled[0] = not writer_back
    retried = False
    try:
        handler.handle(upload, TaskContext("t-up", retries=1))
    except TransientError:
        assert not writer_back
        retried = True  # its own write held too: the task queue retries it
    # When the stalled writer resumes and lands what it held
    writes.resume()
    stalled[0] = False
    if retried:
        handler.handle(upload, TaskContext("t-up", retries=2))
    # Then the claim is not the row's last word: the row says the video is gone
    row = store.catalog.get(job("a.mp4").video_id)
    assert row is not None and row.status is VideoStatus.DELETED, row
    assert store.frames.count(job("a.mp4").video_id) == 0 and not letters


def test_a_redelivered_task_writes_the_row_even_when_nothing_changed(tmp_path: Path) -> None:
    settings = Settings()
    store = IndexStore(settings.s3, uri=str(tmp_path / "lance"))
    objects = MemoryObjects()
    indexer = Indexer(settings, MeanColour(), store, objects)
    handler = IndexTaskHandler(indexer, SimpleNamespace(publish=lambda _l: None), max_retries=3)
    payload = job("gone.mp4", JobOp.DELETE).model_dump(mode="json")
    assert handler.handle(payload, TaskContext("t-1", retries=0))["outcome"] == "unchanged"
    assert store.catalog.get(job("gone.mp4").video_id) is None  # a first start finding nothing writes nothing
    handler.handle(payload, TaskContext("t-1", retries=0, redelivered=True))
    row = store.catalog.get(job("gone.mp4").video_id)
    assert row is not None and row.status is VideoStatus.DELETED  # a redelivery fences an earlier start's write


@pytest.mark.parametrize("op", [JobOp.INDEX, JobOp.DELETE])
def test_concurrent_redeliveries_of_a_settled_video_settle_it_with_one_write(tmp_path: Path, op: JobOp) -> None:
    # A dropped broker connection hands each unacknowledged task out again: every copy must write the
    # row (an earlier start's write may still land), but once one copy's write moved the row past what
    # they all first read, no earlier write can land any more, and the others leave the row as it is.
    # Before: each copy rewrote it; one won a round, the rest went round again and ran out of rounds.
    copies = 8  # more than MAX_CONVERGE_ROUNDS: one winner a round can't settle them all
    settings = Settings()
    store = IndexStore(settings.s3, uri=str(tmp_path / "lance"))
    objects = MemoryObjects()
    key = "a.mp4"
    objects.put(key, write_video(tmp_path / key, seconds=2, seed=1))
    first = Indexer(settings, MeanColour(), store, objects)
    first.run(job(key))
    if op is JobOp.DELETE:
        del objects.files[key]
        first.run(job(key, JobOp.DELETE))
    before = store.catalog.get(job(key).video_id)
    assert before is not None
    # Every copy reads the row before any of them writes (their first rounds run side by side).
    all_read = threading.Barrier(copies, timeout=30)
    rounds: dict[int, int] = {}

    def hooks(step: str, _job: object) -> None:
        if step == "read":
            me = threading.get_ident()
            rounds[me] = rounds.get(me, 0) + 1
        elif step == "head" and rounds[threading.get_ident()] == 1:
            all_read.wait()

    # The copies' writes go through one grouped writer, as through the CatalogWriter deployment.
    writes = GroupedCatalogWriter(store.catalog, min_interval_s=0.05)
    indexer = Indexer(settings, MeanColour(), store, objects, catalog_writes=writes, hooks=hooks)
    handler = IndexTaskHandler(indexer, SimpleNamespace(publish=lambda _l: None), max_retries=0)
    payload = job(key, op).model_dump(mode="json")
    try:
        with ThreadPoolExecutor(copies) as pool:
            answers = list(
                pool.map(
                    lambda _: handler.handle(payload, TaskContext("t-1", retries=0, redelivered=True)), range(copies)
                )
            )
    finally:
        writes.close()
    assert [a["outcome"] for a in answers] == ["unchanged"] * copies, answers
    after = store.catalog.get(job(key).video_id)
    assert after is not None and after.status is before.status
    assert after.rev == before.rev + 1, (before.rev, after.rev)  # one copy's write; the others wrote nothing
