"""A model switch on the real app (Ray Serve, MinIO, RabbitMQ, LanceDB on MinIO): videos indexed with
tiny model A are re-embedded with tiny model B (another dimension) by ``vidx reindex --model``,
while search keeps answering from A, uploads during the backfill are indexed with both, a consumer
is SIGKILLed in the middle of a backfill job and then every process of the app is SIGKILLed and
the app started again. Afterwards B answers, every video is found with it, and the consistency
checker finds 0 inconsistencies in either model's table.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from infra.dev.samples import expected_sample_count
from infra.harness.faults import STARTUP_TIMEOUT_S, AppHost, _free_port, start_app
from infra.harness.procs import children_running, stopped
from infra.harness.services import Services, eventually, queue_counts, unique_prefix
from pipeline.upkeep.backfill import has_model
from pipeline.upkeep.check import build_checker
from storage.catalog import VideoStatus
from storage.ids import fingerprint, video_id
from storage.models import ModelTable
from storage.sampling import Sampling
from storage.tables import IndexStore
from tests.harness import report_lines
from tests.media import frame_at, write_video

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

EVERY_S = 1.0
SECONDS = 6
#: Videos indexed with A before the switch, and uploaded while the backfill runs.
BEFORE = 12
DURING = 2
SEED = 7100
#: One backfill job at a time, a round every 2 s: the backfill lasts long enough to be interrupted.
ENV = {
    # Every job claims at once: the suite finds a running backfill job, and the consumer to kill, by
    # its claim, and holds the crash that kill makes (a first start shorter than claim_after_s leaves
    # no marker to count it by: docs/design/state-machine.md, "The lazy claim").
    "VIDX_SERVE__CLAIM_AFTER_S": "0",
    "VIDX_SAMPLING__EVERY_S": str(EVERY_S),
    "VIDX_REINDEX__INTERVAL_S": "2",
    "VIDX_REINDEX__MAX_OUTSTANDING": "1",
    "VIDX_REINDEX__CLOCK_SKEW_S": "0",
    "VIDX_WRITER__CATALOG_WRITE_TIMEOUT_S": "20",
    # The test runs the check itself, at the moments it chooses.
    "VIDX_CHECK__INTERVAL_S": "0",
    "VIDX_API_KEY": "switch-test-user-key-0001",
    "VIDX_ADMIN_KEY": "switch-test-admin-key-0001",
}
USER = {"Authorization": f"Bearer {ENV['VIDX_API_KEY']}"}
ADMIN = {"Authorization": f"Bearer {ENV['VIDX_ADMIN_KEY']}"}
INDEX_TIMEOUT_S = 180.0
SWITCH_TIMEOUT_S = 420.0
BUSY_TIMEOUT_S = 60.0
#: A job's row seen ``indexing`` at one revision this far apart is held in its decode (wait_for_job).
HELD_S = 1.0
SEARCH_EVERY_S = 0.5
#: Consumers killed at most, each while it seemed to hold a backfill job, until one kill lands mid-job.
KILL_ATTEMPTS = 5
#: How long after the switch an Api replica may still answer from the old model (its lifecycle
#: re-read interval, ``reindex.live_refresh_s``, plus a margin).
STALE_ANSWER_S = 5.0


@dataclass
class Answers:
    """What the searcher saw: (sent, answered, model) of each answer, and (sent, failed, error) of
    each search that failed (the app restarting, and nothing else)."""

    seen: list[tuple[datetime, datetime, str]] = field(default_factory=list)
    missed: int = 0
    wrong_top: list[str] = field(default_factory=list)
    errors: list[tuple[datetime, datetime, str]] = field(default_factory=list)

    def errors_outside(self, down_from: datetime, up_at: datetime) -> list[str]:
        """Failed searches other than those that failed after ``down_from`` and were sent before ``up_at``."""
        return [
            f"{sent.isoformat()} {name}" for sent, failed, name in self.errors if failed < down_from or sent > up_at
        ]


def image_search(http: httpx.Client, rgb: Any) -> dict[str, Any]:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    resp = http.post("/v1/search/image?k=3", files={"image": ("q.png", buf.getvalue(), "image/png")})
    resp.raise_for_status()
    return dict(resp.json())


def search_all_along(base_url: str, seeds: Mapping[str, int], stop: threading.Event, answers: Answers) -> None:
    """Search every ``SEARCH_EVERY_S`` until ``stop`` (bounded: the test sets it): a text query and an
    image query of one of the videos indexed before the switch, which must come out on top."""
    vids = list(seeds)
    deadline = time.monotonic() + SWITCH_TIMEOUT_S + 2 * STARTUP_TIMEOUT_S + 600
    n = 0
    with httpx.Client(base_url=base_url, timeout=30, headers=USER) as http:
        while not stop.is_set() and time.monotonic() < deadline:
            n += 1
            vid = vids[n % len(vids)]
            sent = datetime.now(UTC)
            try:
                text = http.get("/v1/search", params={"q": "a dog on a beach", "k": 3})
                text.raise_for_status()
                answered = datetime.now(UTC)
                image_sent = answered
                body = image_search(http, frame_at(2, seeds[vid], (64, 48)))
            except httpx.HTTPError as exc:
                answers.errors.append((sent, datetime.now(UTC), type(exc).__name__))
            else:
                at = datetime.now(UTC)
                answers.seen.append((sent, answered, str(text.json()["model"])))
                answers.seen.append((image_sent, at, str(body["model"])))
                if not body["results"] or not text.json()["results"]:
                    answers.missed += 1
                elif body["results"][0]["video_id"] != vid:
                    answers.wrong_top.append(f"{at.isoformat()} {body['model']}: {vid} not on top")
            stop.wait(SEARCH_EVERY_S)


def kill_everything(host: AppHost) -> str:
    """SIGKILL every replica of the app, then every process of the Ray instance (raylet, GCS,
    dashboard, monitors; the Serve controller, proxies and other workers die with their raylet).

    The test process is Ray's driver: it disconnects first, while the GCS still answers (its
    actors are all detached, so nothing of the app stops for it). A driver left connected to a
    killed GCS waits for it, and after a minute Ray exits the test process."""
    import ray

    deployments = ("IndexConsumer", "Encoder", "EventRouter", "Upkeep", "Api", "CatalogWriter")
    pids = [pid for d in deployments for pid in host.replica_pids(d)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    node = ray._private.worker._global_node
    processes = [info.process for infos in node.all_processes.values() for info in infos if info.process is not None]
    ray._private.worker._global_node = None  # the shutdown below leaves the processes to the kill
    ray.shutdown()
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    for process in processes:
        process.wait(timeout=30)
    return f"SIGKILL {len(pids)} replicas and the Ray instance's {len(processes)} processes"


def wait_for_job(store: IndexStore, uris: set[str]) -> tuple[str, str]:
    """A video of ``uris`` being indexed right now, and the consumer holding it: an ``indexing`` row with
    a holder, seen at the same revision ``HELD_S`` apart (a job held in its decode stays; one already
    past it settles meanwhile)."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    last: dict[str, int] = {}
    while time.monotonic() < deadline:
        running = {
            r.uri: r for r in store.catalog.find(status=VideoStatus.INDEXING, limit=100) if r.uri in uris and r.holder
        }
        for uri, record in running.items():
            if last.get(uri) == record.rev and record.holder:
                return uri, record.holder
        last = {uri: r.rev for uri, r in running.items()}
        time.sleep(HELD_S)
    raise AssertionError(f"no backfill job was running within {BUSY_TIMEOUT_S:.0f}s")


