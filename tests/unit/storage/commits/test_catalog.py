"""storage/catalog.py ``write_many`` and storage/commits/catalog.py: grouped compare-and-set commits over a
real local catalog."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from storage.catalog import VideoRecord, VideoStatus
from storage.commits.catalog import DirectWrites, GroupedCatalogWriter
from storage.config import S3Settings
from storage.errors import TransientError
from storage.tables import IndexStore

#: Longest any thread of these tests waits.
WAIT_S = 30.0
#: Tries of one racer whose commit the store refused (a conflict it gave up on).
RACE_TRIES = 5


@pytest.fixture
def store(tmp_path: Path) -> IndexStore:
    return IndexStore(S3Settings(), uri=str(tmp_path / "lance"))


def record(video_id: str, status: VideoStatus = VideoStatus.INDEXING, **fields: object) -> VideoRecord:
    return VideoRecord(video_id=video_id, uri=f"s3://videos/{video_id}.mp4", status=status, **fields)  # type: ignore[arg-type]


def test_write_many_lands_every_write_in_one_commit(store: IndexStore) -> None:
    store.catalog.get("x")  # the table exists
    before = store.catalog.version()
    written = store.catalog.write_many([(record(f"v{i}"), 0) for i in range(10)])
    assert all(w is not None and w.rev == 1 for w in written)
    assert store.catalog.version() == before + 1
    assert store.catalog.get("v3") == written[3]


def test_write_many_tells_each_loser_apart_from_the_winners(store: IndexStore) -> None:
    a = store.catalog.write(record("a"), 0)
    b = store.catalog.write(record("b"), 0)
    assert a is not None and b is not None
    moved = store.catalog.write(b.evolve(status=VideoStatus.FAILED), b.rev)  # b moves on: rev 2
    assert moved is not None
    outcomes = store.catalog.write_many(
        [
            (a.evolve(status=VideoStatus.INDEXED), a.rev),  # lands
            (b.evolve(status=VideoStatus.INDEXED), b.rev),  # stale: loses
            (record("c"), 0),  # a new row: lands
            (record("a2"), 0),
        ]
    )
    assert [o is not None for o in outcomes] == [True, False, True, True]
    assert store.catalog.get("b") == moved
    assert store.catalog.get("a") == outcomes[0]


def test_write_many_of_an_existing_row_as_new_loses(store: IndexStore) -> None:
    assert store.catalog.write(record("a"), 0) is not None
    assert store.catalog.write_many([(record("a", VideoStatus.FAILED), 0), (record("b"), 0)])[0] is None
    got = store.catalog.get("a")
    assert got is not None and got.status is VideoStatus.INDEXING


def test_write_many_refuses_two_writes_of_one_video(store: IndexStore) -> None:
    with pytest.raises(ValueError):
        store.catalog.write_many([(record("a"), 0), (record("a"), 0)])


@pytest.mark.parametrize("quiet_videos", [None, 2], ids=["bucket-only", "paced-by-load"])
def test_concurrent_submits_share_commits_and_each_learns_its_outcome(
    store: IndexStore, quiet_videos: int | None
) -> None:
    """THREADS threads submit at once, each one claim (a new row) and some a stale write; the writer
    commits at most once per interval (paced by load: the burst of writes is load, more than
    ``quiet_writes`` within the interval), so the writes share a few commits; every thread learns its
    own outcome."""
    threads_n = 24
    store.catalog.get("x")
    stale = store.catalog.write(record("stale"), 0)
    assert stale is not None and store.catalog.write(stale.evolve(error="moved"), stale.rev) is not None
    before = store.catalog.version()
    writer = GroupedCatalogWriter(store.catalog, min_interval_s=0.2, burst_commits=1, quiet_videos=quiet_videos)
    barrier = threading.Barrier(threads_n)
    results: list[tuple[VideoRecord | None, VideoRecord | None] | BaseException] = [None] * threads_n  # type: ignore[list-item]

    def run(i: int) -> None:
        try:
            barrier.wait(WAIT_S)
            mine = writer.submit(record(f"v{i}"), 0)
            lost = writer.submit(stale.evolve(frames=i), stale.rev) if i % 6 == 0 else None
            results[i] = (mine.result(WAIT_S), lost.result(WAIT_S) if lost else None)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    writer.close()
    assert not any(t.is_alive() for t in threads)
    assert all(isinstance(r, tuple) for r in results), results
    assert all(r[0] is not None and r[0].rev == 1 for r in results if isinstance(r, tuple))
    assert all(r[1] is None for r in results if isinstance(r, tuple))
    commits = store.catalog.version() - before
    assert commits == writer.stats.commits and commits < threads_n // 2, writer.stats
    assert writer.stats.writes == threads_n + 4 and writer.stats.lost == 4


def test_a_lone_write_commits_at_once_and_the_rate_is_capped_after(store: IndexStore) -> None:
    writer = GroupedCatalogWriter(store.catalog, min_interval_s=0.5, burst_commits=1)
    first = writer.submit(record("a"), 0)
    assert first.result(WAIT_S) is not None
    burst = [writer.submit(record(f"b{i}"), 0) for i in range(5)]
    assert all(p.result(WAIT_S) is not None for p in burst)
    writer.close()
    assert writer.stats.commits == 2  # the burst waited for the interval and went as one


def test_a_lone_videos_claim_and_finish_commit_at_once_whatever_the_interval(store: IndexStore) -> None:
    """Tokens in hand (a quiet spell): no write waits for the pace. With a 60 s interval, a finish that
    waited for it would miss the 30 s deadline of its result."""
    writer = GroupedCatalogWriter(store.catalog, min_interval_s=60, burst_commits=4)
    for vid in ("a", "b"):
        claimed = writer.submit(record(vid), 0).result(WAIT_S)
        assert claimed is not None
        finished = writer.submit(claimed.evolve(status=VideoStatus.INDEXED), claimed.rev).result(WAIT_S)
        assert finished is not None and finished.rev == 2
    assert writer.stats.commits == 4
    # The bucket is empty now: the next write waits for a token (an interval after the last commit).
    with pytest.raises(TransientError, match="no outcome"):
        writer.submit(record("c"), 0).result(0.5)
    writer.close()  # closing takes the waiting write at once
    assert writer.stats.commits == 5


def test_while_few_videos_are_claimed_each_write_commits_at_once_with_the_bucket_empty(store: IndexStore) -> None:
    """Paced by load: videos indexed one after another (one claimed at a time) never wait for the pace.
    A 60 s interval and one token: a write that waited for a token would miss its 30 s deadline."""
    writer = GroupedCatalogWriter(
        store.catalog, min_interval_s=60, burst_commits=1, quiet_videos=1, quiet_writes=100, quiet_interval_s=0.05
    )
    for vid in ("a", "b", "c", "d"):
        claimed = writer.submit(record(vid), 0).result(WAIT_S)
        assert claimed is not None
        finished = writer.submit(claimed.evolve(status=VideoStatus.INDEXED), claimed.rev).result(WAIT_S)
        assert finished is not None and finished.rev == 2
    writer.close()
    assert writer.stats.commits == 8


def test_with_more_videos_claimed_than_quiet_the_pace_holds_though_no_write_arrives(store: IndexStore) -> None:
    """Two videos claimed and unfinished (their consumers busy, writing nothing): the next write is
    load, not a quiet spell, so it waits for the pace (a count of recent arrivals would have sent it at
    once). A finish brings the count back under the bar, and the next write goes at once."""
    writer = GroupedCatalogWriter(
        store.catalog, min_interval_s=60, burst_commits=2, quiet_videos=1, quiet_interval_s=0.05
    )
    a = writer.submit(record("a"), 0).result(WAIT_S)  # quiet: 0 claimed
    b = writer.submit(record("b"), 0).result(WAIT_S)  # quiet: 1 claimed
    assert a is not None and b is not None and writer.stats.commits == 2
    time.sleep(0.3)  # a lull: nothing arrives
    c = writer.submit(record("c"), 0)
    with pytest.raises(TransientError, match="no outcome"):
        c.result(1.0)  # 2 claimed > 1, and the bucket is empty: 60 s away
    writer.close()  # closing takes it at once
    assert c.result(WAIT_S) is not None and writer.stats.commits == 3


def test_a_finish_brings_the_count_under_the_bar_and_the_next_write_goes_at_once(store: IndexStore) -> None:
    writer = GroupedCatalogWriter(
        store.catalog, min_interval_s=60, burst_commits=3, quiet_videos=1, quiet_writes=100, quiet_interval_s=0.05
    )
    a = writer.submit(record("a"), 0).result(WAIT_S)  # quiet (0 claimed): a token spent
    b = writer.submit(record("b"), 0).result(WAIT_S)  # quiet (1 claimed): a token spent
    assert a is not None and b is not None
    done = writer.submit(a.evolve(status=VideoStatus.INDEXED), a.rev).result(WAIT_S)  # busy: the last token
    assert done is not None
    c = writer.submit(record("c"), 0).result(WAIT_S)  # 1 claimed again: quiet, though no token is left
    assert c is not None
    d = writer.submit(record("d"), 0)
    with pytest.raises(TransientError, match="no outcome"):
        d.result(1.0)  # 2 claimed: busy, and the bucket is empty
    writer.close()
    assert d.result(WAIT_S) is not None and writer.stats.commits == 5


def test_writes_pouring_in_are_load_though_few_videos_stay_claimed(store: IndexStore) -> None:
    """Jobs that end at once (objects gone, tiny clips) keep no video claimed while their writes pour in:
    past ``quiet_writes`` writes within one interval the pace holds (each such write at once would be a
    commit per write, the cost the pace exists to cap)."""
    writer = GroupedCatalogWriter(
        store.catalog, min_interval_s=60, burst_commits=1, quiet_videos=2, quiet_writes=3, quiet_interval_s=0
    )
    for vid in ("a", "b", "c"):  # 1, 2, 3 writes within the interval: quiet
        assert writer.submit(record(vid, VideoStatus.FAILED), 0).result(WAIT_S) is not None
    fourth = writer.submit(record("d", VideoStatus.FAILED), 0)
    with pytest.raises(TransientError, match="no outcome"):
        fourth.result(1.0)  # 4 writes within the interval: busy, and the bucket is empty
    writer.close()
    assert fourth.result(WAIT_S) is not None and writer.stats.commits == 4


def test_quiet_commits_keep_the_quiet_interval_apart_once_the_tokens_are_spent(store: IndexStore) -> None:
    writer = GroupedCatalogWriter(
        store.catalog, min_interval_s=30, burst_commits=1, quiet_videos=2, quiet_writes=100, quiet_interval_s=0.6
    )
    assert writer.submit(record("a", VideoStatus.FAILED), 0).result(WAIT_S) is not None  # the one token
    second = writer.submit(record("b", VideoStatus.FAILED), 0)
    with pytest.raises(TransientError, match="no outcome"):
        second.result(0.2)  # quiet, but within 0.6 s of the last commit
    assert second.result(WAIT_S) is not None  # ~0.6 s after it, not 30 s
    writer.close()
    assert writer.stats.commits == 2


def test_a_token_in_hand_is_never_slower_than_quiet(store: IndexStore) -> None:
    writer = GroupedCatalogWriter(
        store.catalog, min_interval_s=30, burst_commits=3, quiet_videos=2, quiet_writes=100, quiet_interval_s=60
    )
    for vid in ("a", "b", "c"):  # three tokens: each at once, though the quiet interval is 60 s
        assert writer.submit(record(vid, VideoStatus.FAILED), 0).result(WAIT_S) is not None
    writer.close()
    assert writer.stats.commits == 3


def test_the_shared_catalog_writer_is_paced_by_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The CatalogWriter deployment's writer (every claim and finish goes through it) is the one paced
    by load: with no token left, a quiet write still goes at once."""
    from types import SimpleNamespace

    from pipeline.jobs import catalog_writes
    from pipeline.settings import Settings

    local = IndexStore(S3Settings(), uri=str(tmp_path / "lance"))
    monkeypatch.setattr(catalog_writes, "IndexStore", lambda _s3: SimpleNamespace(catalog=local.catalog))
    settings = Settings.model_validate(
        {"writer": {"catalog_min_interval_s": 30, "catalog_burst_commits": 1, "catalog_quiet_interval_s": 0}}
    )
    shared = catalog_writes.SharedCatalogWriter(settings)

    async def two_writes() -> list[VideoRecord | None]:
        return [await shared.write(record(vid, VideoStatus.FAILED), 0) for vid in ("a", "b")]

    try:
        assert all(r is not None for r in asyncio.run(asyncio.wait_for(two_writes(), WAIT_S)))
        assert shared.stats()["commits"] == 2
    finally:
        shared.close()


