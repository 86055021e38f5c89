"""What ``bench.flood`` uploads with and watches while it runs, and what it makes of it: the uploader,
catalog statuses, the index queue, replicas per deployment, the autoscaling policy's decisions, the
once-a-second sampler, the upload → searchable probes, the ack timer; then the scaling figures and the
plots. ``bench.flood`` imports this module; it imports nothing of ``bench.flood``."""

from __future__ import annotations

import io
import itertools
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

DECISION = re.compile(
    r"vidx autoscale: deployment=(?P<deployment>\S+) current=(?P<current>\d+) desired=(?P<desired>\d+) "
    r"backlog=(?P<backlog>\d+) at=(?P<at>[\d.]+)"
)
CONSUMER, ENCODER = "IndexConsumer", "Encoder"
#: Tries of one upload before it counts as an error.
UPLOAD_ATTEMPTS = 5
#: Ids per catalog query (one ``IN`` list).
IDS_PER_QUERY = 500
PROBE_POLL_S = 0.5


class Uploader:
    """Puts objects into the app's upload bucket from a bounded pool, one MinIO client per thread."""

    def __init__(self, services: Any, bucket: str, threads: int) -> None:
        self._services = services
        self._bucket = bucket
        self._local = threading.local()
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="flood-upload")
        self.lock = threading.Lock()
        self.offered = 0
        self.uploaded: dict[str, float] = {}  # key -> monotonic time the upload finished
        self.errors: list[str] = []

    def put(self, key: str, data: bytes) -> None:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = self._services.minio_client()
        for attempt in range(UPLOAD_ATTEMPTS):
            try:
                client.put_object(self._bucket, key, io.BytesIO(data), len(data), content_type="video/mp4")
                with self.lock:
                    self.uploaded[key] = time.monotonic()
                return
            except Exception as exc:  # the store is busy; try again a bit later
                if attempt == UPLOAD_ATTEMPTS - 1:
                    with self.lock:
                        self.errors.append(f"{key}: {exc!r}"[:300])
                time.sleep(1.0)

    def submit(self, key: str, data: bytes) -> None:
        with self.lock:
            self.offered += 1
        self.pool.submit(self.put, key, data)


def statuses(store: Any, ids: Iterable[str]) -> dict[str, str]:
    """video id -> catalog status, for those of ``ids`` with a row."""
    out: dict[str, str] = {}
    ids = sorted(ids)
    for i in range(0, len(ids), IDS_PER_QUERY):
        out.update({vid: r.status.value for vid, r in store.catalog.get_many(ids[i : i + IDS_PER_QUERY]).items()})
    return out


def wait_done(
    store: Any,
    ids: Sequence[str],
    timeout_s: float,
    poll_s: float = 0.5,
    each_poll: Callable[[int], None] | None = None,
) -> float:
    """Wait until every one of ``ids`` is indexed or failed; the monotonic time it was seen so.
    ``each_poll(done)`` runs after every poll with the count done so far."""
    deadline = time.monotonic() + timeout_s
    pending = set(ids)
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)}/{len(ids)} videos not done after {timeout_s:.0f}s")
        pending -= {v for v, s in statuses(store, pending).items() if s in ("indexed", "failed")}
        if each_poll is not None:
            each_poll(len(ids) - len(pending))
        if pending:
            time.sleep(poll_s)
    return time.monotonic()


