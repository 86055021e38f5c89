"""Operator paths over real services: the dead-letter queue (``vidx dlq list|replay``) and
``vidx reconcile`` (``vidx check --repair``) repairing a bucket whose events were partly lost.

The CLI runs for real (typer's runner, settings from the environment) and submits to the real task
queue on RabbitMQ; the test takes those task messages off the queue and runs them through the
consumer's handler, as the IndexConsumer would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pika
import pytest
from typer.testing import CliRunner

from events.deadletters import DeadLetterQueue
from events.jobs import IndexJob, JobSource
from events.records import BucketEvent, EventKind, decode_message
from events.router import EventRouter, Planned
from pipeline.cli.check import FOUND_EXIT
from pipeline.cli.main import app
from pipeline.index.consumer import IndexTaskHandler, TaskContext
from pipeline.index.indexer import JobResult
from storage.catalog import VideoStatus
from storage.errors import TransientError
from storage.ids import video_id
from tests.harness import Stack, report_lines
from tests.media import write_corrupt_mp4, write_video

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SMALL = (64, 48)


def cli(*args: str, exit_code: int = 0) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == exit_code, (args, result.output)
    return result.output


def take_tasks(stack: Stack) -> list[tuple[str, IndexJob]]:
    """Every task message on the index queue, as (task id, job)."""
    connection = pika.BlockingConnection(pika.URLParameters(stack.services.amqp_url))
    try:
        channel = connection.channel()
        channel.queue_declare(stack.settings.serve.index_queue, durable=True)  # as Celery declares it
        tasks: list[tuple[str, IndexJob]] = []
        while True:
            method, properties, body = channel.basic_get(stack.settings.serve.index_queue, auto_ack=True)
            if method is None:
                return tasks
            args, _kwargs, _embed = json.loads(body)
            tasks.append((str(properties.headers["id"]), IndexJob.model_validate(args[0])))
    finally:
        connection.close()


def handler(stack: Stack, runner: Any = None) -> IndexTaskHandler:
    letters = DeadLetterQueue(stack.services.amqp_url, stack.settings.serve.failed_queue)
    return IndexTaskHandler(runner or stack.indexer, letters, stack.settings.serve.max_retries)


class EncoderDown:
    """The indexer with its encoder gone: every attempt fails transiently."""

    def __init__(self, stack: Stack) -> None:
        self._stack = stack

    def run(
        self, job: IndexJob, task_id: str | None = None, attempt: int = 0, *, redelivered: bool = False
    ) -> JobResult:
        raise TransientError("encoder call failed: ActorDiedError")

    def record_failure(self, job: IndexJob, reason: str, version: str | None = None) -> None:
        self._stack.indexer.record_failure(job, reason, version)


def test_failed_jobs_are_listed_and_replayed(stack: Stack, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    # Given a corrupt upload (permanent) and a video whose every attempt met a dead encoder (exhausted)
    stack.upload("bad/broken.mp4", write_corrupt_mp4(tmp_path / "broken.mp4"))
    stack.upload("ok/unlucky.mp4", write_video(tmp_path / "u.mp4", seconds=2, seed=1, size=SMALL))
    jobs = {j.key: j for j in stack.sink.take(2)}
    out = handler(stack).handle(jobs["bad/broken.mp4"].model_dump(mode="json"), TaskContext("task-broken", 0))
    assert out["outcome"] == "failed"
    last = stack.settings.serve.max_retries
    unlucky = handler(stack, EncoderDown(stack))
    out = unlucky.handle(jobs["ok/unlucky.mp4"].model_dump(mode="json"), TaskContext("task-unlucky", last))
    assert out["reason"] == f"gave up after {last + 1} attempts: encoder call failed: ActorDiedError"
    assert stack.store.catalog.get(jobs["ok/unlucky.mp4"].video_id).status is VideoStatus.FAILED  # type: ignore[union-attr]

    # When an operator lists the dead letters (twice: listing leaves them in place)
    for _ in range(2):
        letters = {d["id"]: d for d in json.loads(cli("dlq", "list", "--json"))}
        assert set(letters) == {"task-broken", "task-unlucky"}
    assert letters["task-broken"]["uri"] == jobs["bad/broken.mp4"].uri
    assert letters["task-broken"]["reason"].startswith("decode error: ")
    assert (letters["task-broken"]["attempts"], letters["task-unlucky"]["attempts"]) == (1, last + 1)
    assert letters["task-unlucky"]["kind"] == "exhausted" and letters["task-broken"]["failed_at"]
    listing = cli("dlq", "list")
    assert "task-broken" in listing
    report_lines(request.config, [f"dlq list: {line}" for line in listing.splitlines()])

    # And replays one after fixing its cause (the encoder is back)
    output = cli("dlq", "replay", "task-unlucky")
    assert "1 replayed, 1 left in the dead-letter queue" in output
    report_lines(request.config, [f"dlq replay: {line}" for line in output.splitlines()])
    [(task_id, replayed)] = take_tasks(stack)
    assert replayed.source is JobSource.REPLAY and replayed.key == "ok/unlucky.mp4"
    assert stack.store.catalog.get(replayed.video_id).status is VideoStatus.QUEUED  # type: ignore[union-attr]
    assert handler(stack).handle(replayed.model_dump(mode="json"), TaskContext(task_id, 0))["outcome"] == "indexed"

    # Then the video is indexed, and only the corrupt one is still a dead letter
    assert stack.store.catalog.get(replayed.video_id).status is VideoStatus.INDEXED  # type: ignore[union-attr]
    assert [d["id"] for d in json.loads(cli("dlq", "list", "--json"))] == ["task-broken"]
    assert "1 replayed, 0 left" in cli("dlq", "replay", "--all")
    [(_, again)] = take_tasks(stack)
    assert handler(stack).handle(again.model_dump(mode="json"), TaskContext("task-broken-2", 0))["outcome"] == "failed"
    assert "no dead letters" not in cli("dlq", "list")  # failed again: back in the queue, with its reason


class EventLoss:
    """Loses the bucket-event messages of chosen (key, kind) pairs before the router sees them, every
    copy (MinIO delivers at least once: a copy that got through would heal the loss), as a broker
    outage without MinIO's queue_dir would."""

    def __init__(self, router: EventRouter, lose: set[tuple[str, EventKind]]) -> None:
        self._plan = router.plan
        self._lose = lose
        self.seen = 0
        self.lost: list[BucketEvent] = []
        router.plan = self.plan  # type: ignore[method-assign]

    def plan(self, body: bytes) -> Planned:
        self.seen += 1
        events = decode_message(body)
        if events and all((e.key, e.kind) in self._lose for e in events):
            self.lost.extend(events)
            return Planned((), 0)
        return self._plan(body)


