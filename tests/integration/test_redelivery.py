"""Redeliveries and crash loops through the real consumer: the Ray Serve app's IndexConsumer taking
its tasks from RabbitMQ through Ray's Celery adapter (acks late).

- A task whose consumer connections the broker closes while the task is unacknowledged on them, until
  the broker has redelivered it five times, ends indexed, once: a redelivery is not a failed attempt
  (no crash charged, nothing dead-lettered).
- A video whose consumer is SIGKILLed at every start is failed and dead-lettered (``crash_loop``)
  after ``serve.max_crashes`` deaths, instead of looping.

Each test prints one line with its figures (``redelivery ...``, ``crash-loop ...``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from events.deadletters import DeadLetter, DeadLetterQueue, FailureKind
from infra.dev.samples import expected_sample_count, write_video
from infra.harness.faults import AppHost, KillEveryStart, start_app
from infra.harness.services import (
    Services,
    close_connection,
    consumer_connections,
    eventually,
    queue_counts,
    queue_info,
    redeliveries,
    unique_prefix,
)
from storage.catalog import VideoRecord, VideoStatus
from storage.ids import video_id
from storage.tables import IndexStore
from tests.harness import report_lines

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

#: A long 640x360 video; with ``EVERY_S`` it gives thousands of samples, so one run of its job
#: (decode, embed through the Encoder, thumbnails) outlasts five connection drops with room to spare
#: on a loaded machine (each drop waits for the consumer to reconnect and the redelivery to arrive).
#: The first delivery's run goes on after its connection is dropped and indexes the video when done:
#: at 540 s it did so ~30 s in on an idle machine, before a sixth drop that one missed drop called for.
BIG_SECONDS = 1080.0
BIG_FPS = 10
BIG_SIZE = (640, 360)
#: This module's app samples densely: more work per job without a larger file to generate.
EVERY_S = 0.1
DROPS = 5
#: Longest wait for the task to be unacknowledged again on a new consumer connection after a drop.
UNACKED_TIMEOUT_S = 60.0
#: Longest wait for the video to settle (indexed, or failed by the crash loop).
SETTLE_TIMEOUT_S = 400.0
#: Longest wait, after a drop, for the broker's redelivery count to show it (the consumer reconnects and
#: the management figures catch up); a drop that shows none missed the task.
DROP_REDELIVERY_S = 60.0
#: Bounds of the drops: at most this many, within this long after the upload.
MAX_DROPS = 10
DROPS_DEADLINE_S = 360.0
#: Longest the crash-loop watcher runs.
WATCH_TIMEOUT_S = 400.0
POLL_S = 0.1


@pytest.fixture(scope="module")
def host(services: Services, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AppHost]:
    # The split layout: the job's length above was measured with the Encoder embedding its frames.
    env = {"VIDX_SAMPLING__EVERY_S": str(EVERY_S), "VIDX_SERVE__LAYOUT": "split"}
    with start_app(services, unique_prefix(), tiny_model_dir, tmp_path_factory.mktemp("state"), env=env) as app:
        yield app


@pytest.fixture(scope="module")
def big_video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("media") / "big.mp4"
    return write_video(path, seconds=BIG_SECONDS, fps=BIG_FPS, size=BIG_SIZE, seed=4242)


def report(request: pytest.FixtureRequest, *lines: str) -> None:
    report_lines(request.config, list(lines))


def _record(store: IndexStore, vid: str) -> VideoRecord | None:
    return store.catalog.get(vid)


def _letters_of(host: AppHost, vid: str) -> list[DeadLetter]:
    settings = host.settings
    queue = DeadLetterQueue(settings.amqp.url.get_secret_value(), settings.serve.failed_queue)
    return [letter for letter in queue.list() if letter.job is not None and letter.job.video_id == vid]


def test_a_task_redelivered_five_times_by_dropped_connections_is_indexed(
    request: pytest.FixtureRequest, host: AppHost, big_video: Path
) -> None:
    services, settings = host.services, host.settings
    queue = settings.serve.index_queue
    store = IndexStore(settings.s3)
    key = "redelivery/dropped-connections.mp4"
    vid = video_id(host.bucket, key)
    frames = expected_sample_count(BIG_SECONDS, BIG_FPS, settings.sampling.every_s)
    before = redeliveries(queue_info(services, queue))
    closed: set[str] = set()
    drops_at: list[float] = []
    started = time.monotonic()
    # Given a video whose job runs for a while
    services.minio_client().fput_object(host.bucket, key, str(big_video), content_type="video/mp4")
    # When the broker closes the consumer's connections while the task is unacknowledged on them, until
    # the broker has redelivered it five times. A drop can miss: a retry's new message may be in flight
    # between two deliveries when the connection closes (the management figures lag by up to the stats
    # interval), so drops go on, bounded in count and time, until five redeliveries are counted.
    deadline = started + DROPS_DEADLINE_S
    missed = 0

    def state() -> str:
        info = queue_info(services, queue)
        record = _record(store, vid)
        return (
            f"{redeliveries(info) - before} redeliveries after {time.monotonic() - started:.1f}s and "
            f"{len(drops_at)} drops ({missed} missed; at {', '.join(f'{t:.1f}s' for t in drops_at)}): video "
            f"{record.status.value if record else 'no row'}, queue ready {info.get('messages_ready')} unacked "
            f"{info.get('messages_unacknowledged')} consumers {info.get('consumers')}"
        )

    def unacked() -> bool:
        info = queue_info(services, queue)
        on_new = [n for n in consumer_connections(services, queue) if n not in closed]
        return bool(on_new) and int(info.get("messages_unacknowledged") or 0) >= 1

    def redelivered_past(count: int) -> bool:
        return redeliveries(queue_info(services, queue)) > count

    while redeliveries(queue_info(services, queue)) - before < DROPS:
        if len(drops_at) >= MAX_DROPS or time.monotonic() > deadline:
            raise AssertionError(f"the task was not redelivered {DROPS} times: {state()}")

        try:
            what = f"the task to be unacknowledged before drop {len(drops_at) + 1}"
            eventually(unacked, what, UNACKED_TIMEOUT_S, POLL_S)
        except AssertionError:
            raise AssertionError(
                f"the task was not unacknowledged again before drop {len(drops_at) + 1} ({state()}): the job "
                "finished too soon, or the consumer stopped consuming"
            ) from None
        counted = redeliveries(queue_info(services, queue))
        for name in [n for n in consumer_connections(services, queue) if n not in closed]:
            close_connection(services, name)
            closed.add(name)
        drops_at.append(time.monotonic() - started)
        try:  # the drop's redelivery, once the consumer is back and the broker's figures show it
            eventually(partial(redelivered_past, counted), "a redelivery", DROP_REDELIVERY_S, POLL_S)
        except AssertionError:
            missed += 1
    # Then the video ends indexed, once, with no crash charged

    def settled() -> bool:
        record = _record(store, vid)
        return record is not None and record.status is VideoStatus.INDEXED and queue_counts(services, queue) == (0, 0)

    eventually(settled, "the video to be indexed and the index queue drained", SETTLE_TIMEOUT_S, 0.5)
    took_s = time.monotonic() - started
    redelivered = redeliveries(queue_info(services, queue)) - before
    record = _record(store, vid)
    assert record is not None
    summary = store.active_frames().summary(vid)
    letters = _letters_of(host, vid)
    report(
        request,
        f"redelivery dropped-connections: {len(closed)} consumer connections closed in {len(drops_at)} drops, "
        f"redelivered {redelivered}, {record.status.value} with {summary.rows} frames (content has {frames}), "
        f"crashes {record.crashes}, dead letters {len(letters)}, {took_s:.1f}s",
        f"  drops at {', '.join(f'{t:.1f}s' for t in drops_at)} after the upload ({missed} missed the task)",
    )
    assert redelivered >= DROPS
    assert record.status is VideoStatus.INDEXED and record.frames == frames
    assert (summary.rows, summary.duplicate_ids) == (frames, 0)
    assert set(summary.fingerprints) == {record.fingerprint}
    assert record.crashes == 0
    assert letters == []


def test_a_video_that_kills_its_consumer_every_time_is_dead_lettered_after_max_crashes(
    request: pytest.FixtureRequest, host: AppHost, big_video: Path
) -> None:
    settings = host.settings
    max_crashes = settings.serve.max_crashes
    store = IndexStore(settings.s3)
    key = "redelivery/kills-its-consumer.mp4"
    vid = video_id(host.bucket, key)
    started = time.monotonic()
    # Given a consumer that is SIGKILLed whenever it starts indexing this video
    with KillEveryStart(host, vid, max_kills=max_crashes + 2, timeout_s=WATCH_TIMEOUT_S) as killer:
        host.services.minio_client().fput_object(host.bucket, key, str(big_video), content_type="video/mp4")

        # When its task is redelivered to each new replica
        def settled() -> bool:
            record = _record(store, vid)
            return record is not None and record.status is VideoStatus.FAILED

        eventually(settled, "the video to be failed", SETTLE_TIMEOUT_S, 0.5)
    took_s = time.monotonic() - started
    host.wait_serving("IndexConsumer")
    record = _record(store, vid)
    assert record is not None
    letters = _letters_of(host, vid)
    kills = killer.kills
    report(
        request,
        f"crash-loop: {len(kills)} consumer SIGKILLs (max_crashes {max_crashes}), then {record.status.value}: "
        f"{record.error!r}; dead letters {[letter.kind.value for letter in letters]}, {took_s:.1f}s",
        *(
            f"  kill {n + 1} at {k.at_s:.1f}s: pid {k.pid}, claim recorded crashes {k.crashes}, holder_alive "
            f"false {'never' if k.judged_dead_s is None else f'{k.judged_dead_s:.2f}s'} after the kill"
            for n, k in enumerate(kills)
        ),
        *(f"  watcher error: {e}" for e in killer.errors),
    )
    # Then the video is failed after max_crashes deaths, with the reason, and dead-lettered once
    assert not killer.errors, killer.errors
    assert len(kills) == max_crashes
    assert [k.crashes for k in kills] == list(range(max_crashes))
    assert record.status is VideoStatus.FAILED
    assert record.error is not None and record.error.startswith("the consumer died"), record.error
    assert [letter.kind for letter in letters] == [FailureKind.CRASH_LOOP]