def capacity_run(
    store: Any, ids: Sequence[str], app_name: str, fleet: int | None, timeout_s: float
) -> tuple[float, float, bool]:
    """Wait for a batch (all uploaded at ``time.monotonic()`` of the call) like ``wait_done``; returns
    (videos/s once ``fleet`` consumer replicas were running, videos/s over the whole batch, whether
    the first figure is that). The first figure is the fleet's capacity: the whole batch also pays
    the scale-up from the minimum. It falls back to the whole batch (False) when the fleet never
    reached ``fleet`` with ≥ 10 videos to go."""
    started = time.monotonic()
    full_at: list[tuple[float, int]] = []  # (when the fleet was first full, videos done by then)

    def look(done: int) -> None:
        if not full_at and fleet is not None and replicas(app_name).get(CONSUMER, {}).get("running", 0) >= fleet:
            full_at.append((time.monotonic(), done))

    done_at = wait_done(store, ids, timeout_s, each_poll=look)
    whole = len(ids) / (done_at - started)
    if not full_at or len(ids) - full_at[0][1] < 10:
        return whole, whole, False
    return (len(ids) - full_at[0][1]) / (done_at - full_at[0][0]), whole, True


def backlog(services: Any, queue: str) -> tuple[int, int]:
    from infra.harness.services import queue_info

    info = queue_info(services, queue)
    return int(info.get("messages_ready") or 0), int(info.get("messages_unacknowledged") or 0)


def replicas(app_name: str) -> dict[str, dict[str, int]]:
    """deployment -> {"running": n, "total": n} from ``serve.status()``."""
    from ray import serve

    out = {}
    for name, status in serve.status().applications[app_name].deployments.items():
        states = {str(getattr(k, "value", k)): int(v) for k, v in status.replica_states.items()}
        out[name] = {"running": states.get("RUNNING", 0), "total": sum(states.values())}
    return out


def settle(host: Any, least: int | None, timeout_s: float) -> bool:
    """Wait until the index queue is empty and (``least`` given) the consumers are at most ``least``;
    False if that did not happen within ``timeout_s``."""
    settings = host.settings
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        quiet = sum(backlog(host.services, settings.serve.index_queue)) == 0
        if quiet and (least is None or replicas(settings.serve.app_name)[CONSUMER]["total"] <= least):
            return True
        time.sleep(1.0)
    return False


def catalog_version(store: Any) -> int:
    from storage.catalog import VIDEOS

    return int(store.db.connection.open_table(VIDEOS).version)


def decisions(app_name: str) -> list[dict[str, Any]]:
    """The autoscaling policy's decision lines from the Serve controller's log of this Ray session."""
    import ray

    node: Any = ray._private.worker._global_node  # where this Ray instance keeps its logs
    out = []
    for path in sorted((Path(node.get_session_dir_path()) / "logs" / "serve").glob("controller_*.log")):
        for line in path.read_text(errors="replace").splitlines():
            match = DECISION.search(line)
            if match:
                d: dict[str, Any] = {k: int(v) for k, v in match.groupdict().items() if k in ("current", "desired")}
                d.update(deployment=match["deployment"], backlog=int(match["backlog"]), at=float(match["at"]))
                out.append(d)
    return sorted(out, key=lambda d: d["at"])


class Sampler(threading.Thread):
    """Once a second: offered and uploaded so far, queue depths, replicas, indexed and failed."""

    def __init__(self, host: Any, uploader: Uploader, every_s: float, base: dict[str, int], limit_s: float) -> None:
        super().__init__(name="flood-sampler", daemon=True)
        from storage.tables import IndexStore

        self._host = host
        self._uploader = uploader
        self._every_s = every_s
        self._base = base
        self._store = IndexStore(host.settings.s3)
        self.stop = threading.Event()
        with uploader.lock:
            self._uploaded_before = len(uploader.uploaded)
        self.samples: list[dict[str, Any]] = []
        self.started_wall = time.time()
        self._max_samples = int(limit_s / every_s) + 1
        self.errors: list[str] = []

    def run(self) -> None:
        settings = self._host.settings
        for _ in range(self._max_samples):
            if self.stop.is_set():
                return
            try:
                self.samples.append(self.sample(settings))
            except Exception as exc:  # one missed sample is not worth the run
                if len(self.errors) < 20:
                    self.errors.append(repr(exc)[:300])
            # On the next tick of the grid (a slow sample skips ticks rather than bunching them).
            self.stop.wait(self._every_s - (time.time() - self.started_wall) % self._every_s)

    def sample(self, settings: Any) -> dict[str, Any]:
        now = time.time()
        ready, unacked = backlog(self._host.services, settings.serve.index_queue)
        ev_ready, ev_unacked = backlog(self._host.services, settings.amqp.events_queue)
        counts = self._store.catalog.counts()
        with self._uploader.lock:
            offered, uploaded = self._uploader.offered, len(self._uploader.uploaded) - self._uploaded_before
        return {
            "t_s": round(now - self.started_wall, 3),
            "at": round(now, 3),
            "offered": offered,
            "uploaded": uploaded,
            "index_ready": ready,
            "index_unacked": unacked,
            "backlog": ready + unacked,
            "events_backlog": ev_ready + ev_unacked,
            "replicas": replicas(settings.serve.app_name),
            "indexed": counts.get("indexed", 0) - self._base.get("indexed", 0),
            "failed": counts.get("failed", 0) - self._base.get("failed", 0),
        }


