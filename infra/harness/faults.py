"""The pieces of a fault scenario: the real Ray Serve app on a local Ray instance (``start_app``), a
seeded stream of uploads, overwrites and deletes with faults fired while it runs (``run_stream``),
the fault injectors, and the check that the index converged on the bucket (``converge``).

The bucket is the truth: after the stream the bucket is listed, and every object in it must be
indexed exactly once at its current version, every deleted object must be gone from ``frames``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import lancedb

from infra.dev.samples import expected_sample_count, write_video
from infra.harness.services import Services, eventually, queue_counts
from infra.harness.shutdown import stop_ray
from pipeline.serve.resources import RAY_NODE_ENV
from pipeline.settings import Settings
from storage.catalog import VIDEOS
from storage.db import sql_quote, storage_options
from storage.frames import FRAMES
from storage.ids import s3_uri, video_id
from storage.models import MODELS

STARTUP_TIMEOUT_S = 240.0
#: Longest wait for a killed replica to be replaced by Serve.
REPLICA_BACK_TIMEOUT_S = 120.0
#: Longest wait for a running index job to kill a consumer in the middle of.
BUSY_TIMEOUT_S = 30.0
#: Attempts (one a second) at one upload or delete while the store may be restarting.
OP_ATTEMPTS = 20
#: An upload or delete slower than this is noted (StreamLog.slow_ops).
SLOW_OP_S = 5.0
#: Longest wait for fault threads and side jobs after the stream.
JOIN_TIMEOUT_S = 180.0
#: A side job's retries (``SameVideoRace``) wait this long, doubled each time, at most ``SIDE_RETRY_MAX_S``.
SIDE_RETRY_BACKOFF_S = 1.0
SIDE_RETRY_MAX_S = 8.0
#: Queues must stay empty and the check pass for this long (longer than the management API takes to
#: refresh its figures: 1 s in our image, 5 s in a default broker).
SETTLE_S = 6.0
#: How often a slow convergence notes what is still missing.
PROGRESS_EVERY_S = 30.0

VIDEO_FPS = 10
VIDEO_SIZE = (64, 48)
#: Content variants uploaded by the stream: (seconds, seed). Overwrites switch to another variant.
VARIANTS = [(2.0, 9100), (3.0, 9101), (2.0, 9102), (3.0, 9103), (2.0, 9104), (3.0, 9105)]


# -- the app -----------------------------------------------------------------------------------------
@dataclass
class AppHost:
    """The running app: its settings, an HTTP client to its API, and ways to reach its replicas."""

    settings: Settings
    services: Services
    http: httpx.Client

    @property
    def bucket(self) -> str:
        return self.settings.s3.upload_bucket

    @property
    def app_name(self) -> str:
        return self.settings.serve.app_name

    def replica_pids_by_name(self, deployment: str, name: str | None = None) -> dict[str, int]:
        """Process id of each live replica of ``deployment`` (only the one named ``name``, if given),
        by its actor's name."""
        import ray
        from ray.util.state import list_actors

        filters: list[tuple[str, str, str | bool | int | float]] = [
            ("class_name", "=", f"ServeReplica:{self.app_name}:{deployment}"),
            ("state", "=", "ALIVE"),
        ]
        actors = list_actors(
            # Other Ray instances may run on this machine: ask this one.
            address=ray.get_runtime_context().gcs_address,
            filters=[*filters, ("name", "=", name)] if name else filters,
            raise_on_missing_output=False,
        )
        return {a.name: int(a.pid) for a in actors if a.name and a.pid}

    def replica_pids(self, deployment: str) -> list[int]:
        """Process ids of the live replicas of ``deployment``."""
        return sorted(self.replica_pids_by_name(deployment).values())

    @staticmethod
    def actor_name(holder: str) -> str | None:
        """The actor a catalog row's ``holder`` names (``ray:<namespace>:<actor name>``,
        pipeline/index/holders.py); None if it names none."""
        kind, _, rest = holder.partition(":")
        name = rest.partition(":")[2]
        return name if kind == "ray" and name else None

    def replica_pid(self, holder: str, deployment: str = "IndexConsumer") -> int | None:
        """Process id of the live replica of ``deployment`` that ``holder`` names; None if it names none."""
        name = self.actor_name(holder)
        return self.replica_pids_by_name(deployment, name).get(name) if name else None

    def kill_replica(self, deployment: str) -> str:
        """SIGKILL one replica of ``deployment`` and wait until Serve has started its successor."""
        pids = self.replica_pids(deployment)
        if not pids:
            raise RuntimeError(f"no live replica of {deployment}")
        victim = pids[0]
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)

        def replaced() -> bool:
            try:
                os.kill(victim, 0)
                return False  # not reaped yet
            except ProcessLookupError:
                return bool(set(self.replica_pids(deployment)) - {victim})

        eventually(
            replaced,
            f"a new {deployment} replica",
            REPLICA_BACK_TIMEOUT_S,
            poll_s=0.5,
        )
        self.wait_serving(deployment)
        return f"SIGKILL {deployment} pid {victim}, replaced in {time.monotonic() - killed:.1f}s"

    def wait_serving(self, deployment: str) -> None:
        from ray import serve

        def running() -> bool:
            status = serve.status().applications[self.app_name].deployments[deployment]
            return str(status.status).rsplit(".", 1)[-1] == "HEALTHY"  # not UNHEALTHY

        eventually(running, f"{deployment} to be healthy", REPLICA_BACK_TIMEOUT_S, poll_s=0.5)

    def router_connected(self) -> bool:
        keys = self.settings.api_keys
        headers = {"Authorization": f"Bearer {keys[0].get_secret_value()}"} if keys else {}
        try:
            return "\nvidx_router_connected 1.0" in self.http.get("/metrics", headers=headers).text
        except httpx.HTTPError:
            return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def start_app(
    services: Services,
    prefix: str,
    model_dir: Path,
    state_dir: Path,
    env: Mapping[str, str] | None = None,
    address: str | None = None,
    killed: threading.Event | None = None,
    metrics_push_ms: int | None = 1000,
) -> Iterator[AppHost]:
    """Run the vidx Serve app (tiny model) on a fresh local Ray instance against ``services``, with
    buckets and queues of its own (``prefix``) and any further VIDX_* settings in ``env``. The
    settings stay in ``os.environ`` while the app runs (so ``vidx`` commands run in this process see
    them); environment changes are undone on exit. ``address``: join that running Ray cluster (its
    nodes started with ``ray start``, their dashboard on) instead of starting a local one. ``killed``:
    set by a test that SIGKILLed the Ray instance's processes, so nothing is shut down gracefully.
    ``metrics_push_ms``: how often replicas push their metrics to their node (tests read them within a
    second; None: Ray's default, as deployed, for benchmarks that charge every process's CPU)."""
    import ray
    from ray import serve

    from pipeline.serve.app import build_app

    services.prepare_buckets(prefix)
    env = {
        **services.env(prefix),
        "VIDX_MODEL__ID": str(model_dir),
        "VIDX_STATE_DIR": str(state_dir),
        "VIDX_SERVE__PORT": str(_free_port()),
        **RAY_NODE_ENV,
        **(env or {}),
    }
    if metrics_push_ms is not None:
        env["RAY_metrics_report_interval_ms"] = str(metrics_push_ms)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        settings = Settings()
        # The dashboard serves Ray's state API, which finds replicas' pids for the kill faults.
        if address is None:
            ray.init(address="local", num_cpus=4, include_dashboard=True, configure_logging=False, log_to_driver=False)
        else:
            ray.init(address=address, configure_logging=False, log_to_driver=False)
        serve.start(http_options={"host": settings.serve.host, "port": settings.serve.port})
        serve.run(build_app(settings), name=settings.serve.app_name, route_prefix="/", blocking=False)
        with httpx.Client(base_url=settings.api_url, timeout=30) as http:
            host = AppHost(settings, services, http)

            def healthy() -> bool:
                try:
                    return http.get("/healthz").status_code == 200
                except httpx.HTTPError:
                    return False

            eventually(healthy, "the API to answer /healthz", STARTUP_TIMEOUT_S)
            eventually(host.router_connected, "the event router to connect", 60)
            yield host
    finally:
        try:
            stop_ray(serve_first=killed is None or not killed.is_set())
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


