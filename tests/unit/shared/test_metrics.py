"""The metrics facade: what each plain class records as work happens, under the names the exposition
shows; the federation of the nodes' endpoints; ``/metrics`` without a catalog scan; the job's
structured log line."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from events.jobs import IndexJob, JobOp, JobSource
from pipeline import metrics as vm
from pipeline.api.app import create_app
from pipeline.api.node_metrics import NodeMetrics, QueueDepths, merge, vidx_lines
from pipeline.api.prometheus import exposition
from pipeline.failures import FailureReason, failure_reason
from pipeline.index.clock import StageClock
from pipeline.index.consumer import IndexTaskHandler, TaskContext
from pipeline.index.joblog import log_job
from pipeline.settings import Settings
from storage.errors import CorruptVideo, LimitExceeded, NotAVideo, TransientError
from tests.unit.api.test_api import FakeJobs, FakeSearch, FakeStore, router_stats
from tests.unit.index.test_consumer import JOB, Letters, Runner

ROOT = Path(__file__).resolve().parents[3]


def values(backend: vm.MemoryBackend) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """sample name and labels -> value, of everything recorded on ``backend``."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in backend.families() for s in f.samples}


def test_each_recording_lands_under_its_exported_name() -> None:
    backend = vm.MemoryBackend()
    metrics = vm.Metrics(backend)
    metrics.job("indexed", 1.5)
    metrics.failed(FailureReason.NOT_A_VIDEO, "permanent")
    metrics.stages({"fetch": 0.2, "decode": 0.7, "mystery": 0.1})
    metrics.frames_embedded(8)
    metrics.frames_embedded(0)  # nothing happened: nothing recorded (Ray refuses 0)
    metrics.bucket_event("jobs_index", 2)
    metrics.encoder_batch("frames", 24)
    metrics.search("text", 0.03)
    metrics.reconcile_round({"missing": 2, "stale": 0}, submitted=2)
    got = values(backend)
    assert got[("ray_vidx_jobs_total", (("outcome", "indexed"),))] == 1
    assert got[("ray_vidx_job_seconds_sum", (("outcome", "indexed"),))] == 1.5
    assert got[("ray_vidx_videos_failed_total", (("reason", "not_a_video"),))] == 1
    assert got[("ray_vidx_dead_letters_total", (("kind", "permanent"),))] == 1
    assert got[("ray_vidx_stage_seconds_count", (("stage", "decode"),))] == 1
    assert got[("ray_vidx_stage_seconds_count", (("stage", "other"),))] == 1
    assert got[("ray_vidx_frames_embedded_total", ())] == 8
    assert got[("ray_vidx_bucket_events_total", (("kind", "jobs_index"),))] == 2
    assert got[("ray_vidx_encoder_batch_size_bucket", (("le", "32.0"), ("method", "frames")))] == 1
    assert got[("ray_vidx_search_seconds_count", (("kind", "text"), ("outcome", "ok")))] == 1
    assert got[("ray_vidx_reconcile_findings_total", (("finding", "missing"),))] == 2
    assert ("ray_vidx_reconcile_findings_total", (("finding", "stale"),)) not in got
    assert got[("ray_vidx_reconcile_rounds_total", ())] == 1 and got[("ray_vidx_reconcile_repairs_total", ())] == 2
    # Every sample recorded is one the facade lists (what the dashboard test checks against).
    assert {name for name, _ in got} <= vm.sample_names()


def test_the_null_backend_records_nothing_and_never_fails() -> None:
    metrics = vm.Metrics()
    metrics.job("failed", 0.1)
    metrics.stages({"head": 0.01})


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (NotAVideo("no video stream"), FailureReason.NOT_A_VIDEO),
        (CorruptVideo("moov atom not found"), FailureReason.DECODE_ERROR),
        (LimitExceeded("exceeds max bytes 10 (object is 20 bytes)"), FailureReason.TOO_LARGE),
        (LimitExceeded("exceeds max duration 4h (video is 5h)"), FailureReason.TOO_LONG),
        (LimitExceeded("exceeds max frames per video 10 (at 00:00:10)"), FailureReason.TOO_MANY_FRAMES),
        (LimitExceeded("frame 9000x9000 exceeds max pixels per frame 100"), FailureReason.TOO_MANY_PIXELS),
        (LimitExceeded("exceeds max decode time 10m (stuck at 00:01; abandoned)"), FailureReason.DECODE_TIMEOUT),
        (LimitExceeded("over some new bound"), FailureReason.OVER_LIMIT),
        (TransientError("HEAD: 503"), FailureReason.TRANSIENT_EXHAUSTED),
        (RuntimeError("boom"), FailureReason.INTERNAL_ERROR),
    ],
)
def test_failures_fall_in_a_small_closed_set_of_reasons(error: Exception, reason: FailureReason) -> None:
    assert failure_reason(error) is reason


