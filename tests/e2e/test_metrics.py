"""Observability of the real app: ``/metrics`` on the Api shows what every replica recorded as it
worked (the consumer's jobs and stages, the Encoder's batches, the router's events, the Api's
searches), the live queue depths and replica counts; each job logs one JSON line with its fields."""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from infra.harness.faults import AppHost, start_app
from infra.harness.procs import children_running
from infra.harness.services import Services, eventually, unique_prefix
from storage.catalog import VideoRecord, VideoStatus
from storage.ids import video_id
from storage.tables import IndexStore
from tests.media import frame_at, write_corrupt_mp4, write_video

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

INDEX_TIMEOUT_S = 120.0
#: Longest wait for a recorded value to reach /metrics (the harness sets a 1 s report interval).
METRICS_TIMEOUT_S = 60.0
STAGES = ("head", "fetch", "decode", "embed", "write", "catalog")


def samples(text: str, name: str, **labels: str) -> list[Sample]:
    """The samples called ``name`` in the exposition ``text`` whose labels include ``labels``."""
    return [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]


def metric_sum(text: str, name: str, **labels: str) -> float:
    return sum(s.value for s in samples(text, name, **labels))


@pytest.fixture(scope="module")
def host(services: Services, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AppHost]:
    # Scheduled check rounds every few seconds, so their counters move during the test; objects
    # just uploaded count at once (no grace), so the drift the test makes is found in the next round.
    # The split layout (the default on a GPU cluster), so the Encoder embeds frames and its frame batches
    # are among the metrics; the other e2e tests run the CPU default, fused.
    # Ray's workers at niceness 0, not Ray's default 15: the niceness tests then see each level (at 15 a
    # decode worker is at 19, the most there is, whether or not it was started from a niced thread).
    env = {
        "VIDX_CHECK__INTERVAL_S": "3",
        "VIDX_CHECK__NEW_OBJECT_GRACE_S": "0",
        "VIDX_SERVE__LAYOUT": "split",
        "RAY_worker_niceness": "0",
    }
    with start_app(services, unique_prefix(), tiny_model_dir, tmp_path_factory.mktemp("state"), env) as app:
        yield app


def status(host: AppHost, vid: str) -> str | None:
    resp = host.http.get(f"/v1/videos/{vid}")
    return str(resp.json()["status"]) if resp.status_code == 200 else None


