"""storage/commits/frames.py: grouped frame commits over a local-directory LanceDB (what one commit of several
videos does to the table is tests/unit/storage/test_frames.py's)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import lancedb
import numpy as np
import pytest
from numpy.typing import NDArray

from events.jobs import IndexJob, JobOp, JobSource
from pipeline.index.indexer import Indexer, Outcome
from pipeline.settings import Settings
from storage.commits.frames import GroupedFrameWriter
from storage.db import sql_quote
from storage.errors import TransientError
from storage.frames import FrameRow, VideoFrames
from storage.s3 import ObjectHead
from storage.tables import IndexStore
from tests.media import write_video

DIM = 8
ROOT = Path(__file__).resolve().parents[4]


def rows(video_id: str, n: int, *, seed: int) -> list[FrameRow]:
    rng = np.random.default_rng(seed)
    vectors = rng.normal(size=(n, DIM)).astype(np.float32)
    return [FrameRow(f"{video_id}-{i:06d}", float(i), vectors[i], b"jpg" + bytes([seed % 256])) for i in range(n)]


def frames(video_id: str, n: int, *, seed: int, version: str = "v1") -> VideoFrames:
    return VideoFrames(
        video_id=video_id,
        uri=f"s3://videos/{video_id}",
        version=version,
        fingerprint=f"fp-{version}",
        model="m",
        rows=rows(video_id, n, seed=seed),
    )


def removal(video_id: str) -> VideoFrames:
    return VideoFrames(video_id, f"s3://videos/{video_id}", "", "", "", [])


def table_version(db_dir: Path) -> int:
    return int(lancedb.connect(str(db_dir)).open_table("frames").version)


def column(store: IndexStore, video_id: str, name: str) -> list[str]:
    table = store.frames.table()
    if table is None:
        return []
    got = table.search().where(f"video_id = {sql_quote(video_id)}").select([name]).limit(None).to_list()
    return sorted(r[name] for r in got)


def frame_ids(store: IndexStore, video_id: str) -> list[str]:
    return column(store, video_id, "frame_id")


def versions_of(store: IndexStore, video_id: str) -> set[str]:
    return set(column(store, video_id, "version"))


@pytest.fixture
def db_dir(tmp_path: Path) -> Path:
    return tmp_path / "lance"


@pytest.fixture
def store(db_dir: Path) -> IndexStore:
    return IndexStore(Settings().s3, uri=str(db_dir))


def submit_all(writer: GroupedFrameWriter, videos: Sequence[VideoFrames]) -> dict[str, BaseException | None]:
    """Each video from its own thread, as Celery's worker threads do; what each call raised."""
    outcome: dict[str, BaseException | None] = {}

    def one(v: VideoFrames) -> None:
        try:
            writer.replace(v)
            outcome[v.video_id] = None
        except BaseException as exc:
            outcome[v.video_id] = exc

    threads = [threading.Thread(target=one, args=(v,)) for v in videos]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcome


def test_concurrent_jobs_share_commits(store: IndexStore, db_dir: Path) -> None:
    store.frames.replace_many([frames(f"v{i}", 6, seed=i) for i in range(8)] + [frames("other", 2, seed=99)])
    before = table_version(db_dir)
    writer = GroupedFrameWriter(store.frames, max_videos=8, wait_s=5.0)
    try:
        outcome = submit_all(writer, [frames(f"v{i}", 3, seed=10 + i, version="v2") for i in range(8)])
    finally:
        writer.close()
    assert outcome == {f"v{i}": None for i in range(8)}
    # Eight jobs, one commit (the group filled before the wait ran out).
    assert table_version(db_dir) - before == 1
    assert writer.stats.commits == 1 and writer.stats.videos == 8 and writer.stats.rows == 24
    for i in range(8):
        assert frame_ids(store, f"v{i}") == [f"v{i}-{k:06d}" for k in range(3)]
        assert versions_of(store, f"v{i}") == {"v2"}
    assert len(frame_ids(store, "other")) == 2