# -- the stream --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    """``inject`` runs in a thread of its own once ``at_op`` operations are done; it returns a line
    describing what it did."""

    at_op: int
    name: str
    inject: Callable[[], str]


@dataclass(frozen=True)
class StreamPlan:
    name: str
    ops: int
    seed: int
    rate_per_s: float = 4.0
    #: Keys the stream writes to; fewer keys mean more overwrites and re-creations. Default ops // 3.
    keys: int | None = None
    delete_share: float = 0.3
    #: Of the uploads to a key the stream has written, the share that puts the same content again
    #: (an identical re-upload: a new event, nothing new to index).
    reupload_share: float = 0.0

    @property
    def prefix(self) -> str:
        return f"faults/{self.name}/"


@dataclass
class StreamLog:
    uploads: int = 0
    #: Of ``uploads``, those that put a key's current content again.
    reuploads: int = 0
    deletes: int = 0
    failed_ops: int = 0
    touched: set[str] = field(default_factory=set)
    #: ETag -> frames its content yields.
    frames_by_etag: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stream_s: float = 0.0
    #: Operations that took over ``SLOW_OP_S`` (retries included): when, what, how long.
    slow_ops: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Variant:
    path: Path
    etag: str
    frames: int


def make_variants(directory: Path, every_s: float) -> list[Variant]:
    """The stream's video contents, written once to ``directory``."""
    out = []
    for n, (seconds, seed) in enumerate(VARIANTS):
        path = directory / f"variant-{n}.mp4"
        if not path.exists():
            write_video(path, seconds=seconds, fps=VIDEO_FPS, size=VIDEO_SIZE, seed=seed)
        # Single-part uploads: the ETag is the MD5 of the content.
        etag = hashlib.md5(path.read_bytes()).hexdigest()
        out.append(Variant(path, etag, expected_sample_count(seconds, VIDEO_FPS, every_s)))
    return out