def job_lines(deployment: str) -> list[dict[str, Any]]:
    """The JSON lines of ``deployment``'s replica log files in this Ray session."""
    import ray

    node: Any = ray._private.worker._global_node
    lines = []
    for path in (Path(node.get_session_dir_path()) / "logs" / "serve").glob(f"replica_*_{deployment}_*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                lines.append(json.loads(line))
    return lines


def test_metrics_come_from_every_replica_and_jobs_log_json(host: AppHost, tmp_path: Path) -> None:
    minio = host.services.minio_client()
    good = []
    for n in (1, 2):
        path = write_video(tmp_path / f"{n}.mp4", seconds=3, seed=700 + n)
        minio.fput_object(host.bucket, f"m/good {n}.mp4", str(path), content_type="video/mp4")
        good.append(video_id(host.bucket, f"m/good {n}.mp4"))
    minio.fput_object(host.bucket, "m/broken.mp4", str(write_corrupt_mp4(tmp_path / "broken.mp4")))
    bad = video_id(host.bucket, "m/broken.mp4")
    minio.put_object(host.bucket, "m/readme.txt", io.BytesIO(b"hi"), 2, content_type="text/plain")
    for vid in good:
        eventually(lambda v=vid: status(host, v) == "indexed", f"{vid} to be indexed", INDEX_TIMEOUT_S, poll_s=0.5)  # type: ignore[misc]
    eventually(lambda: status(host, bad) == "failed", "the broken video to fail", INDEX_TIMEOUT_S, poll_s=0.5)
    assert host.http.get("/v1/search", params={"q": "a red car", "k": 3}).status_code == 200
    png = io.BytesIO()
    from PIL import Image

    Image.fromarray(frame_at(1, 701)).save(png, format="PNG")
    resp = host.http.post("/v1/search/image?k=3", files={"image": ("q.png", png.getvalue(), "image/png")})
    assert resp.status_code == 200, resp.text
    # A deleted video, a parked bucket event, and drift that only the scheduled check can find: a
    # catalog row, written behind the pipeline's back, for an object that was never uploaded (no
    # bucket event will ever name it).
    minio.remove_object(host.bucket, "m/good 2.mp4")
    eventually(lambda: status(host, good[1]) == "deleted", "the deleted video", INDEX_TIMEOUT_S, poll_s=0.5)
    amqp = host.settings.amqp
    connection = pika.BlockingConnection(pika.URLParameters(host.services.amqp_url))
    try:
        connection.channel().basic_publish(amqp.exchange, amqp.routing_key, b"\x00not a bucket event")
    finally:
        connection.close()
    store = IndexStore(host.settings.s3)
    ghost = video_id(host.bucket, "m/never uploaded.mp4")
    row = VideoRecord(ghost, f"s3://{host.bucket}/m/never uploaded.mp4", VideoStatus.INDEXED, version="gone")
    assert store.catalog.write(row, 0) is not None

    def wanted(text: str) -> list[str]:
        """What is not yet as it should be (empty once everything is)."""
        missing = []

        def need(what: str, ok: bool) -> None:
            if not ok:
                missing.append(what)

        consumer = {"deployment": "IndexConsumer"}
        need("indexed jobs", metric_sum(text, "ray_vidx_jobs_total", outcome="indexed", **consumer) >= 2)
        need("failed job", metric_sum(text, "ray_vidx_jobs_total", outcome="failed", **consumer) >= 1)
        need("deleted job", metric_sum(text, "ray_vidx_jobs_total", outcome="deleted", **consumer) >= 1)
        need("decode error", metric_sum(text, "ray_vidx_videos_failed_total", reason="decode_error", **consumer) >= 1)
        need("dead letter", metric_sum(text, "ray_vidx_dead_letters_total", kind="permanent", **consumer) >= 1)
        # Three seconds sampled every second: three frames per job that embedded a video (the two good ones).
        frames = metric_sum(text, "ray_vidx_frames_embedded_total", **consumer)
        need(f"frames ({frames:g})", frames >= 6 and frames % 3 == 0)
        for stage in STAGES:
            need(f"stage {stage}", metric_sum(text, "ray_vidx_stage_seconds_count", stage=stage, **consumer) >= 2)
        need(
            "job seconds",
            metric_sum(text, "ray_vidx_job_seconds_bucket", outcome="indexed", le="+Inf", **consumer) >= 2,
        )
        encoder = {"deployment": "Encoder"}
        need("frame batches", metric_sum(text, "ray_vidx_encoder_batch_size_count", method="frames", **encoder) >= 1)
        need("text batch", metric_sum(text, "ray_vidx_encoder_batch_size_count", method="text", **encoder) >= 1)
        need("image batch", metric_sum(text, "ray_vidx_encoder_batch_size_count", method="image", **encoder) >= 1)
        api = {"deployment": "Api"}
        need("text search", metric_sum(text, "ray_vidx_search_seconds_count", kind="text", **api) >= 1)
        need("image search", metric_sum(text, "ray_vidx_search_seconds_count", kind="image", **api) >= 1)
        router = {"deployment": "EventRouter"}
        need("index events", metric_sum(text, "ray_vidx_bucket_events_total", kind="jobs_index", **router) >= 3)
        need("ignored .txt", metric_sum(text, "ray_vidx_bucket_events_total", kind="ignored_not_video", **router) >= 1)
        need("parked event", metric_sum(text, "ray_vidx_bucket_events_total", kind="parked", **router) == 1)
        upkeep = {"deployment": "Upkeep"}  # the scheduled check runs in the Upkeep deployment
        need("reconcile rounds", metric_sum(text, "ray_vidx_reconcile_rounds_total", **upkeep) >= 1)
        need("orphan found", metric_sum(text, "ray_vidx_reconcile_findings_total", finding="orphaned", **upkeep) >= 1)
        need("orphan repaired", status(host, ghost) == "deleted")  # only the check's repair job does that
        for queue in ("events", "index", "failed", "parked"):
            need(f"queue {queue}", len(samples(text, "vidx_queue_messages", queue=queue)) == 1)
        need("dead letter queued", metric_sum(text, "vidx_queue_messages", queue="failed") >= 1)
        need("event parked", metric_sum(text, "vidx_queue_messages", queue="parked") == 1)
        need("replicas", metric_sum(text, "vidx_serve_replicas", deployment="IndexConsumer", state="RUNNING") >= 1)
        need("router connected", metric_sum(text, "vidx_router_connected") == 1)
        return missing

    deadline = time.monotonic() + METRICS_TIMEOUT_S
    missing = ["nothing scraped yet"]
    while missing and time.monotonic() < deadline:
        resp = host.http.get("/metrics")
        assert resp.status_code == 200
        missing = wanted(resp.text)
        if missing:
            time.sleep(1.0)
    assert not missing, f"not in /metrics after {METRICS_TIMEOUT_S}s: {missing}"
    text = resp.text
    shown = {
        "indexed": metric_sum(text, "ray_vidx_jobs_total", outcome="indexed"),
        "failed": metric_sum(text, "ray_vidx_jobs_total", outcome="failed"),
        "deleted": metric_sum(text, "ray_vidx_jobs_total", outcome="deleted"),
        "frames": metric_sum(text, "ray_vidx_frames_embedded_total"),
        "frame_batches": metric_sum(text, "ray_vidx_encoder_batch_size_count", method="frames"),
        "parked": metric_sum(text, "ray_vidx_bucket_events_total", kind="parked"),
        "findings": metric_sum(text, "ray_vidx_reconcile_findings_total"),
        "searches": metric_sum(text, "ray_vidx_search_seconds_count"),
        "families": len({f.name for f in text_string_to_metric_families(text)}),
    }
    print("\n/metrics: " + ", ".join(f"{k} {v:g}" for k, v in shown.items()))
    # Plausible values: a tiny 3 s video's job takes under two minutes; a frames call holds at most
    # its callers' chunks (3 frames per video here), a query call one query.
    jobs = metric_sum(text, "ray_vidx_job_seconds_count", outcome="indexed")
    assert metric_sum(text, "ray_vidx_job_seconds_bucket", outcome="indexed", le="120.0") == jobs
    for method, most in (("frames", "16.0"), ("text", "1.0"), ("image", "1.0")):
        calls = metric_sum(text, "ray_vidx_encoder_batch_size_count", method=method)
        assert metric_sum(text, "ray_vidx_encoder_batch_size_bucket", method=method, le=most) == calls, method

    # One JSON line per job, with its fields.
    lines = job_lines("IndexConsumer")
    done = [line for line in lines if line.get("video_id") == good[0] and line.get("outcome") == "indexed"]
    assert done, f"no JSON job line for {good[0]} among {len(lines)} lines"
    assert len({line["task_id"] for line in done}) == len(done)  # one line per job
    line = done[0]
    assert line["task_id"] and line["frames"] == 3 and line["duration_s"] > 0
    assert set(STAGES) <= set(line["stages_s"]) and line["deployment"].endswith("IndexConsumer")
    failed = [line for line in lines if line.get("video_id") == bad and line.get("outcome") == "failed"]
    assert failed and failed[-1]["reason_class"] == "decode_error" and failed[-1]["task_id"]
    # A failed job's line names the stage it failed in: a corrupt file fails in decode.
    assert line["stage"] == "done" and failed[-1]["stage"] == "decode", (line["stage"], failed[-1]["stage"])


def niceness(pid: int, tid: int | None = None) -> int:
    """A process's (or one of its threads') nice value (/proc/<pid>[/task/<tid>]/stat, field 19; the
    command name may hold spaces)."""
    path = Path(f"/proc/{pid}/stat") if tid is None else Path(f"/proc/{pid}/task/{tid}/stat")
    fields = path.read_text().rsplit(")", 1)[1].split()
    return int(fields[16])


def test_consumer_replicas_work_at_the_apis_priority_once_started(host: AppHost) -> None:
    """A consumer replica is niced only while it starts (``serve.consumer_start_nice``): once running,
    every thread of its process is back at Ray's niceness, the Api's (pipeline/serve/resources.py
    ``niced_while_starting``; its nicing during the start is shown by tests/unit/serve/test_niced_while_starting.py).
    Autoscaling may be starting a replica right now: that one is niced until its start ends."""
    assert host.settings.serve.consumer_start_nice > 0
    (api,) = host.replica_pids("Api")
    seen: dict[str, object] = {}

    def all_at_the_apis() -> bool:
        consumers = host.replica_pids("IndexConsumer")
        threads = set()
        for pid in consumers:
            with contextlib.suppress(FileNotFoundError):  # a replica stopped, or a thread ended, meanwhile
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(FileNotFoundError):
                        threads.add((pid, int(tid), niceness(pid, int(tid))))
        seen.update(consumers=consumers, threads=threads)
        # every thread of each replica, not only its main one
        return bool(consumers) and len(threads) > len(consumers) and {n for _, _, n in threads} == {niceness(api)}

    try:
        eventually(all_at_the_apis, "every consumer thread at the Api's niceness", 120.0, poll_s=1.0)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen: {seen}") from exc


def test_the_decode_workers_a_consumer_starts_with_it_run_decode_niceness_above_it(host: AppHost) -> None:
    """A consumer replica starts its decode workers as it starts (``start_decoders``), after its niced
    start-up: they decode ``DECODE_NICENESS`` above the replica's running niceness (the Api's), not on top
    of the start-up's nicing too (which would leave them at 19 for their whole life)."""
    from pipeline.media.decode import DECODE_NICENESS

    (api,) = host.replica_pids("Api")
    want = min(19, niceness(api) + DECODE_NICENESS)
    assert want < 19, f"the Api runs at niceness {niceness(api)}: every decode worker would be at 19"
    seen: dict[int, dict[int, int]] = {}

    def workers_at_decode_niceness() -> bool:
        seen.clear()
        for pid in host.replica_pids("IndexConsumer"):
            with contextlib.suppress(FileNotFoundError):
                seen[pid] = {w: niceness(w) for w in children_running(pid)}
        # every replica has its workers (one per decode slot), each at the decode niceness
        return bool(seen) and all(seen.values()) and {n for w in seen.values() for n in w.values()} == {want}

    try:
        eventually(workers_at_decode_niceness, f"every consumer's decode workers at niceness {want}", 120.0, poll_s=1.0)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen (replica: {{worker: niceness}}): {seen}") from exc