def test_a_claim_whose_finish_never_comes_stops_counting(store: IndexStore) -> None:
    """A consumer died after its claim: after ``claim_memory_s`` that claim is no longer load."""
    writer = GroupedCatalogWriter(
        store.catalog,
        min_interval_s=60,
        burst_commits=1,
        quiet_videos=0,
        quiet_interval_s=0.05,
        claim_memory_s=0.3,
    )
    assert writer.submit(record("orphan"), 0).result(WAIT_S) is not None  # claimed; never finished
    time.sleep(0.5)
    assert writer.submit(record("next"), 0).result(WAIT_S) is not None  # at once, though no token
    writer.close()
    assert writer.stats.commits == 2


def test_a_commit_earns_no_token_for_the_time_it_ran(store: IndexStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under load the pace is an interval after each commit *ended*, as before the bucket: a slow commit
    (here 2.5 s of a 2 s interval) does not let the next group go at once."""
    writer = GroupedCatalogWriter(store.catalog, min_interval_s=2, burst_commits=2)
    assert writer.submit(record("warm"), 0).result(WAIT_S) is not None  # one token of two spent
    write_many = store.catalog.write_many

    committing = threading.Event()

    def slow(writes: list[tuple[VideoRecord, int]]) -> list[VideoRecord | None]:
        if not committing.is_set():  # the first commit only
            committing.set()
            time.sleep(2.5)
        return write_many(writes)

    monkeypatch.setattr(store.catalog, "write_many", slow)
    first = writer.submit(record("first"), 0)
    assert committing.wait(WAIT_S)  # taken and committing
    second = writer.submit(record("second"), 0)
    assert first.result(WAIT_S) is not None
    with pytest.raises(TransientError, match="no outcome"):
        second.result(1.0)  # the first commit ended just now: its token is 2 s away
    assert second.result(WAIT_S) is not None
    writer.close()
    assert writer.stats.commits == 3


def test_a_second_write_of_one_video_goes_in_the_next_commit(store: IndexStore) -> None:
    writer = GroupedCatalogWriter(store.catalog, min_interval_s=0.2)
    writer.submit(record("warm"), 0).result(WAIT_S)
    first = writer.submit(record("a"), 0)
    second = writer.submit(record("a", VideoStatus.INDEXED), 1)  # written from the first's revision
    assert first.result(WAIT_S) is not None
    landed = second.result(WAIT_S)
    writer.close()
    assert landed is not None and landed.rev == 2 and store.catalog.get("a") == landed


def test_a_failed_commit_is_transient_for_every_write_of_the_group(
    store: IndexStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object) -> None:
        raise TransientError("index table write failed: connection reset")

    monkeypatch.setattr(store.catalog, "write_many", broken)
    writer = GroupedCatalogWriter(store.catalog, min_interval_s=0)
    pending = [writer.submit(record(f"v{i}"), 0) for i in range(3)]
    for p in pending:
        with pytest.raises(TransientError):
            p.result(WAIT_S)
    writer.close()
    with pytest.raises(TransientError):
        writer.submit(record("late"), 0).result(WAIT_S)
    assert writer.stats.failed_commits >= 1


def test_direct_writes_commit_in_the_callers_thread(store: IndexStore) -> None:
    direct = DirectWrites(store.catalog)
    assert direct.submit(record("a"), 0).result(0) is not None
    assert direct.submit(record("a"), 0).result(0) is None


@pytest.mark.parametrize("indexed", [False, True], ids=["no-index", "btree-on-video-id"])
def test_racing_grouped_commits_inserting_one_new_video_exactly_one_wins(tmp_path: Path, indexed: bool) -> None:
    """RACERS threads, each with its own connection, released together, each commit a new row of its
    own and the same new video (a commit the store refused is retried, as callers do); the shared
    video ends with exactly one row, written by exactly one winner, every round."""
    racers_n, rounds = 4, 5
    seed = IndexStore(S3Settings(), uri=str(tmp_path / "lance"))
    seed.catalog.get("warm")
    if indexed:
        from pipeline.upkeep.maintenance import ensure_scalar_indexes

        assert ensure_scalar_indexes(seed) == ["videos.video_id"]
    racers = [IndexStore(S3Settings(), uri=str(tmp_path / "lance")) for _ in range(racers_n)]
    for round_ in range(rounds):
        shared = f"shared-{round_}"
        barrier = threading.Barrier(racers_n)
        results: list[object] = [None] * racers_n

        def race(i: int, shared: str, barrier: threading.Barrier, results: list[object]) -> None:
            try:
                barrier.wait(WAIT_S)
                for _ in range(RACE_TRIES):
                    try:
                        results[i] = racers[i].catalog.write_many(
                            [(record(shared, holder=f"racer-{i}"), 0), (record(f"own-{shared}-{i}"), 0)]
                        )
                        return
                    except TransientError as exc:  # a conflict the store gave up on: the caller retries
                        results[i] = exc
            except BaseException as exc:
                results[i] = exc

        threads = [threading.Thread(target=race, args=(i, shared, barrier, results)) for i in range(racers_n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S * 2)
        assert not any(t.is_alive() for t in threads)
        assert all(isinstance(r, list) for r in results), results  # every racer's commit went through
        landed = [r for r in results if isinstance(r, list)]
        winners = [r[0] for r in landed if r[0] is not None]
        assert len(winners) == 1, f"round {round_}: {len(winners)} writers of {shared} won"
        table = seed.db.open("videos")
        assert table is not None and table.count_rows(f"video_id = '{shared}'") == 1
        assert seed.catalog.get(shared) == winners[0]
        assert all(r[1] is not None for r in landed)  # each racer's own row landed with its commit


class _SlowCatalog:
    """A catalog whose commits take ``commit_s`` and all land (the 20-line reproduction of issue 19)."""

    def __init__(self, commit_s: float) -> None:
        self.commit_s = commit_s
        self.commits: list[list[str]] = []

    def write_many(self, writes: list[tuple[VideoRecord, int]]) -> list[VideoRecord | None]:
        time.sleep(self.commit_s)
        self.commits.append([r.video_id for r, _ in writes])
        return [r.evolve(rev=rev + 1) for r, rev in writes]


def test_a_caller_timing_out_on_a_slow_commit_leaves_the_writer_committing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumer-facing writer waits 0.1 s for a commit that takes 0.5 s: the caller gets a transient
    error, the write still lands, and the writer thread lives on to commit the next write. Before the
    fix the timeout cancelled the future, ``set_result`` raised InvalidStateError and the thread died."""
    from types import SimpleNamespace

    from pipeline.jobs import catalog_writes
    from pipeline.settings import Settings

    catalog = _SlowCatalog(commit_s=0.5)
    monkeypatch.setattr(catalog_writes, "IndexStore", lambda _s3: SimpleNamespace(catalog=catalog))
    settings = Settings.model_validate({"writer": {"catalog_min_interval_s": 0, "catalog_write_timeout_s": 0.1}})
    shared = catalog_writes.SharedCatalogWriter(settings)

    async def scenario() -> VideoRecord | None:
        with pytest.raises(TransientError):
            await shared.write(record("slow"), 0)
        await asyncio.sleep(0.8)  # the slow commit lands meanwhile
        catalog.commit_s = 0.0
        return await shared.write(record("next"), 0)

    try:
        landed = asyncio.run(scenario())
        assert landed is not None and landed.video_id == "next"
        assert catalog.commits == [["slow"], ["next"]]
        assert shared.stats()["commits"] == 2
    finally:
        shared.close()


def test_a_write_whose_caller_cancelled_before_its_group_was_taken_is_not_committed() -> None:
    catalog = _SlowCatalog(commit_s=0.3)
    writer = GroupedCatalogWriter(catalog, min_interval_s=0)  # type: ignore[arg-type]
    try:
        first = writer.submit(record("first"), 0)
        time.sleep(0.1)  # first is being committed
        gave_up = writer.submit(record("gave-up"), 0)
        assert gave_up.future.cancel()
        assert first.result(WAIT_S) is not None
        assert writer.submit(record("after"), 0).result(WAIT_S) is not None
        assert catalog.commits == [["first"], ["after"]]
        assert writer.health() is None
    finally:
        writer.close()


@pytest.mark.parametrize("paced_by_load", [False, True], ids=["marks-writer", "catalog-writer"])
def test_grouped_writer_paces_by_load_only_when_asked(store: IndexStore, paced_by_load: bool) -> None:
    """The Api's ``queued`` marks and the router's delete marks never see a claim: paced by load, every
    mark would look quiet and commit at once. Their writers (``grouped_writer``'s default) keep the
    bucket alone."""
    from pipeline.jobs.catalog_writes import grouped_writer
    from pipeline.settings import Settings

    settings = Settings.model_validate(
        {"writer": {"catalog_min_interval_s": 30, "catalog_burst_commits": 1, "catalog_quiet_interval_s": 0}}
    )
    writer = grouped_writer(store.catalog, settings, paced_by_load=paced_by_load)
    assert writer.submit(record("a", VideoStatus.QUEUED), 0).result(WAIT_S) is not None  # the one token
    second = writer.submit(record("b", VideoStatus.QUEUED), 0)
    if paced_by_load:
        assert second.result(WAIT_S) is not None  # no claim unfinished: at once
    else:
        with pytest.raises(TransientError, match="no outcome"):
            second.result(1.0)  # the bucket is empty: 30 s away
    writer.close()
    assert second.result(WAIT_S) is not None and writer.stats.commits == 2