class Prober(threading.Thread):
    """Times probe videos from upload done to the first image search that returns them."""

    def __init__(self, host: Any, uploader: Uploader, probes: dict[str, tuple[str, bytes]], limit_s: float) -> None:
        super().__init__(name="flood-prober", daemon=True)
        from storage.tables import IndexStore

        self._host = host
        self._uploader = uploader
        self._probes = dict(probes)  # video id -> (key, query PNG)
        self._store = IndexStore(host.settings.s3)
        self.stop = threading.Event()
        self.latency_s: dict[str, float] = {}
        self.errors: list[str] = []
        self._limit_s = limit_s

    def run(self) -> None:
        import httpx

        deadline = time.monotonic() + self._limit_s
        with httpx.Client(base_url=self._host.settings.api_url, timeout=30) as http:
            while self._probes and not self.stop.is_set() and time.monotonic() < deadline:
                try:
                    self.round(http)
                except Exception as exc:
                    if len(self.errors) < 20:
                        self.errors.append(repr(exc)[:300])
                self.stop.wait(PROBE_POLL_S)

    def round(self, http: Any) -> None:
        with self._uploader.lock:
            up = {vid: self._uploader.uploaded.get(key) for vid, (key, _png) in self._probes.items()}
        live = {vid: t for vid, t in up.items() if t is not None}
        for vid, status in statuses(self._store, live).items():
            if status != "indexed":
                continue
            png = self._probes[vid][1]
            resp = http.post("/v1/search/image?k=5", files={"image": ("q.png", png, "image/png")})
            if resp.status_code == 200 and vid in {r["video_id"] for r in resp.json()["results"]}:
                self.latency_s[vid] = time.monotonic() - live[vid]
                del self._probes[vid]


def ack_latencies_ms(host: Any, uris: Sequence[str], rate_per_s: float) -> list[float]:
    """``POST /v1/index`` for each of ``uris`` at ``rate_per_s`` from a pool; milliseconds to each 202."""
    import httpx

    def post(uri: str) -> float:
        with httpx.Client(base_url=host.settings.api_url, timeout=30) as http:
            started = time.perf_counter()
            resp = http.post("/v1/index", json={"uri": uri})
            took = (time.perf_counter() - started) * 1000
            return took if resp.status_code == 202 else float("nan")

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=16, thread_name_prefix="flood-ack") as pool:
        futures = []
        for i, uri in enumerate(uris):
            time.sleep(max(0.0, started + i / rate_per_s - time.monotonic()))
            futures.append(pool.submit(post, uri))
        return [f.result(timeout=60) for f in futures]