def kill_a_backfill_job(host: AppHost, store: IndexStore, vids: Mapping[str, str], lines: list[str]) -> tuple[int, int]:
    """SIGKILL the consumer running a backfill job of one of ``vids`` (video id by uri) in the middle of
    it, and see the kill land there: the task comes back to another consumer, which counts the dead
    holder as a crash of the video and indexes it. Every consumer's decode workers are stopped
    (SIGSTOP) while the job is looked for, so a job that claimed its row waits in its decode until its
    consumer is killed (a job of a few frames is over in a fraction of a second: a kill aimed at one by
    timing alone missed five times in a row in CI); they go on once the kill is sent. A kill that still
    lands after its job (one past its decode when they were stopped) is a miss and the next running job is
    killed (at most ``KILL_ATTEMPTS``). Returns the backfill's progress at the kill that landed."""
    for attempt in range(1, KILL_ATTEMPTS + 1):
        pids = host.replica_pids_by_name("IndexConsumer")
        with stopped(w for pid in pids.values() for w in children_running(pid)) as held:
            assert held, f"no decode worker of the consumers {sorted(pids.values())} to hold"
            uri, holder = wait_for_job(store, set(vids))
            pid = pids.get(host.actor_name(holder) or "") or host.replica_pid(holder)
            if pid is None:
                continue  # a replica started since the look (its workers run): the job ended with it
            os.kill(pid, signal.SIGKILL)
            at_kill = done(store)
        vid = vids[uri]

        def settled(vid: str = vid) -> bool:
            record = store.catalog.get(vid)
            return record is not None and record.status is VideoStatus.INDEXED

        eventually(settled, f"{uri} indexed after its consumer's kill", INDEX_TIMEOUT_S, 0.2)
        record = store.catalog.get(vid)
        assert record is not None
        lines.append(
            f"  SIGKILL consumer pid {pid} while it re-embedded {uri}, its decode held (try {attempt}); backfill "
            f"at {at_kill[0]}/{at_kill[1]}; the video's crashes: {record.crashes}"
        )
        if record.crashes >= 1:
            return at_kill
    raise AssertionError(f"no consumer was killed in the middle of a backfill job in {KILL_ATTEMPTS} tries")