def _attempt(what: str, op: Callable[[], None]) -> bool:
    """Run one bucket operation, retrying once a second while the store is away. False if it never went."""
    for _ in range(OP_ATTEMPTS):
        try:
            op()
            return True
        except Exception:  # connection refused / reset / 503 while MinIO restarts
            time.sleep(1.0)
    return False


def run_stream(
    host: AppHost,
    plan: StreamPlan,
    variants: list[Variant],
    faults: Sequence[Fault] = (),
    after_upload: Callable[[str], None] | None = None,
) -> StreamLog:
    """Perform ``plan.ops`` uploads, overwrites and deletes at most ``plan.rate_per_s`` a second,
    firing the faults one after another in a thread of their own, each once ``at_op`` operations
    are done; wait (bounded) for the faults to finish."""
    rng = random.Random(plan.seed)
    client = host.services.minio_client()
    n_keys = plan.keys or max(4, plan.ops // 3)
    keys = [f"{plan.prefix}k{i:03d}.mp4" for i in range(n_keys)]
    content: dict[str, int] = {}  # key -> variant index, as far as this stream knows
    log = StreamLog(frames_by_etag={v.etag: v.frames for v in variants})
    done = [0]  # operations finished so far, read by the fault thread

    def fire_in_turn() -> None:
        # One fault at a time, in order: a fault starts once the previous one has recovered.
        deadline = time.monotonic() + plan.ops / plan.rate_per_s + JOIN_TIMEOUT_S
        for fault in sorted(faults, key=lambda f: f.at_op):
            while done[0] < min(fault.at_op, plan.ops) and time.monotonic() < deadline:
                time.sleep(0.05)
            at = f"{fault.name} at op {fault.at_op} (fired at op {done[0]}, t={time.monotonic() - started:.1f}s)"
            try:
                log.notes.append(f"{at}: {fault.inject()}")
            except Exception as exc:
                log.errors.append(f"{at} failed after {time.monotonic() - started:.1f}s: {exc!r}")

    started = time.monotonic()
    runner = threading.Thread(target=fire_in_turn, name="faults", daemon=True)
    runner.start()
    for n in range(plan.ops):
        due = started + n / plan.rate_per_s
        time.sleep(max(0.0, due - time.monotonic()))
        live = sorted(content)
        op_started = time.monotonic()
        if live and rng.random() < plan.delete_share:
            key = rng.choice(live)
            if _attempt("delete", lambda key=key: client.remove_object(host.bucket, key)):  # type: ignore[misc]
                content.pop(key)
                log.deletes += 1
            else:
                log.failed_ops += 1
        else:
            key = rng.choice(keys)
            # (The draw only when re-uploads are asked for: older plans replay as they always did.)
            same = plan.reupload_share > 0 and key in content and rng.random() < plan.reupload_share
            choices = [i for i in range(len(variants)) if i != content.get(key)]
            v = content[key] if same else rng.choice(choices)

            def put(key: str = key, v: int = v) -> None:
                client.fput_object(host.bucket, key, str(variants[v].path), content_type="video/mp4")

            if _attempt("upload", put):
                content[key] = v
                log.uploads += 1
                log.reuploads += same
                if after_upload is not None:
                    after_upload(key)
            else:
                log.failed_ops += 1
        log.touched.add(key)
        took = time.monotonic() - op_started
        if took > SLOW_OP_S:
            log.slow_ops.append(f"op {n} at t={op_started - started:.1f}s on {key} took {took:.1f}s")
        done[0] = n + 1
    log.stream_s = time.monotonic() - started
    runner.join(JOIN_TIMEOUT_S)
    if runner.is_alive():
        log.errors.append(f"faults did not finish within {JOIN_TIMEOUT_S:.0f}s of the stream's end")
    return log


# -- faults ------------------------------------------------------------------------------------------
def kill_mid_video(host: AppHost, plan: StreamPlan, deployment: str) -> str:
    """SIGKILL a replica of ``deployment`` while one of this stream's videos is being indexed (waits
    at most ``BUSY_TIMEOUT_S`` for one, then kills anyway and says so). Being indexed: a consumer holds
    an index task unacknowledged (a job shorter than ``serve.claim_after_s`` writes no ``indexing`` row),
    or a row of the stream says ``indexing``."""
    tables = Tables(host.settings)
    uri_prefix = s3_uri(host.bucket, plan.prefix)
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    busy = False
    while time.monotonic() < deadline and not busy:
        busy = queue_counts(host.services, host.settings.serve.index_queue)[1] > 0
        busy = busy or any(
            uri.startswith(uri_prefix) and status == "indexing" for uri, status in tables.statuses().values()
        )
        if not busy:
            time.sleep(0.1)
    what = host.kill_replica(deployment)
    return what + ("" if busy else " (no video was being indexed)")


def restart_router(host: AppHost) -> str:
    what = host.kill_replica("EventRouter")
    eventually(host.router_connected, "the new event router to connect", REPLICA_BACK_TIMEOUT_S)
    return what


class SameVideoRace:
    """Two consumers indexing the same video at once: after each upload (every ``every``-th), two
    more jobs for it go on the task queue (the consumer's two worker threads take them together) and
    two ``Indexer``s in this process run the same job at the same moment, each as a task of its own
    through the consumer's real ``IndexTaskHandler``: a raise is retried after a backoff, as Celery
    retries the app's tasks, and the last attempt fails the video and dead-letters it. (Without the
    retries a side job that left the video's rows unsettled would leave it ``indexing`` for the
    scheduled check's hour-long grace, which no consumer of the app does.)"""

    def __init__(self, host: AppHost, every: int = 2) -> None:
        from ray import serve

        from pipeline.embedding.encoders import HandleEmbedders
        from pipeline.index.consumer import IndexTaskHandler
        from pipeline.index.indexer import Indexer
        from pipeline.jobs.taskqueue import CeleryJobSink, dead_letter_queue
        from pipeline.reindex.lifecycle import LiveModels
        from storage.tables import IndexStore

        settings = host.settings
        encoder = serve.get_deployment_handle("Encoder", app_name=host.app_name)
        embedders = HandleEmbedders(encoder, settings.model.embed_timeout_s)
        self._host = host

        def indexer() -> Indexer:
            # As the app's consumers run it: the index's live models, each one's table.
            store = IndexStore(settings.s3)
            live = LiveModels(store.models, settings.reindex.live_refresh_s)
            return Indexer(
                settings,
                embedders.for_model(settings.model.id),
                store,
                models=live.live,
                models_now=live.live_now,
                embedders=embedders,
            )

        dead_letters = dead_letter_queue(settings)
        self._max_retries = settings.serve.max_retries
        self._handlers = [IndexTaskHandler(indexer(), dead_letters, self._max_retries) for _ in range(2)]
        self._sink = CeleryJobSink(settings)
        self._every = every
        self._uploads = 0
        self.outcomes: Counter[str] = Counter()
        self.threads: list[threading.Thread] = []

    def __call__(self, key: str) -> None:
        from events.jobs import IndexJob, JobOp, JobSource

        self._uploads += 1
        if self._uploads % self._every:
            return
        job = IndexJob(op=JobOp.INDEX, bucket=self._host.bucket, key=key, source=JobSource.API)
        for _ in range(2):
            self._sink.submit(job)
        gate = threading.Barrier(2, timeout=30)
        for handler in self._handlers:
            thread = threading.Thread(target=self._run, args=(handler, job, gate), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _run(self, handler: Any, job: Any, gate: threading.Barrier) -> None:
        from pipeline.index.consumer import TaskContext

        task_id = f"side-{uuid.uuid4().hex}"
        try:
            gate.wait()
            for retries in range(self._max_retries + 1):
                try:
                    answer = handler.handle(job.model_dump(mode="json"), TaskContext(task_id, retries))
                except Exception as exc:
                    if retries == self._max_retries:  # the failure record or the dead letter failed
                        self.outcomes[f"raised on the last attempt {type(exc).__name__}: {exc}"[:120]] += 1
                        return
                    self.outcomes[f"retried {type(exc).__name__}"] += 1  # as Celery retries the app's tasks
                    time.sleep(min(SIDE_RETRY_BACKOFF_S * 2**retries, SIDE_RETRY_MAX_S))
                    continue
                self.outcomes[str(answer["outcome"])] += 1
                return
        except Exception as exc:  # the gate broke: counted for the report
            self.outcomes[f"raised {type(exc).__name__}: {exc}"[:120]] += 1

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.1, deadline - time.monotonic()))