# -- figures from the samples ------------------------------------------------------------------------
def first(samples: Iterable[dict[str, Any]], holds: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    return next((s for s in samples if holds(s)), None)


def running(sample: dict[str, Any], deployment: str) -> int:
    return int(sample["replicas"].get(deployment, {}).get("running", 0))


def scaling_figures(
    samples: list[dict[str, Any]],
    decided: list[dict[str, Any]],
    *,
    target_per_replica: float | None,
    max_replicas: dict[str, int | None],
    last_upload_at: float,
) -> dict[str, Any]:
    """scale_up_decision_s, time_to_max_replicas_s and scale_down_after_drain_s (None where the run
    holds no such event), from the samples (wall times ``at``) and the policy's decision lines."""
    out: dict[str, Any] = {
        "scale_up_decision_s": None,
        "time_to_max_replicas_s": None,
        "scale_down_after_drain_s": None,
    }
    consumer = [d for d in decided if d["deployment"] == CONSUMER]
    start = samples[0]["at"] if samples else 0.0
    if target_per_replica is not None:
        over = first(samples, lambda s: s["backlog"] > target_per_replica * max(1, running(s, CONSUMER)))
        if over is not None:
            up = next((d for d in consumer if d["desired"] > d["current"] and d["at"] >= over["at"] - 1.0), None)
            if up is not None:
                out["scale_up_decision_s"] = round(up["at"] - over["at"], 3)
    per_deployment: dict[str, float | None] = {}
    for deployment, most in max_replicas.items():
        full = None if most is None else next((s for s in samples if running(s, deployment) >= most), None)
        per_deployment[deployment] = round(full["at"] - start, 3) if full else None
    out["time_to_max_replicas_s"] = per_deployment.get(CONSUMER)
    out["time_to_max_replicas_s_by_deployment"] = per_deployment
    empty = first(samples, lambda s: s["at"] >= last_upload_at and s["backlog"] == 0 and s["events_backlog"] == 0)
    if empty is not None:
        # The first scale-down once the queue is empty; if the policy had already shrunk the fleet while
        # the tail drained (none after), the last one before: a negative figure.
        grew = max((d["at"] for d in consumer if d["desired"] > d["current"] and d["at"] < empty["at"]), default=start)
        shrank = [d for d in consumer if d["desired"] < d["current"] and d["at"] >= grew]
        down = next((d for d in shrank if d["at"] >= empty["at"]), shrank[-1] if shrank else None)
        if down is not None:
            out["scale_down_after_drain_s"] = round(down["at"] - empty["at"], 3)
        out["drained_at_s"] = round(empty["at"] - start, 3)
    return out


def plot(samples: list[dict[str, Any]], directory: Path, suffix: str) -> list[Path]:
    """flood-offered, flood-replicas and flood-backlog PNGs (``suffix`` before ``.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    t = [s["t_s"] for s in samples]
    offered = [0.0] + [
        float(b["offered"] - a["offered"]) / max(1e-6, b["t_s"] - a["t_s"]) for a, b in itertools.pairwise(samples)
    ]
    done = [0.0] + [
        float(b["indexed"] + b["failed"] - a["indexed"] - a["failed"]) / max(1e-6, b["t_s"] - a["t_s"])
        for a, b in itertools.pairwise(samples)
    ]
    deployments = sorted({d for s in samples for d in s["replicas"]})
    paths = []
    figures: list[tuple[str, str, list[tuple[str, list[float]]]]] = [
        ("offered", "videos per second", [("offered (uploads/s)", offered), ("completed (videos/s)", done)]),
        ("replicas", "running replicas", [(d, [float(running(s, d)) for s in samples]) for d in deployments]),
        (
            "backlog",
            "messages (ready + unacked)",
            [
                ("index queue", [float(s["backlog"]) for s in samples]),
                ("bucket events", [float(s["events_backlog"]) for s in samples]),
            ],
        ),
    ]
    for name, ylabel, series in figures:
        fig, ax = plt.subplots(figsize=(8, 3.2), dpi=110)
        for label, values in series:
            ax.step(t, values, where="post", label=label)
        ax.set_xlabel("seconds since the flood started")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        path = directory / f"flood-{name}{suffix}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