def test_group_limits_split_commits(store: IndexStore, db_dir: Path) -> None:
    store.frames.replace_many([frames("seed", 1, seed=0)])
    before = table_version(db_dir)
    writer = GroupedFrameWriter(store.frames, max_videos=3, max_rows=100, wait_s=0.5)
    try:
        outcome = submit_all(writer, [frames(f"v{i}", 2, seed=i) for i in range(7)])
    finally:
        writer.close()
    assert all(e is None for e in outcome.values()) and len(outcome) == 7
    assert 3 <= table_version(db_dir) - before <= 7
    assert store.frames.count() == 1 + 14


def test_wait_is_bounded_and_a_full_group_does_not_wait(store: IndexStore) -> None:
    store.frames.replace_many([frames("seed", 1, seed=0)])  # the table exists: commits are quick
    writer = GroupedFrameWriter(store.frames, max_videos=2, wait_s=0.4)
    try:
        started = time.monotonic()
        writer.replace(frames("alone", 2, seed=1))
        alone_s = time.monotonic() - started
        assert 0.35 <= alone_s < 0.4 + 10
    finally:
        writer.close()
    patient = GroupedFrameWriter(store.frames, max_videos=2, wait_s=60.0)
    try:
        started = time.monotonic()
        outcome = submit_all(patient, [frames("p", 1, seed=2), frames("q", 1, seed=3)])
        assert outcome == {"p": None, "q": None}
        assert time.monotonic() - started < 30  # full at two videos: no 60 s wait
    finally:
        patient.close()


def test_with_no_job_on_its_way_a_write_does_not_wait_for_company(store: IndexStore) -> None:
    store.frames.replace_many([frames("seed", 1, seed=0)])
    writer = GroupedFrameWriter(store.frames, max_videos=8, wait_s=60.0, expected=lambda: 0)
    try:
        started = time.monotonic()
        writer.replace(frames("alone", 2, seed=1))
        assert time.monotonic() - started < 30  # not the 60 s wait for company
    finally:
        writer.close()
    assert frame_ids(store, "alone") == ["alone-000000", "alone-000001"]


def test_a_write_waits_for_the_job_on_its_way_and_is_taken_with_it_as_soon_as_it_arrives(
    store: IndexStore, db_dir: Path
) -> None:
    """The first write finds another job decoding: it waits (60 s at most). That job's write arrives with
    nobody else on the way, and the two go in one commit at once: not when the 60 s run out, nor for a full
    group (8 videos)."""
    store.frames.replace_many([frames("seed", 1, seed=0)])
    before = table_version(db_dir)
    on_its_way = [1]
    asked = threading.Event()

    def expected() -> int:
        asked.set()
        return on_its_way[0]

    writer = GroupedFrameWriter(store.frames, max_videos=8, wait_s=60.0, expected=expected)
    first = threading.Thread(target=writer.replace, args=(frames("first", 2, seed=1),))
    try:
        first.start()
        assert asked.wait(30)  # the writer holds the first write, a job on its way
        assert first.is_alive() and writer.stats.commits == 0
        on_its_way[0] = 0  # that job's slot is free: its write comes next
        started = time.monotonic()
        writer.replace(frames("second", 2, seed=2))
        first.join(30)
        assert time.monotonic() - started < 30
    finally:
        writer.close()
    assert not first.is_alive()
    assert writer.stats.commits == 1 and writer.stats.videos == 2
    assert table_version(db_dir) - before == 1


class RecordingStore:
    """Writes through to ``store``; fails the first ``fail`` commits it sees; records every group."""

    def __init__(self, store: IndexStore, fail: int = 0) -> None:
        self.store = store
        self.fail = fail
        self.groups: list[list[str]] = []

    def replace_many(self, videos: Sequence[VideoFrames], timeout: timedelta | None = None) -> None:
        self.groups.append([v.video_id for v in videos])
        if self.fail > 0:
            self.fail -= 1
            raise OSError("object store went away")
        self.store.frames.replace_many(videos, timeout)


def test_a_failed_group_is_committed_again_video_by_video(store: IndexStore) -> None:
    store.frames.replace_many([frames("a", 4, seed=1), frames("b", 4, seed=2)])
    failing = RecordingStore(store, fail=1)
    writer = GroupedFrameWriter(failing, max_videos=2, wait_s=5.0)
    try:
        outcome = submit_all(writer, [frames("a", 1, seed=3, version="v2"), frames("b", 1, seed=4, version="v2")])
    finally:
        writer.close()
    # The grouped commit failed; each video then went alone, and each alone succeeded.
    assert outcome == {"a": None, "b": None}
    assert sorted(failing.groups[0]) == ["a", "b"] and sorted(failing.groups[1:]) == [["a"], ["b"]]
    assert versions_of(store, "a") == {"v2"} and versions_of(store, "b") == {"v2"}
    assert writer.stats.commits == 2 and writer.stats.failed_commits == 1  # the grouped one