@dataclass(frozen=True)
class Kill:
    """One SIGKILL of the consumer holding a video: whom, when (seconds after the watch began), the
    crashes its claim recorded, and how long until ``holder_alive`` (pipeline/index/holders.py), asked
    from this process, said the holder was gone (None: it never did within the bound)."""

    holder: str
    pid: int
    at_s: float
    crashes: int
    judged_dead_s: float | None


class KillEveryStart:
    """A consumer that dies on one video every time: a thread that, whenever ``video_id``'s catalog
    row says ``indexing`` with a holder naming a live IndexConsumer replica, SIGKILLs that replica's
    process (each holder once). At most ``max_kills`` kills, for at most ``timeout_s``."""

    def __init__(self, host: AppHost, video_id: str, max_kills: int, timeout_s: float, poll_s: float = 0.1) -> None:
        from storage.tables import IndexStore

        self._host = host
        self._catalog = IndexStore(host.settings.s3).catalog
        self._video_id = video_id
        self._max_kills = max_kills
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kill-every-start", daemon=True)
        self.kills: list[Kill] = []
        self.errors: list[str] = []

    def __enter__(self) -> KillEveryStart:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            self.errors.append(f"the watcher did not stop within {JOIN_TIMEOUT_S:.0f}s")

    def _watch(self) -> None:
        from pipeline.index.holders import holder_alive
        from storage.catalog import VideoStatus

        started = time.monotonic()
        deadline = started + self._timeout_s
        killed: set[str] = set()
        while not self._stop.is_set() and time.monotonic() < deadline and len(self.kills) < self._max_kills:
            try:
                record = self._catalog.get(self._video_id)
                holder = record.holder if record is not None else None
                if record is None or record.status is not VideoStatus.INDEXING or holder is None or holder in killed:
                    time.sleep(self._poll_s)
                    continue
                pid = self._host.replica_pid(holder)
                if pid is None:  # a holder that is gone already (or not a replica): not ours to kill
                    time.sleep(self._poll_s)
                    continue
                os.kill(pid, signal.SIGKILL)
                at_s = time.monotonic() - started
                killed.add(holder)
                dead_s: float | None = None
                while time.monotonic() < min(deadline, started + at_s + REPLICA_BACK_TIMEOUT_S):
                    if not holder_alive(holder):
                        dead_s = time.monotonic() - started - at_s
                        break
                    time.sleep(0.05)
                self.kills.append(Kill(holder, pid, at_s, record.crashes, dead_s))
            except Exception as exc:  # reported by the test; the watch goes on until its bounds
                self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                time.sleep(self._poll_s)