def run_routed(stack: Stack, keys: list[str]) -> None:
    """Runs the router's jobs until one of each of ``keys`` has run (a job of a duplicated event runs
    too, as a consumer would run it: jobs are idempotent)."""
    waiting = set(keys)
    while waiting:
        [job] = stack.sink.take(1)
        stack.run(job)
        waiting.discard(job.key)


def test_reconcile_repairs_a_bucket_after_ten_percent_of_events_were_lost(
    stack: Stack, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Objects just written count as in flight for a while (their event may be queued): not here.
    monkeypatch.setenv("VIDX_CHECK__NEW_OBJECT_GRACE_S", "0")
    keys = [f"r/clip-{n:02d}.mp4" for n in range(20)]
    # A tenth of the 30 events: the create of a key deleted later, the create of a key that stays, and
    # the delete of a video that was indexed
    lose = {(keys[9], EventKind.CREATED), (keys[19], EventKind.CREATED), (keys[0], EventKind.REMOVED)}
    loss = EventLoss(stack.router, lose)
    client = stack.services.minio_client()

    # Given 20 uploads and then 10 deletes, with those three events lost
    for n, key in enumerate(keys):
        stack.upload(key, write_video(tmp_path / f"{n}.mp4", seconds=2, seed=500 + n, size=SMALL))
    run_routed(stack, [k for k in keys if k not in (keys[9], keys[19])])
    for key in keys[:10]:
        client.remove_object(stack.bucket, key)
    run_routed(stack, keys[1:10])
    lost_creates = sorted({e.key for e in loss.lost if e.kind is EventKind.CREATED})
    lost_deletes = sorted({e.key for e in loss.lost if e.kind is EventKind.REMOVED})
    assert (lost_creates, lost_deletes) == ([keys[9], keys[19]], [keys[0]])
    assert loss.seen >= 30

    # A lost create of a key deleted later needs no repair; a lost delete of an indexed video does
    missing = sum(1 for k in lost_creates if k in keys[10:])
    orphaned = sum(1 for k in lost_deletes if k not in lost_creates)
    assert missing >= 1 and orphaned >= 1, loss.lost

    # When reconcile runs: first dry, then for real
    dry = cli("reconcile", "--dry-run", "--verbose", exit_code=FOUND_EXIT)  # i.e. `vidx check`
    assert f"{missing + orphaned} inconsistencies (missing {missing}, orphaned {orphaned})" in dry, dry
    assert take_tasks(stack) == []
    real = cli("reconcile")
    assert f"submitted {missing + orphaned} repairing jobs" in real, real
    for task_id, job in take_tasks(stack):
        assert job.source is JobSource.RECONCILE
        handler(stack).handle(job.model_dump(mode="json"), TaskContext(task_id, 0))

    # Then the index matches the bucket exactly, and a second pass finds nothing to do
    present = {o.object_name: o.etag for o in client.list_objects(stack.bucket, recursive=True)}
    assert sorted(present) == keys[10:]
    for key, etag in present.items():
        vid = video_id(stack.bucket, key)
        record = stack.store.catalog.get(vid)
        assert record is not None and record.status is VideoStatus.INDEXED and record.version == etag, (key, record)
        assert stack.store.frames.count(vid) == record.frames == 2
    for key in keys[:10]:
        vid = video_id(stack.bucket, key)
        record = stack.store.catalog.get(vid)
        assert record is None or record.status is VideoStatus.DELETED, (key, record)
        assert stack.store.frames.count(vid) == 0
    again = cli("reconcile")
    assert "0 inconsistencies (none); in sync 10" in again and "submitted 0 repairing jobs" in again, again
    lost = f"{loss.seen} events, {len(loss.lost)} lost ({len(lost_creates)} creates, {len(lost_deletes)} deletes)"
    report_lines(
        request.config,
        [f"reconcile: {lost}"]
        + [f"reconcile --dry-run: {line}" for line in dry.splitlines()]
        + [f"reconcile: {line}" for line in real.splitlines()]
        + [f"reconcile again: {line}" for line in again.splitlines()],
    )