def test_a_commit_that_fails_alone_too_fails_its_jobs_and_the_writer_carries_on(store: IndexStore) -> None:
    store.frames.replace_many([frames("a", 4, seed=1), frames("b", 4, seed=2)])
    failing = RecordingStore(store, fail=3)  # the group, then each video alone
    writer = GroupedFrameWriter(failing, max_videos=2, wait_s=5.0)
    try:
        outcome = submit_all(writer, [frames("a", 1, seed=3, version="v2"), frames("b", 1, seed=4, version="v2")])
        assert set(outcome) == {"a", "b"}
        assert all(isinstance(e, TransientError) for e in outcome.values())
        assert all(isinstance(e.__cause__, OSError) for e in outcome.values() if e is not None)
        # Nothing of the failed commits is visible: the old rows are still there.
        assert versions_of(store, "a") == {"v1"} and versions_of(store, "b") == {"v1"}
        # The writer carries on: the retried jobs commit.
        again = submit_all(writer, [frames("a", 1, seed=3, version="v2"), frames("b", 1, seed=4, version="v2")])
        assert again == {"a": None, "b": None}
    finally:
        writer.close()
    assert sorted(failing.groups[0]) == ["a", "b"] and sorted(failing.groups[1:3]) == [["a"], ["b"]]
    assert versions_of(store, "a") == {"v2"} and writer.stats.failed_commits == 3  # the group, then each alone


def test_one_videos_invalid_rows_fail_only_that_video(store: IndexStore) -> None:
    store.frames.replace_many([frames("a", 2, seed=1), frames("c", 2, seed=3)])
    recording = RecordingStore(store)
    writer = GroupedFrameWriter(recording, max_videos=3, wait_s=5.0)
    wrong = np.ones(DIM + 1, dtype=np.float32)  # a vector of another size: the grouped commit raises ValueError
    bad = VideoFrames("bad", "s3://videos/bad", "v2", "fp-v2", "m", [FrameRow("bad-000000", 0.0, wrong, None)])
    try:
        outcome = submit_all(writer, [frames("a", 3, seed=4, version="v2"), bad, frames("c", 1, seed=5, version="v2")])
    finally:
        writer.close()
    assert sorted(recording.groups[0]) == ["a", "bad", "c"]  # they were tried together first
    assert outcome["a"] is None and outcome["c"] is None
    assert isinstance(outcome["bad"], Exception)
    assert frame_ids(store, "a") == [f"a-{k:06d}" for k in range(3)] and versions_of(store, "a") == {"v2"}
    assert frame_ids(store, "c") == ["c-000000"] and versions_of(store, "c") == {"v2"}
    assert frame_ids(store, "bad") == []


def test_two_jobs_of_one_video_commit_in_order(store: IndexStore) -> None:
    writer = GroupedFrameWriter(store.frames, max_videos=8, wait_s=0.3)
    done: list[str] = []

    def write(version: str, n: int, delay_s: float) -> None:
        time.sleep(delay_s)
        writer.replace(VideoFrames("a", "s3://videos/a", version, f"fp-{version}", "m", rows("a", n, seed=n)))
        done.append(version)

    first = threading.Thread(target=write, args=("v1", 3, 0.0))
    second = threading.Thread(target=write, args=("v2", 2, 0.05))
    try:
        first.start()
        second.start()
        first.join(30)
        second.join(30)
    finally:
        writer.close()
    assert sorted(done) == ["v1", "v2"]
    assert writer.stats.commits == 2  # never two copies of one key in one merge_insert
    assert versions_of(store, "a") == {"v2"} and len(frame_ids(store, "a")) == 2