# -- the check ---------------------------------------------------------------------------------------
class Tables:
    """Reads the index tables, whole or only the rows of some videos (the test tables hold a few
    thousand rows at most; a long nemesis run many thousands, so its checks name their videos)."""

    def __init__(self, settings: Settings) -> None:
        self._db = lancedb.connect(
            settings.s3.index_uri,
            storage_options=storage_options(settings.s3),
            read_consistency_interval=timedelta(0),
        )

    def _rows(self, name: str, columns: list[str], only: Collection[str] | None = None) -> list[dict[str, Any]]:
        try:
            table = self._db.open_table(name)
        except (ValueError, FileNotFoundError):
            return []
        query = table.search().select(columns)
        if only is not None:
            if not only:
                return []
            query = query.where(f"video_id IN ({', '.join(sql_quote(v) for v in sorted(only))})")
        rows: list[dict[str, Any]] = query.limit(10_000_000).to_arrow().to_pylist()
        return rows

    def videos(self, only: Collection[str] | None = None) -> dict[str, dict[str, Any]]:
        columns = ["video_id", "uri", "status", "version", "frames", "rev", "updated_at"]
        return {r["video_id"]: r for r in self._rows(VIDEOS, columns, only)}

    def statuses(self) -> dict[str, tuple[str, str]]:
        return {vid: (r["uri"], r["status"]) for vid, r in self.videos().items()}

    def frames(self, only: Collection[str] | None = None) -> list[dict[str, Any]]:
        """The rows of the active model's frames table (the lifecycle row names it)."""
        return self._rows(self.active_table(), ["frame_id", "video_id", "version"], only)

    def active_table(self) -> str:
        rows = self._rows(MODELS, ["state"])
        active = json.loads(rows[0]["state"])["active"] if rows else None
        return str(active["table"]) if active else FRAMES


