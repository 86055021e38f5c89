"""The real notification path: MinIO -> RabbitMQ -> EventRouter -> Indexer -> LanceDB on MinIO.

Services are real containers; the encoder is the tiny SigLIP checkpoint, loaded like a real one.
Jobs the router submits are collected and run here one by one, so each step can be checked; the
Ray Serve app with the Celery task queue in between is covered by the e2e tier.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pika
import pytest

from events.jobs import JobOp
from infra.harness.services import eventually
from pipeline.index.indexer import Outcome
from storage.catalog import VideoStatus
from storage.errors import CorruptVideo, PermanentError
from tests.harness import WAIT_S, Stack
from tests.media import frame_at, write_corrupt_mp4, write_video

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_uploads_become_searchable_moments_without_api_calls(stack: Stack, tmp_path: Path) -> None:
    # Given three videos and a text file dropped into the bucket by a plain S3 client
    for n in range(3):
        stack.upload(f"clips/video {n}.mp4", write_video(tmp_path / f"{n}.mp4", seconds=6, seed=100 + n))
    stack.services.minio_client().put_object(
        stack.bucket, "notes/readme.txt", io.BytesIO(b"hello"), 5, content_type="text/plain"
    )
    # When the router turns the bucket events into jobs and the indexer runs them
    jobs = stack.sink.take(3)
    assert sorted(j.key for j in jobs) == [f"clips/video {n}.mp4" for n in range(3)]
    assert all(j.op is JobOp.INDEX for j in jobs)
    eventually(lambda: stack.router.stats["ignored_not_video"] == 1, "the .txt event to be ignored", WAIT_S)
    # Bucket events cost no catalog commit: the row appears when a consumer claims the video
    assert stack.store.catalog.get(jobs[0].video_id) is None
    results = [stack.run(j) for j in jobs]
    # Then each video is indexed with one frame per second
    assert [r.outcome for r in results] == [Outcome.INDEXED] * 3
    assert all(r.frames == 6 for r in results)
    # And an image of video 1 at t = 4 s finds video 1 at 4 s
    query = stack.encoder.embed_images([frame_at(4, 101)])[0]
    top = stack.store.frames.search(query, 5)[0]
    assert top["uri"] == f"s3://{stack.bucket}/clips/video 1.mp4"
    assert top["ts_s"] == 4.0
    assert stack.router.stats["ignored_not_video"] == 1
    assert stack.sink.jobs.empty()


def test_duplicate_event_is_a_no_op(stack: Stack, tmp_path: Path) -> None:
    stack.upload("dup.mp4", write_video(tmp_path / "dup.mp4", seconds=3, seed=7))
    (job,) = stack.sink.take(1)
    assert stack.run(job).outcome is Outcome.INDEXED
    assert stack.run(job).outcome is Outcome.UNCHANGED
    assert stack.store.frames.count(job.video_id) == 3


def test_corrupt_video_fails_with_reason_and_next_video_is_indexed(stack: Stack, tmp_path: Path) -> None:
    stack.upload("bad.mp4", write_corrupt_mp4(tmp_path / "bad.mp4"))
    stack.upload("good.mp4", write_video(tmp_path / "good.mp4", seconds=3, seed=8))
    bad, good = stack.sink.take(2)
    with pytest.raises(CorruptVideo) as caught:
        stack.run(bad)
    record = stack.store.catalog.get(bad.video_id)
    assert record is not None and record.status is VideoStatus.FAILED
    assert record.error == caught.value.reason and record.error.startswith("decode error")
    assert stack.run(good).outcome is Outcome.INDEXED


def test_not_a_video_named_mp4_fails_permanently(stack: Stack) -> None:
    stack.services.minio_client().put_object(stack.bucket, "text.mp4", io.BytesIO(b"just text\n" * 50), 500)
    (job,) = stack.sink.take(1)
    with pytest.raises(PermanentError):
        stack.run(job)
    record = stack.store.catalog.get(job.video_id)
    assert record is not None and record.status is VideoStatus.FAILED and record.error


def test_delete_and_overwrite_follow_the_bucket(stack: Stack, tmp_path: Path) -> None:
    stack.upload("v.mp4", write_video(tmp_path / "a.mp4", seconds=3, seed=20))
    (created,) = stack.sink.take(1)
    stack.run(created)
    # Overwrite with different content: rows follow the new version
    stack.upload("v.mp4", write_video(tmp_path / "b.mp4", seconds=5, seed=21))
    (overwritten,) = stack.sink.take(1)
    assert stack.run(overwritten).outcome is Outcome.INDEXED
    assert stack.store.frames.count(created.video_id) == 5
    top = stack.store.frames.search(stack.encoder.embed_images([frame_at(2, 21)])[0], 1)[0]
    assert top["video_id"] == created.video_id and top["ts_s"] == 2.0
    # Delete: rows gone, status deleted
    stack.services.minio_client().remove_object(stack.bucket, "v.mp4")
    (deleted,) = stack.sink.take(1)
    assert deleted.op is JobOp.DELETE
    assert stack.run(deleted).outcome is Outcome.DELETED
    assert stack.store.frames.count(created.video_id) == 0
    assert stack.store.catalog.get(created.video_id).status is VideoStatus.DELETED  # type: ignore[union-attr]


def test_undecodable_message_is_parked_and_router_keeps_going(stack: Stack, tmp_path: Path) -> None:
    amqp = stack.settings.amqp
    connection = pika.BlockingConnection(pika.URLParameters(stack.services.amqp_url))
    channel = connection.channel()
    channel.basic_publish(amqp.exchange, amqp.routing_key, b"\x00not json")
    channel.basic_publish(amqp.exchange, amqp.routing_key, json.dumps({"Records": [{"x": 1}]}).encode())
    eventually(lambda: stack.router.stats["parked"] >= 2, "two bodies to be parked", WAIT_S)
    parked = []
    for _ in range(2):
        method, props, body = channel.basic_get(amqp.parked_queue, auto_ack=True)
        assert method is not None
        parked.append(body)
        assert props.headers["x-vidx-reason"]
    connection.close()
    assert b"\x00not json" in parked
    stack.upload("after.mp4", write_video(tmp_path / "after.mp4", seconds=2, seed=9))
    (job,) = stack.sink.take(1)
    assert stack.run(job).outcome is Outcome.INDEXED


def test_an_uploads_two_copies_under_dual_delivery_become_one_job(stack: Stack, tmp_path: Path) -> None:
    """MinIO publishes each event at once through the fast target and again from its store on the 3 s
    tick (``amqp.event_delivery`` dual, the default): both copies reach the router, one job is submitted."""
    assert stack.services.event_delivery == "dual"
    stack.upload("twice.mp4", write_video(tmp_path / "twice.mp4", seconds=2, seed=11))
    (job,) = stack.sink.take(1)
    assert job.key == "twice.mp4"
    # The store's copy comes on MinIO's next replay tick (every 3 s). (The session's one MinIO publishes
    # to every test's queue: an earlier test's late copies may arrive here too, as foreign-bucket events.)
    eventually(lambda: stack.router.stats["copies"] >= 1, "the store's copy to reach the router", WAIT_S)
    assert stack.sink.jobs.empty()
    assert stack.router.stats["jobs_index"] == 1