class BlockingStore:
    def __init__(self, store: IndexStore) -> None:
        self.store = store
        self.release = threading.Event()
        self.groups: list[list[str]] = []

    def replace_many(self, videos: Sequence[VideoFrames], timeout: timedelta | None = None) -> None:
        self.groups.append([v.video_id for v in videos])
        self.release.wait(30)
        self.store.frames.replace_many(videos)


def test_a_job_that_times_out_is_withdrawn_and_one_being_written_waits_for_its_commit(store: IndexStore) -> None:
    blocking = BlockingStore(store)
    writer = GroupedFrameWriter(blocking, max_videos=1, wait_s=0.0, commit_timeout_s=0.5)
    slow: dict[str, BaseException | None] = {}
    try:
        slow_thread = threading.Thread(target=lambda: slow.update(submit_all(writer, [frames("slow", 1, seed=1)])))
        slow_thread.start()
        deadline = time.monotonic() + 10
        while not blocking.groups and time.monotonic() < deadline:
            time.sleep(0.01)
        # Queued behind the stuck commit, it gives up and is withdrawn before being written.
        late = submit_all(writer, [frames("late", 1, seed=2)])
        assert isinstance(late["late"], TransientError)
        # The one already being written outlives its timeout: its commit may still land, so it waits.
        time.sleep(0.6)
        assert slow_thread.is_alive()
        blocking.release.set()
        slow_thread.join(30)
        assert slow == {"slow": None}
    finally:
        blocking.release.set()
        writer.close()
    assert blocking.groups == [["slow"]]
    assert frame_ids(store, "late") == [] and len(frame_ids(store, "slow")) == 1
    with pytest.raises(TransientError, match="closed"):
        writer.replace(removal("x"))


# -- through the indexer ------------------------------------------------------------------------------


class MemoryObjects:
    """An object store in a dict: key -> file, its ETag the file's MD5."""

    def __init__(self) -> None:
        self.files: dict[str, Path] = {}

    def put(self, key: str, path: Path) -> None:
        self.files[key] = path

    def head(self, bucket: str, key: str) -> ObjectHead | None:
        path = self.files.get(key)
        if path is None:
            return None
        etag = hashlib.md5(path.read_bytes()).hexdigest()
        return ObjectHead(bucket, key, path.stat().st_size, etag, None, "video/mp4", None)

    def download(self, head: ObjectHead, dest: Path) -> int:
        shutil.copyfile(self.files[head.key], dest)
        return dest.stat().st_size


class MeanColour:
    """A stand-in encoder: the normalised mean colour and its square (different frames differ)."""

    model_id = "test/mean-colour"

    def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]:
        means = np.stack([img.reshape(-1, 3).mean(axis=0) for img in images]).astype(np.float32) + 1.0
        vectors = np.concatenate([means, means**2 / 255.0], axis=1)
        out: NDArray[np.float32] = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)
        return out


def job(key: str) -> IndexJob:
    return IndexJob(op=JobOp.INDEX, bucket="videos", key=key, source=JobSource.EVENT)