@dataclass(frozen=True)
class Summary:
    uploads: int
    deletes: int
    indexed: int
    lost: int
    duplicated: int
    problems: tuple[str, ...] = ()

    def line(self, name: str) -> str:
        return (
            f"fault {name}: uploads {self.uploads}, deletes {self.deletes}, indexed {self.indexed}, "
            f"lost {self.lost}, duplicated {self.duplicated}"
        )

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0


def check(host: AppHost, plan: StreamPlan, log: StreamLog, tables: Tables) -> Summary:
    """Compare the index with the bucket, for this stream's keys.

    lost: an object in the bucket not indexed exactly at its current version (no row, status not
    ``indexed``, another version, or not exactly its frames), or a deleted object still searchable
    (frames rows) or not marked ``deleted``. duplicated: extra rows of one ``frame_id``, plus videos
    with more frame rows than their catalog row records.
    """
    client = host.services.minio_client()
    bucket = {
        str(o.object_name): str(o.etag).strip('"')
        for o in client.list_objects(host.bucket, prefix=plan.prefix, recursive=True)
    }
    ids = {video_id(host.bucket, key): key for key in log.touched | set(bucket)}
    videos = tables.videos(ids)
    frames: dict[str, list[dict[str, Any]]] = {}
    for row in tables.frames(ids):
        if row["video_id"] in ids:
            frames.setdefault(row["video_id"], []).append(row)
    problems: list[str] = []
    indexed = lost = duplicated = 0
    for vid, key in sorted(ids.items(), key=lambda kv: kv[1]):
        rows = frames.get(vid, [])
        distinct = {r["frame_id"] for r in rows}
        extra = len(rows) - len(distinct)
        record = videos.get(vid)
        if extra:
            duplicated += extra
            problems.append(f"{key}: {extra} duplicate frame rows")
        if record is not None and len(rows) > int(record["frames"] or 0):
            duplicated += 1
            problems.append(f"{key}: {len(rows)} frame rows, catalog records {record['frames']}")
        if key in bucket:
            etag = bucket[key]
            want = log.frames_by_etag.get(etag)
            why = None
            if record is None:
                why = "no catalog row"
            elif record["status"] != "indexed" or record["version"] != etag:
                why = f"catalog {record['status']} at {record['version']}, bucket has {etag}"
            elif len(distinct) != want or int(record["frames"]) != want:
                why = f"{len(distinct)} frames (catalog {record['frames']}), content has {want}"
            elif any(r["version"] != etag for r in rows):
                why = "frame rows of another version"
            if why is None:
                indexed += 1
            else:
                lost += 1
                problems.append(f"{key}: {why}")
        elif rows or (record is not None and record["status"] != "deleted"):
            lost += 1
            status = record["status"] if record is not None else "no row"
            problems.append(f"{key} (deleted): {len(rows)} frame rows, catalog {status}")
    return Summary(log.uploads, log.deletes, indexed, lost, duplicated, tuple(problems))