def done(store: IndexStore) -> tuple[int, int]:
    b = store.models.read().backfill
    return (b.done, b.total) if b is not None else (-1, -1)


def table_rows(store: IndexStore, table: ModelTable, vids: dict[str, str]) -> list[str]:
    """What is wrong with ``table``'s rows of each video (uri by id): rows not exactly one per sampled
    frame, a frame id twice, or a fingerprint other than its content's with that model."""
    problems = []
    want = expected_sample_count(SECONDS, 10, EVERY_S)
    frames = store.frames_table(table.table)
    for vid, uri in vids.items():
        summary = frames.summary(vid)
        record = store.catalog.get(vid)
        assert record is not None and record.version is not None
        fp = fingerprint(record.version, table.model, Sampling(EVERY_S))
        if summary.rows != want or summary.duplicate_ids or set(summary.fingerprints) != {fp}:
            problems.append(f"{table.model} {uri}: {summary.rows} rows (want {want}), {summary.duplicate_ids} repeated")
    return problems


def test_a_model_switch_survives_a_consumer_kill_and_an_app_kill(
    request: pytest.FixtureRequest, services: Services, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from infra.dev.tinymodel import build_tiny_siglip

    model_a = str(tiny_model_dir)
    model_b = str(build_tiny_siglip(tmp_path / "model-b", seed=1, hidden_size=48))
    prefix = unique_prefix()
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    seeds: dict[str, int] = {}
    uris: dict[str, str] = {}
    lines: list[str] = []

    def upload(host: AppHost, n: int) -> str:
        key = f"switch/clip-{n:02d}.mp4"
        path = write_video(tmp_path / f"{n}.mp4", seconds=SECONDS, size=(64, 48), seed=SEED + n)
        services.minio_client().fput_object(host.bucket, key, str(path), content_type="video/mp4")
        vid = video_id(host.bucket, key)
        seeds[vid], uris[vid] = SEED + n, f"s3://{host.bucket}/{key}"
        return vid

    def indexed(store: IndexStore, vids: list[str]) -> bool:
        records = store.catalog.get_many(vids)
        return len(records) == len(vids) and all(r.status is VideoStatus.INDEXED for r in records.values())

    answers = Answers()
    stop = threading.Event()
    # One port for both runs of the app: the searcher follows it across the restart.
    env = {**ENV, "VIDX_SERVE__PORT": str(_free_port())}
    killed = threading.Event()  # set once the test has SIGKILLed the app: then nothing shuts down gracefully
    with start_app(services, prefix, tiny_model_dir, state_dir, env=env, killed=killed) as host:
        store = IndexStore(host.settings.s3)
        before = [upload(host, n) for n in range(BEFORE)]
        eventually(lambda: indexed(store, before), f"{BEFORE} videos indexed with A", INDEX_TIMEOUT_S, 0.5)
        state = store.models.read()
        assert state.active is not None and state.active.model == model_a and state.active.dim == 32
        searcher = threading.Thread(
            target=search_all_along, args=(host.settings.api_url, dict(seeds), stop, answers), daemon=True
        )
        searcher.start()

        from typer.testing import CliRunner

        from pipeline.cli.main import app as cli

        started = CliRunner().invoke(cli, ["reindex", "--model", model_b, "--json"])
        assert started.exit_code == 0, started.output
        target = store.models.read().target
        assert target is not None and target.model == model_b and target.dim == 48
        during = [upload(host, BEFORE + n) for n in range(DURING)]
        # Uploads during the backfill are indexed with both models by their own jobs, and found with A,
        # which still answers.
        eventually(lambda: indexed(store, during), "the uploads during the backfill indexed", INDEX_TIMEOUT_S, 0.5)
        for vid, record in store.catalog.get_many(during).items():
            assert has_model(record, state.active) and has_model(record, target), (uris[vid], record.indexes)
        with httpx.Client(base_url=host.settings.api_url, timeout=30, headers=USER) as http:
            for vid in during:
                body = image_search(http, frame_at(2, seeds[vid], (64, 48)))
                assert body["model"] == model_a and body["results"][0]["video_id"] == vid, (uris[vid], body)
        assert store.models.read().target is not None, "the backfill ended before the uploads were searched"
        progress = host.http.get("/v1/admin/reindex", headers=ADMIN).json()["progress"]
        lines.append(f"model switch: backfill to B started, API progress {progress['done']}/{progress['total']}")

        # A consumer killed while it runs a backfill job.
        eventually(lambda: done(store)[0] >= 2, "two videos backfilled", INDEX_TIMEOUT_S, 0.2)
        at_kill = kill_a_backfill_job(host, store, {uris[v]: v for v in before}, lines)
        # The backfill goes on with the other consumers, then the whole app is killed.
        eventually(lambda: done(store)[0] > at_kill[0], "the backfill to go on", INDEX_TIMEOUT_S, 0.2)
        at_crash = done(store)
        state = store.models.read()
        assert state.target is not None and at_crash[0] < at_crash[1], f"the backfill ended before the kill: {state}"
        down_from = datetime.now(UTC)
        lines.append(f"  {kill_everything(host)} at {at_crash[0]}/{at_crash[1]}")
        killed.set()

    # The whole app again, configured with A as before: the backfill carries on where it was.
    with start_app(services, prefix, tiny_model_dir, state_dir, env=env) as host:
        store = IndexStore(host.settings.s3)

        def searchable() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(
                    f"{host.settings.api_url}/v1/search", params={"q": "x"}, headers=USER, timeout=30
                ).is_success
            return False

        # Up once it answers a search (the Encoder replica may still be starting after /healthz).
        eventually(searchable, "the restarted app to answer a search", STARTUP_TIMEOUT_S, 0.5)
        up_at = datetime.now(UTC)
        resumed = store.models.read()
        # The same backfill carries on: the same table, none of its progress lost.
        assert resumed.target == target, resumed
        resumed_at = done(store)
        assert resumed_at[0] >= at_crash[0], (resumed_at, at_crash)
        eventually(
            lambda: (store.models.read().active or ModelTable("", 0, "")).model == model_b,
            "the switch to B",
            SWITCH_TIMEOUT_S,
            0.5,
        )
        switched = store.models.read()
        assert switched.switched_at is not None and switched.retired and switched.retired[0].model == model_a
        eventually(lambda: indexed(store, before + during), "every video settled", INDEX_TIMEOUT_S, 0.5)
        eventually(lambda: queue_counts(services, host.settings.serve.index_queue) == (0, 0), "queue idle", 120)
        time.sleep(3 * SEARCH_EVERY_S + STALE_ANSWER_S)
        stop.set()
        searcher.join(timeout=30)

        # Search answers from B now, and finds every video with it (the ones uploaded meanwhile too).
        for vid in before + during:
            with httpx.Client(base_url=host.settings.api_url, timeout=30, headers=USER) as http:
                body = image_search(http, frame_at(2, seeds[vid], (64, 48)))
            assert body["model"] == model_b and body["results"][0]["video_id"] == vid, (uris[vid], body)
        # The during-backfill uploads were found with A while the backfill ran (see the searcher)
        # and are in A's table as well as B's, each exactly once per sampled frame.
        active, old = switched.active, switched.retired[0]
        assert active is not None
        problems = table_rows(store, active, uris) + table_rows(store, old, uris)
        assert not problems, problems
        # The checker over both models' tables (B active, A kept) and over the live one.
        settings = host.settings
        # A is retired (not live), and still checkable: nothing has changed since the switch.
        report_both = build_checker(settings, store, None, models=lambda: [active, old]).run(settings.s3.buckets)
        report_live = build_checker(settings, store, None).run(settings.s3.buckets)
        assert report_both.inconsistencies == 0 and report_live.inconsistencies == 0, report_both.summary()
        assert report_both.models == {model_b: 0, model_a: 0}, report_both.models

    # Search answered from A until the switch and from B after it, with results all along.
    cut = switched.switched_at
    assert cut is not None
    # B answering before the switch: an answer received before it; A after it: a search sent
    # more than the margin after it.
    early_b = [at for _, at, m in answers.seen if m == model_b and at < cut]
    late_a = [sent for sent, _, m in answers.seen if m == model_a and (sent - cut).total_seconds() > STALE_ANSWER_S]
    by_model = Counter(m for _, _, m in answers.seen)
    assert not early_b and not late_a, (early_b[:3], late_a[:3])
    assert by_model[model_a] > 0 and by_model[model_b] > 0 and answers.missed == 0 and not answers.wrong_top
    # Searches failed only while the app was down.
    assert not answers.errors_outside(down_from, up_at), answers.errors_outside(down_from, up_at)[:5]
    lines += [
        f"  restarted: backfill resumed at {resumed_at[0]}/{resumed_at[1]}, switched to B at {cut.isoformat()}",
        f"  searches: {by_model[model_a]} answered by A, {by_model[model_b]} by B, none by B before the switch, "
        f"none by A {STALE_ANSWER_S:g}s after it; {len(answers.errors)} failed while the app was down",
        f"  check: A {report_both.models[model_a]}, B {report_both.models[model_b]} inconsistencies "
        f"({report_both.summary()})",
    ]
    report_lines(request.config, lines)