def test_a_job_that_dies_before_the_group_is_written_loses_nothing(store: IndexStore, tmp_path: Path) -> None:
    # Version 1 of three videos indexed, one commit each.
    plain = Indexer(Settings(), MeanColour(), store, objects := MemoryObjects())
    for i, key in enumerate(["a.mp4", "b.mp4", "c.mp4"]):
        objects.put(key, write_video(tmp_path / f"{key}.1.mp4", seconds=3, seed=i))
        assert plain.run(job(key)).outcome is Outcome.INDEXED
    old_b = frame_ids(store, job("b.mp4").video_id)
    # Version 2 of each (4 s), indexed by three concurrent jobs through one grouped writer; b's job
    # dies after embedding, before it hands over its rows (its consumer thread raises).
    for i, key in enumerate(["a.mp4", "b.mp4", "c.mp4"]):
        objects.put(key, write_video(tmp_path / f"{key}.2.mp4", seconds=4, seed=10 + i))
    writer = GroupedFrameWriter(store.frames, max_videos=3, wait_s=4.0)
    grouped = Indexer(Settings(), MeanColour(), store, objects, writer=writer)
    real_head = objects.head
    heads: dict[str, int] = {}

    def dying_head(bucket: str, key: str) -> ObjectHead | None:
        heads[key] = heads.get(key, 0) + 1
        if key == "b.mp4" and heads[key] == 2:  # the re-HEAD just before the write
            raise RuntimeError("consumer thread killed")
        return real_head(bucket, key)

    objects.head = dying_head  # type: ignore[method-assign]
    results: dict[str, object] = {}

    def run(key: str) -> None:
        try:
            results[key] = grouped.run(job(key)).outcome
        except Exception as exc:
            results[key] = exc

    threads = [threading.Thread(target=run, args=(k,)) for k in ["a.mp4", "b.mp4", "c.mp4"]]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert results["a.mp4"] is Outcome.INDEXED and results["c.mp4"] is Outcome.INDEXED
    assert isinstance(results["b.mp4"], RuntimeError)  # not acked: the broker redelivers it
    # The group did not wait for the dead job beyond its bound; a and c went in one commit.
    assert writer.stats.commits == 1 and writer.stats.videos == 2
    assert time.monotonic() - started < 60
    assert len(frame_ids(store, job("a.mp4").video_id)) == 4
    assert frame_ids(store, job("b.mp4").video_id) == old_b  # b keeps version 1's rows
    # Redelivered, b's job converges to version 2.
    objects.head = real_head  # type: ignore[method-assign]
    assert grouped.run(job("b.mp4")).outcome is Outcome.INDEXED
    writer.close()
    assert len(frame_ids(store, job("b.mp4").video_id)) == 4
    assert grouped.run(job("b.mp4")).outcome is Outcome.UNCHANGED


_DYING_CONSUMER = textwrap.dedent(
    """
    import sys, threading
    sys.path.insert(0, {root!r})
    from pipeline.settings import Settings
    from storage.tables import IndexStore
    from storage.commits.frames import GroupedFrameWriter
    from tests.unit.storage.commits.test_frames import frames

    store = IndexStore(Settings().s3, uri={db!r})
    writer = GroupedFrameWriter(store.frames, max_videos=10, wait_s=60.0)

    def job(name):
        writer.replace(frames(name, 2, seed=7, version="v2"))
        print("acked", name, flush=True)

    for name in ("a", "b"):
        threading.Thread(target=job, args=(name,), daemon=True).start()
    print("submitted", flush=True)
    threading.Event().wait(120)
    """
)