def test_the_consumer_counts_outcomes_failures_and_dead_letters() -> None:
    backend = vm.MemoryBackend()
    metrics = vm.Metrics(backend)
    body = JOB.model_dump(mode="json")
    IndexTaskHandler(Runner(), Letters(), 3, metrics).handle(body, TaskContext("t1", 0))
    IndexTaskHandler(Runner(CorruptVideo("bad")), Letters(), 3, metrics).handle(body, TaskContext("t2", 0))
    with pytest.raises(TransientError):
        IndexTaskHandler(Runner(TransientError("503")), Letters(), 3, metrics).handle(body, TaskContext("t3", 0))
    IndexTaskHandler(Runner(TransientError("503")), Letters(), 3, metrics).handle(body, TaskContext("t3", 3))
    IndexTaskHandler(Runner(), Letters(), 3, metrics).handle({"op": "nonsense"}, TaskContext("t4", 0))
    got = values(backend)
    jobs = {dict(labels)["outcome"]: v for (name, labels), v in got.items() if name == "ray_vidx_jobs_total"}
    assert jobs == {"indexed": 1, "failed": 3, "retry": 1}
    failed = {dict(lb)["reason"]: v for (name, lb), v in got.items() if name == "ray_vidx_videos_failed_total"}
    assert failed == {"decode_error": 1, "transient_exhausted": 1, "malformed_job": 1}
    letters = {dict(lb)["kind"]: v for (name, lb), v in got.items() if name == "ray_vidx_dead_letters_total"}
    assert letters == {"permanent": 1, "exhausted": 1, "malformed": 1}


def test_every_stage_the_indexer_times_is_a_known_stage() -> None:
    source = (ROOT / "pipeline" / "index" / "indexer.py").read_text()
    timed = set(re.findall(r'clock\.(?:stage|timed)\("(\w+)"', source))
    assert timed and timed <= set(vm.STAGES)


def test_the_controllers_metric_names_are_the_ones_listed() -> None:
    source = (ROOT / "pipeline" / "serve" / "autoscale.py").read_text()
    for metric in vm.METRICS:
        if metric.source is vm.Source.CONTROLLER:
            assert f'"{metric.name}"' in source


def ray_node_text(worker: str, backend: vm.MemoryBackend) -> str:
    """What a Ray node's endpoint shows: vidx's families with Ray's and OpenTelemetry's labels, among
    Ray's own families."""
    text = backend.exposition()
    labelled = re.sub(
        r"^(ray_vidx_\w+)\{", rf'\1{{WorkerId="{worker}",otel_scope_name="ray",', text, flags=re.MULTILINE
    )
    labelled = re.sub(r"^(ray_vidx_\w+) ", rf'\1{{WorkerId="{worker}",otel_scope_name="ray"}} ', labelled, flags=re.M)
    ray_own = '# HELP ray_tasks Tasks\n# TYPE ray_tasks gauge\nray_tasks{State="RUNNING"} 3.0\n'
    return ray_own + labelled


def test_nodes_are_merged_into_one_family_per_name_without_otel_labels() -> None:
    one, two = vm.MemoryBackend(), vm.MemoryBackend()
    vm.Metrics(one).frames_embedded(3)
    vm.Metrics(two).frames_embedded(4)
    vm.Metrics(two).search("image", 0.2)
    assert "ray_tasks" not in vidx_lines(ray_node_text("w1", one))
    families = {f.name: f for f in merge([ray_node_text("w1", one), ray_node_text("w2", two)])}
    assert set(families) == {"ray_vidx_frames_embedded", "ray_vidx_search_seconds"}
    frames = families["ray_vidx_frames_embedded"]
    assert sorted((s.labels["WorkerId"], s.value) for s in frames.samples) == [("w1", 3.0), ("w2", 4.0)]
    assert all("otel_scope_name" not in s.labels for f in families.values() for s in f.samples)


def test_a_node_that_does_not_answer_is_left_out() -> None:
    good = vm.MemoryBackend()
    vm.Metrics(good).frames_embedded(5)

    async def fetch(url: str) -> str:
        if "down" in url:
            raise OSError("connection refused")
        return ray_node_text("w1", good)

    node_metrics = NodeMetrics(lambda: ["http://up:1/metrics", "http://down:1/metrics"], 1.0, fetch)
    [family] = asyncio.run(node_metrics.families())
    assert [s.value for s in family.samples] == [5.0]


