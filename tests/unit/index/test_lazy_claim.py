"""The lazy claim (pipeline/index/settle.py ``Claim``, docs/design/state-machine.md "The lazy claim"): a
first start shorter than ``serve.claim_after_s`` settles with one catalog write; a longer one, a retry and a
redelivery claim; a job that wrote no claim loses its settle to any change of the row and goes round."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from pathlib import Path

import pytest

from events.jobs import IndexJob
from pipeline.index.indexer import Indexer, Outcome
from pipeline.index.settle import Claim
from pipeline.jobs.videostate import VideoStates
from pipeline.settings import Settings
from storage.catalog import VideoRecord, VideoStatus
from storage.commits.catalog import DirectWrites, PendingWrite
from storage.tables import IndexStore
from tests.media import write_video
from tests.unit.index.test_indexer import MeanColour, MemoryObjects, job


class CountedWrites:
    """Direct catalog writes, each status written kept in order."""

    def __init__(self, store: IndexStore) -> None:
        self._direct = DirectWrites(store.catalog)
        self.statuses: list[VideoStatus] = []

    def submit(self, record: VideoRecord, expected_rev: int) -> PendingWrite:
        self.statuses.append(record.status)
        return self._direct.submit(record, expected_rev)


def parts(
    tmp_path: Path, claim_after_s: float, **kw: object
) -> tuple[Indexer, IndexStore, MemoryObjects, CountedWrites]:
    settings = Settings.model_validate({"serve": {"claim_after_s": claim_after_s}})
    store = IndexStore(settings.s3, uri=str(tmp_path / "lance"))
    objects = MemoryObjects()
    writes = CountedWrites(store)
    indexer = Indexer(settings, MeanColour(), store, objects, catalog_writes=writes, **kw)  # type: ignore[arg-type]
    return indexer, store, objects, writes


def test_a_short_first_start_settles_with_one_catalog_write(tmp_path: Path) -> None:
    indexer, store, objects, writes = parts(tmp_path, claim_after_s=60)
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=3, seed=1))
    assert indexer.run(job("a.mp4"), "t1").outcome is Outcome.INDEXED
    assert writes.statuses == [VideoStatus.INDEXED]
    record = store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.status is VideoStatus.INDEXED and record.frames == 3
    # What the claim would have written is in the one write: the model, the sampling, the marker.
    assert record.model == MeanColour.model_id and record.sampling and record.task_id == "t1"
    assert store.frames.count(record.video_id) == 3


def test_a_start_that_outlives_claim_after_s_claims_while_it_runs(tmp_path: Path) -> None:
    seen_mid_job: list[VideoRecord | None] = []
    stores: list[IndexStore] = []

    def slow(step: str, j: IndexJob) -> None:
        if step == "fetch":
            time.sleep(0.3)  # a fetch longer than claim_after_s: the claim's timer fires meanwhile
        if step == "embedded":  # not written yet
            seen_mid_job.append(stores[0].catalog.get(j.video_id))

    indexer, store, objects, writes = parts(tmp_path, claim_after_s=0.1, hooks=slow)
    stores.append(store)
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=2, seed=1))
    assert indexer.run(job("a.mp4"), "t1").outcome is Outcome.INDEXED
    claimed = seen_mid_job[0]
    assert claimed is not None and claimed.status is VideoStatus.INDEXING and claimed.task_id == "t1"
    assert writes.statuses == [VideoStatus.INDEXING, VideoStatus.INDEXED]


@pytest.mark.parametrize("how", ["redelivered", "retry"])
def test_a_redelivered_or_retried_start_claims_at_once(tmp_path: Path, how: str) -> None:
    indexer, _store, objects, writes = parts(tmp_path, claim_after_s=60)
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=2, seed=1))
    if how == "redelivered":
        indexer.run(job("a.mp4"), "t1", redelivered=True)
    else:
        indexer.run(job("a.mp4"), "t1", attempt=1)
    assert writes.statuses == [VideoStatus.INDEXING, VideoStatus.INDEXED]


def test_a_job_without_a_claim_loses_to_a_racing_job_and_goes_round(tmp_path: Path) -> None:
    """Two jobs of one key race with no claims: the first writes its rows (version 1); held right after
    that, a second job of version 2 runs whole on another thread and settles. The first's settle finds the
    row changed since it read it, loses, goes round and converges on version 2."""
    others: list[Indexer] = []
    raced: list[Outcome] = []

    def race(step: str, j: IndexJob) -> None:
        if step == "written" and not raced:
            objects.put("a.mp4", v2)
            racer = threading.Thread(target=lambda: raced.append(others[0].run(job("a.mp4"), "t2").outcome))
            racer.start()
            racer.join(30)

    indexer, store, objects, writes = parts(tmp_path, claim_after_s=60, hooks=race)
    others.append(Indexer(Settings(), MeanColour(), store, objects))
    objects.put("a.mp4", write_video(tmp_path / "v1.mp4", seconds=2, seed=1))
    v2 = write_video(tmp_path / "v2.mp4", seconds=3, seed=2)
    result = indexer.run(job("a.mp4"), "t1")
    assert raced == [Outcome.INDEXED]
    record = store.catalog.get(job("a.mp4").video_id)
    assert record is not None and record.status is VideoStatus.INDEXED and record.frames == 3
    summary = store.frames.summary(record.video_id)
    assert (summary.rows, summary.duplicate_ids, set(summary.fingerprints)) == (3, 0, {record.fingerprint})
    # The first job's settle of version 1 went out once, on the revision it read, and lost (the row had
    # changed since: version 2's is the row above); its second round found version 2 settled over the rows
    # that hold it, and left them.
    assert writes.statuses == [VideoStatus.INDEXED] and result.outcome is Outcome.UNCHANGED


@pytest.mark.parametrize("claim_after_s", [60, 0.05])
def test_a_job_whose_row_did_not_move_settles_without_reading_it_again(tmp_path: Path, claim_after_s: float) -> None:
    """The settle goes on the row the job last knew (the one it read, or its claim's outcome): the row is read
    once, when the job starts, whether the job claimed or not."""
    slow = (lambda step, j: time.sleep(0.2) if step == "fetch" else None) if claim_after_s < 1 else None
    indexer, store, objects, writes = parts(tmp_path, claim_after_s=claim_after_s, **({"hooks": slow} if slow else {}))
    reads: list[str] = []
    get = store.catalog.get

    def counted_get(video_id: str) -> VideoRecord | None:
        reads.append(video_id)
        return get(video_id)

    store.catalog.get = counted_get  # type: ignore[method-assign]
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=2, seed=1))
    assert indexer.run(job("a.mp4"), "t1").outcome is Outcome.INDEXED
    claims = [VideoStatus.INDEXING] if claim_after_s < 1 else []
    assert writes.statuses == [*claims, VideoStatus.INDEXED]
    assert reads == [job("a.mp4").video_id]


def test_the_timer_and_the_skip_exclude_each_other() -> None:
    """Skips racing the claim's timer on threads: each claim is written exactly once or never, and
    ``skip`` says which."""
    rng = random.Random(7)
    outcomes = {"written": 0, "skipped": 0}
    for _ in range(300):
        written: list[VideoRecord] = []
        claim = Claim(
            written.append,  # type: ignore[arg-type]
            VideoRecord(video_id="v", uri="s3://b/k", status=VideoStatus.INDEXING),
            None,
            after_s=0.002,
        )
        time.sleep(rng.uniform(0, 0.004))
        skipped = claim.skip()
        time.sleep(0.005)  # a timer that lost must not write late
        assert len(written) == (0 if skipped else 1)
        outcomes["skipped" if skipped else "written"] += 1
    assert min(outcomes.values()) > 0, outcomes


def test_a_job_that_leaves_before_its_claim_timer_fires_leaves_no_claim_behind(tmp_path: Path) -> None:
    """A start that fails early (here: at the fetch step) while its claim's timer is pending: the timer
    must not write the claim after the job left (``indexing`` with no job alive)."""

    class Crash(Exception):
        pass

    def crash(step: str, j: IndexJob) -> None:
        if step == "fetch":
            raise Crash

    indexer, store, objects, writes = parts(tmp_path, claim_after_s=0.05, hooks=crash)
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=2, seed=1))
    with pytest.raises(Crash):
        indexer.run(job("a.mp4"), "t1")
    time.sleep(0.3)  # the timer would have fired by now
    assert writes.statuses == [] and store.catalog.get(job("a.mp4").video_id) is None


@pytest.mark.parametrize("claim_after_s", [0.0, 60.0], ids=["eager", "lazy"])
def test_a_job_that_finds_the_row_wrong_rewrites_it_and_a_late_queued_mark_loses(
    tmp_path: Path, claim_after_s: float
) -> None:
    """An ``indexed`` row whose entry says 5 rows where the table holds 3 (what the check repairs): the
    repair's job rewrites rows and row; the repair's ``queued`` mark, a compare-and-set on the row its
    submit read, lands late and must lose (the job always writes the row). A job that wrote no claim
    must not take the row it read for a twin's settle."""
    indexer, store, objects, _writes = parts(tmp_path, claim_after_s=claim_after_s)
    objects.put("a.mp4", write_video(tmp_path / "a.mp4", seconds=3, seed=1))
    upload = job("a.mp4")
    assert indexer.run(upload, "t0").outcome is Outcome.INDEXED
    row = store.catalog.get(upload.video_id)
    assert row is not None
    wrong = row.evolve(frames=5, indexes=tuple(dataclasses.replace(e, frames=5) for e in row.indexes))
    before = store.catalog.write(wrong, row.rev)
    assert before is not None
    indexer.run(upload.model_copy(update={"settle": True}), "t1")
    now = store.catalog.get(upload.video_id)
    assert now is not None and now.status is VideoStatus.INDEXED and now.frames == 3
    assert [e.frames for e in now.indexes] == [3] and store.frames.count(upload.video_id) == 3
    assert VideoStates(store.catalog).queue_async(upload, before).result(10) is None  # type: ignore[union-attr]
    final = store.catalog.get(upload.video_id)
    assert final is not None and final.status is VideoStatus.INDEXED