def test_a_consumer_killed_before_the_group_is_written_loses_nothing(
    store: IndexStore, db_dir: Path, tmp_path: Path
) -> None:
    store.frames.replace_many([frames("a", 5, seed=1), frames("b", 5, seed=2)])
    before = table_version(db_dir)
    script = tmp_path / "consumer.py"
    script.write_text(_DYING_CONSUMER.format(root=str(ROOT), db=str(db_dir)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "submitted"
        time.sleep(0.5)  # both jobs are waiting for their group (60 s wait, 10 videos)
    finally:
        proc.kill()
    out, _ = proc.communicate(timeout=30)
    assert "acked" not in out  # neither task was acknowledged: both are redelivered
    assert table_version(db_dir) == before
    assert versions_of(store, "a") == {"v1"} and len(frame_ids(store, "a")) == 5
    # Redelivered to another consumer, they converge.
    writer = GroupedFrameWriter(store.frames, max_videos=2, wait_s=5.0)
    try:
        assert submit_all(writer, [frames("a", 2, seed=7, version="v2"), frames("b", 2, seed=7, version="v2")]) == {
            "a": None,
            "b": None,
        }
    finally:
        writer.close()
    assert versions_of(store, "a") == {"v2"} and frame_ids(store, "b") == ["b-000000", "b-000001"]


class CancellableStore:
    """A commit that takes ``takes_s`` and, like Lance's merge with a timeout, is cancelled (never
    lands) when its timeout is shorter; ``landed`` holds the videos whose rows it committed, and when."""

    def __init__(self, store: IndexStore, takes_s: float) -> None:
        self.store = store
        self.takes_s = takes_s
        self.landed: list[tuple[str, float]] = []

    def replace_many(self, videos: Sequence[VideoFrames], timeout: timedelta | None = None) -> None:
        if timeout is not None and timeout.total_seconds() < self.takes_s:
            time.sleep(max(0.0, timeout.total_seconds()))
            raise RuntimeError("merge insert cancelled: timed out")
        time.sleep(self.takes_s)
        self.store.frames.replace_many(videos)
        self.landed += [(v.video_id, time.monotonic()) for v in videos]


def test_a_frame_commit_never_lands_after_its_caller_gave_up(
    store: IndexStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit takes 1 s, the caller waits 0.3 s (and, once the commit is under way, 0.2 s more):
    the merge runs under the caller's deadline and is cancelled, so the caller's error is the truth
    and no rows appear later (before: the commit ran on and landed after the caller had given up,
    so a retry or the next version's job could have its rows replaced by these)."""
    monkeypatch.setattr("storage.commits.frames.CLOSE_TIMEOUT_S", 0.2)
    slow = CancellableStore(store, takes_s=1.0)
    writer = GroupedFrameWriter(slow, max_videos=1, wait_s=0.0, commit_timeout_s=0.3)
    try:
        outcome = submit_all(writer, [frames("a", 2, seed=1)])
        gave_up = time.monotonic()
        assert isinstance(outcome["a"], TransientError)
        time.sleep(1.2)  # past when the commit would have landed
    finally:
        writer.close()
    assert [at for _vid, at in slow.landed if at > gave_up] == []
    assert frame_ids(store, "a") == []


def test_lance_cancels_a_merge_whose_timeout_passed_and_nothing_lands(store: IndexStore) -> None:
    """The real table: a merge given a timeout too short to finish raises, and its rows are not there."""
    store.frames.replace_many([frames("a", 2, seed=1)])
    with pytest.raises(TransientError):
        store.frames.replace_many([frames("a", 3, seed=2, version="v2")], timedelta(microseconds=1))
    assert versions_of(store, "a") == {"v1"} and len(frame_ids(store, "a")) == 2


def test_lance_cancels_a_removal_whose_timeout_passed_and_the_rows_stay(store: IndexStore) -> None:
    """A removal-only group runs as the same merge (no source rows) under the same deadline."""
    store.frames.replace_many([frames("a", 2, seed=1), frames("b", 1, seed=2)])
    with pytest.raises(TransientError):
        store.frames.replace_many([removal("a")], timedelta(microseconds=1))
    assert len(frame_ids(store, "a")) == 2
    store.frames.replace_many([removal("a")], timedelta(seconds=30))
    assert frame_ids(store, "a") == [] and len(frame_ids(store, "b")) == 1


class RecordsTimeouts:
    """A store that records each merge's videos and timeout, and fails a merge holding ``bad``."""

    def __init__(self, bad: str | None = None) -> None:
        self.bad = bad
        self.merges: list[tuple[list[str], float | None]] = []

    def replace_many(self, videos: Sequence[VideoFrames], timeout: timedelta | None = None) -> None:
        self.merges.append(([v.video_id for v in videos], timeout.total_seconds() if timeout else None))
        if self.bad is not None and any(v.video_id == self.bad for v in videos):
            raise ValueError("repeated frame ids")


def test_a_call_out_of_time_when_its_group_is_taken_is_dropped_and_the_rest_commit_under_their_deadline() -> None:
    """Taken by the writer thread with its deadline (nearly) gone, a call is answered with an error and left
    out of the merge; the others are merged with a timeout no later than their earliest deadline; when
    that merge fails, the retries video by video leave the dropped call out."""
    from storage.commits.frames import _Pending

    store = RecordsTimeouts(bad="b")
    writer = GroupedFrameWriter(store, max_videos=4, wait_s=0.0, commit_timeout_s=60)
    try:
        now = time.monotonic()
        late = _Pending(frames("late", 1, seed=1), deadline=now - 1)
        a = _Pending(frames("a", 1, seed=2), deadline=now + 30)
        b = _Pending(frames("b", 1, seed=3), deadline=now + 50)
        group = [late, a, b]
        with pytest.raises(ValueError):
            writer._write(group)
        assert late.done.is_set() and isinstance(late.error, TransientError)
        [(videos, timeout)] = store.merges
        assert videos == ["a", "b"] and timeout is not None and 29 < timeout <= 30
        retries = writer._failed_commit(group, ValueError("repeated frame ids"), 0.1)
        assert [[p.frames.video_id for p in part] for part in retries] == [["a"], ["b"]]
    finally:
        writer.close()