def test_a_queue_whose_depth_fails_is_left_out() -> None:
    def broken() -> int:
        raise RuntimeError("management API answered 500")

    depths = QueueDepths({"index": lambda: 7, "failed": broken}, timeout_s=1.0)
    assert asyncio.run(depths()) == {"index": 7}


def test_metrics_show_the_replicas_recordings_and_never_scan_the_catalog() -> None:
    settings = Settings()
    store = FakeStore()
    reads: list[None] = []
    store.catalog._answer = lambda: reads.append(None)  # type: ignore[method-assign]  # every read of it calls this
    recorded = vm.MemoryBackend()
    metrics = vm.Metrics(recorded)
    metrics.job("indexed", 2.0)
    metrics.failed(FailureReason.DECODE_ERROR, "permanent")
    metrics.encoder_batch("frames", 16)

    async def families() -> list[Any]:
        return merge([ray_node_text("w1", recorded)])

    async def queues() -> dict[str, int]:
        return {"index": 3}

    app = create_app(
        settings,
        FakeSearch(settings.limits),  # type: ignore[arg-type]
        store,  # type: ignore[arg-type]
        FakeJobs(),
        router_stats,
        queues=queues,
        recorded=families,
    )
    resp = TestClient(app, raise_server_exceptions=False).get("/metrics")
    assert resp.status_code == 200
    parsed = {s.name: s for f in text_string_to_metric_families(resp.text) for s in f.samples}
    assert parsed["ray_vidx_jobs_total"].value == 1 and parsed["ray_vidx_jobs_total"].labels["WorkerId"] == "w1"
    assert parsed["ray_vidx_videos_failed_total"].labels["reason"] == "decode_error"
    assert parsed["ray_vidx_encoder_batch_size_count"].value == 1
    assert parsed["vidx_queue_messages"].value == 3 and parsed["vidx_router_connected"].value == 1
    assert reads == []


def test_a_scrape_is_bounded_when_the_node_list_never_comes() -> None:
    """The GCS away: ``ray.nodes()`` blocks; /metrics still answers, without the replicas' families."""
    release = threading.Event()

    def blocked() -> list[str]:
        release.wait(600)  # past the test timeout: an unbounded scrape fails the test
        return []

    node_metrics = NodeMetrics(blocked, timeout_s=0.2)

    async def stats() -> dict[str, Any]:
        return {"connected": 1}

    async def scrape() -> str:
        try:
            return await exposition(stats, recorded=node_metrics.families)
        finally:
            release.set()  # before asyncio.run joins its worker threads: the blocked one among them

    text = asyncio.run(scrape())
    assert "vidx_router_connected 1.0" in text and "ray_vidx_" not in text


def test_a_jobs_line_is_one_json_object_with_its_fields() -> None:
    from ray._common.formatters import JSONFormatter  # what Serve's JSON log encoding writes with

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("pipeline.index.joblog")
    keep = Keep()
    logger.addHandler(keep)
    logger.setLevel(logging.INFO)
    try:
        clock = StageClock()
        for stage in ("fetch", "decode"):
            with clock.stage(stage):
                pass
        clock.seconds.update({"fetch": 0.25, "decode": 1.5})
        job = IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.EVENT)
        log_job(job, "task-9", clock, 2.0, outcome="indexed", frames=12)
        failing = StageClock()
        with pytest.raises(NotAVideo), failing.stage("decode"):
            raise NotAVideo("no video stream")
        log_job(job, "task-10", failing, 0.5, error=NotAVideo("no video stream"))
    finally:
        logger.removeHandler(keep)
    # Serve drops a record's own ``task_id`` attribute (Ray's task id) before it formats the line.
    from ray.serve._private.logging_utils import ServeLogAttributeRemovalFilter

    for record in records:
        record.task_id = "ray-task"
        ServeLogAttributeRemovalFilter().filter(record)
    done, failed = (json.loads(JSONFormatter().format(r)) for r in records)
    assert done["video_id"] == job.video_id and done["task_id"] == "task-9"
    assert (done["outcome"], done["frames"], done["duration_s"]) == ("indexed", 12, 2.0)
    assert done["stages_s"] == {"fetch": 0.25, "decode": 1.5}
    # The text is the one bench/e2e.py reads.
    assert done["message"].startswith(f"job index {job.uri} -> indexed (12 frames) in 2.00s: fetch=0.25s")
    assert (failed["outcome"], failed["reason_class"], failed["task_id"]) == ("failed", "not_a_video", "task-10")
    assert failed["reason"] == "not a video: no video stream" and failed["levelname"] == "WARNING"
    # A failed job's line names the stage it failed in; a finished one's says done.
    assert (done["stage"], failed["stage"]) == ("done", "decode")