def queues_idle(host: AppHost) -> bool:
    names = [host.settings.amqp.events_queue, host.settings.serve.index_queue]
    return all(queue_counts(host.services, q) == (0, 0) for q in names)


def converge(host: AppHost, plan: StreamPlan, log: StreamLog, timeout_s: float) -> tuple[Summary, float]:
    """Wait (at most ``timeout_s``) until the queues are empty and the check passes, and still passes
    ``SETTLE_S`` later. Returns the last summary and the seconds waited; what was still missing every
    ``PROGRESS_EVERY_S`` goes to ``log.notes``."""
    tables = Tables(host.settings)
    started = time.monotonic()
    deadline = started + timeout_s
    next_note = started + PROGRESS_EVERY_S
    summary = check(host, plan, log, tables)
    while time.monotonic() < deadline:
        idle = queues_idle(host)
        if summary.ok and idle:
            time.sleep(SETTLE_S)
            summary = check(host, plan, log, tables)
            if summary.ok and queues_idle(host):
                break
            continue
        if time.monotonic() >= next_note:
            next_note += PROGRESS_EVERY_S
            first = summary.problems[0] if summary.problems else "-"
            log.notes.append(
                f"converging t={time.monotonic() - started:.0f}s: lost {summary.lost}, duplicated "
                f"{summary.duplicated}, queues idle {idle}, e.g. {first}"
            )
        time.sleep(2.0)
        summary = check(host, plan, log, tables)
    return summary, time.monotonic() - started


@dataclass(frozen=True)
class CheckRun:
    """What ``vidx check --json`` reported (pipeline/upkeep/check.py ``CheckReport.as_json``) and its exit status."""

    exit_code: int
    report: dict[str, Any]

    @property
    def inconsistencies(self) -> int:
        return int(self.report["inconsistencies"])

    @property
    def in_flight(self) -> int:
        """Videos ``queued``/``indexing``: within the grace (``in_flight``) or past it (``stuck``)."""
        return int(self.report["in_flight"]) + int(self.report["counts"].get("stuck", 0))

    @property
    def found(self) -> list[str]:
        return [f"{f['finding']} {f['uri'] or f['video_id']} ({f['detail']})" for f in self.report["found"]]

    def line(self, name: str) -> str:
        r = self.report
        kinds = ", ".join(f"{k} {n}" for k, n in r["counts"].items() if n)
        return (
            f"check {name}: {self.inconsistencies} inconsistencies{f' ({kinds})' if kinds else ''}, "
            f"{self.in_flight} queued/indexing, {r['videos']} videos (in sync {r['in_sync']}, failed "
            f"{r['failed']}), {r['listed']} objects (vidx check --json)"
        )


def vidx_check(
    *, bucket: str | None = None, prefix: str = "", env: Mapping[str, str] | None = None, grace_s: float = 0
) -> CheckRun:
    """Run the real CLI, ``vidx check --json --grace 0 [--bucket B] [--prefix P]``, in this process
    (typer's runner on ``pipeline.cli.main.app``), with the VIDX_* settings of ``os.environ`` (``start_app``
    puts the app's there) or of ``env``. Grace 0 (unless ``grace_s``): a video still queued or indexing is an
    inconsistency (stuck), not in flight; a video failed at its object's version is not one.

    Raises:
        AssertionError: the command failed (exit status other than 0 or 3) or printed no report.
    """
    from typer.testing import CliRunner

    from pipeline.cli.check import FOUND_EXIT
    from pipeline.cli.main import app

    args = ["check", "--json", "--grace", f"{grace_s:g}", "--prefix", prefix]
    if bucket is not None:
        args += ["--bucket", bucket]
    result = CliRunner().invoke(app, args, env=dict(env) if env is not None else None)
    if result.exit_code not in (0, FOUND_EXIT):
        raise AssertionError(f"vidx {' '.join(args)} exited {result.exit_code}: {result.output[-2000:]}")
    try:
        report = json.loads(result.stdout)
    except ValueError as exc:
        raise AssertionError(f"vidx {' '.join(args)} printed no JSON report: {result.stdout[-2000:]!r}") from exc
    return CheckRun(result.exit_code, report)
