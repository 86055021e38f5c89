"""vidx's metrics: every name, help text and label in one list, and a small recorder over a backend.

Replicas record on Ray's metrics API (``RayBackend``): each node's metrics agent exports them, with
Ray's ``ray_`` prefix and the replica's ``deployment``/``replica`` labels, and the Api's ``/metrics``
gathers them from every node (``pipeline.api.node_metrics``). Unit tests record on ``MemoryBackend``
(prometheus_client, same exported names) or on nothing; no Ray import happens at module level.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge as PromGauge
from prometheus_client import Histogram as PromHistogram
from prometheus_client.metrics_core import Metric

from pipeline.failures import FailureReason

#: The namespace Ray's metrics agent puts before every application metric.
RAY_PREFIX = "ray_"


class Kind(enum.StrEnum):
    COUNTER = "counter"
    HISTOGRAM = "histogram"
    GAUGE = "gauge"


class Source(enum.StrEnum):
    """Where a metric's values come from."""

    #: Recorded in replicas as work happens, exported by each node's metrics agent.
    RECORDED = "recorded"
    #: Recorded by the autoscaling policy in the Serve controller (``pipeline.serve.autoscale``).
    CONTROLLER = "controller"
    #: Read by the Api at scrape time from cheap live state (the broker, Serve, the router).
    SCRAPE = "scrape"


@dataclass(frozen=True, slots=True)
class MetricDef:
    name: str
    help: str
    kind: Kind
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    source: Source = Source.RECORDED

    @property
    def family(self) -> str:
        """The family name in the exposition (Ray adds ``ray_``; counters get ``_total`` samples)."""
        return self.name if self.source is Source.SCRAPE else RAY_PREFIX + self.name

    @property
    def samples(self) -> frozenset[str]:
        """Every sample name this metric shows in the exposition (what PromQL can select)."""
        f = self.family
        if self.kind is Kind.COUNTER:
            return frozenset({f + "_total"})
        if self.kind is Kind.HISTOGRAM:
            return frozenset({f + "_bucket", f + "_sum", f + "_count"})
        return frozenset({f})


SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
SIZE_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)

#: The stages of ``pipeline.index.clock.StageClock`` one job reports; anything else counts as ``other``.
STAGES = (
    "catalog",
    "head",
    "fetch",
    "cpu_wait",
    "decode",
    "embed",
    "thumbnails",
    "write",
    # A text job's (``pipeline.index.words``): the wait for a text slot, then each source's reading.
    "text_wait",
    "text_subtitle",
    "text_ocr",
    "text_speech",
)

JOBS = MetricDef("vidx_jobs", "Index jobs finished, by outcome", Kind.COUNTER, ("outcome",))
JOB_SECONDS = MetricDef("vidx_job_seconds", "Wall time of one index job", Kind.HISTOGRAM, ("outcome",), SECONDS_BUCKETS)
FAILURES = MetricDef("vidx_videos_failed", "Videos failed for good, by reason class", Kind.COUNTER, ("reason",))
DEAD_LETTERS = MetricDef("vidx_dead_letters", "Dead letters stored, by failure kind", Kind.COUNTER, ("kind",))
STAGE_SECONDS = MetricDef(
    "vidx_stage_seconds", "Wall time of one job in one pipeline stage", Kind.HISTOGRAM, ("stage",), SECONDS_BUCKETS
)
FRAMES = MetricDef(
    "vidx_frames_embedded", "Sampled frames embedded for indexing (a retried job embeds its frames again)", Kind.COUNTER
)
BUCKET_EVENTS = MetricDef(
    "vidx_bucket_events", "EventRouter: bucket event messages and what became of them", Kind.COUNTER, ("kind",)
)
ENCODER_BATCH = MetricDef(
    "vidx_encoder_batch_size",
    "Items in one call of a batched Encoder method (frames: all frames of the chunks gathered, run in "
    "model batches of max_batch_size; image, text: queries)",
    Kind.HISTOGRAM,
    ("method",),
    SIZE_BUCKETS,
)
SEARCH_SECONDS = MetricDef(
    "vidx_search_seconds",
    "Latency of one search, by query kind and outcome (ok, bad_request, error)",
    Kind.HISTOGRAM,
    ("kind", "outcome"),
    SECONDS_BUCKETS,
)
RECONCILE_ROUNDS = MetricDef("vidx_reconcile_rounds", "Scheduled check rounds run", Kind.COUNTER)
RECONCILE_FINDINGS = MetricDef(
    "vidx_reconcile_findings", "Inconsistencies the scheduled check found", Kind.COUNTER, ("finding",)
)
RECONCILE_REPAIRS = MetricDef("vidx_reconcile_repairs", "Repairing jobs the scheduled check submitted", Kind.COUNTER)

SERVICE_OK = MetricDef(
    "vidx_service_ok_timestamp_seconds",
    "When a background service last did its work or was seen healthy (router, catalog-writer, frame-writer, "
    "scheduled-check, backfill, maintenance): an alert fires when it falls behind",
    Kind.GAUGE,
    ("service",),
)
CATALOG_COMMITS = MetricDef("vidx_catalog_commits", "Grouped catalog commits that landed", Kind.COUNTER)

_CTL, _LIVE = Source.CONTROLLER, Source.SCRAPE
AUTOSCALE_DESIRED = MetricDef(
    "vidx_autoscale_desired_replicas", "Replicas the policy asks for", Kind.GAUGE, ("deployment",), source=_CTL
)
AUTOSCALE_BACKLOG = MetricDef(
    "vidx_autoscale_backlog", "Tasks on the queue (ready + unacked)", Kind.GAUGE, ("deployment",), source=_CTL
)
AUTOSCALE_DECISIONS = MetricDef(
    "vidx_autoscale_decisions", "Changes of the desired count", Kind.COUNTER, ("deployment", "direction"), source=_CTL
)

QUEUE_MESSAGES = MetricDef(
    "vidx_queue_messages", "Messages on a queue (ready + unacked)", Kind.GAUGE, ("queue",), source=_LIVE
)
SERVE_REPLICAS = MetricDef(
    "vidx_serve_replicas", "Replicas by deployment and state", Kind.GAUGE, ("deployment", "state"), source=_LIVE
)
ROUTER_CONNECTED = MetricDef("vidx_router_connected", "1 while the EventRouter is connected", Kind.GAUGE, source=_LIVE)
CHECK_ROUNDS = MetricDef("vidx_check_rounds", "Scheduled check rounds this worker ran", Kind.GAUGE, source=_LIVE)
CHECK_LEADER = MetricDef("vidx_check_leader", "1 while this worker holds the check lease", Kind.GAUGE, source=_LIVE)
CHECK_LAST_RUN = MetricDef(
    "vidx_check_last_run_timestamp_seconds", "When the last check round started", Kind.GAUGE, source=_LIVE
)
CHECK_LAST_FOUND = MetricDef(
    "vidx_check_last_inconsistencies", "Inconsistencies the last round found", Kind.GAUGE, ("finding",), source=_LIVE
)
CHECK_LAST_IN_FLIGHT = MetricDef(
    "vidx_check_last_in_flight", "Videos queued/indexing within the grace", Kind.GAUGE, source=_LIVE
)
CHECK_LAST_SUBMITTED = MetricDef(
    "vidx_check_last_submitted", "Repairing jobs the last round submitted", Kind.GAUGE, source=_LIVE
)

#: Every metric vidx exposes (the dashboard may use only these; tests/unit/infra/test_dashboard.py checks).
METRICS: tuple[MetricDef, ...] = (
    JOBS,
    JOB_SECONDS,
    FAILURES,
    DEAD_LETTERS,
    STAGE_SECONDS,
    FRAMES,
    BUCKET_EVENTS,
    ENCODER_BATCH,
    SEARCH_SECONDS,
    RECONCILE_ROUNDS,
    RECONCILE_FINDINGS,
    RECONCILE_REPAIRS,
    SERVICE_OK,
    CATALOG_COMMITS,
    AUTOSCALE_DESIRED,
    AUTOSCALE_BACKLOG,
    AUTOSCALE_DECISIONS,
    QUEUE_MESSAGES,
    SERVE_REPLICAS,
    ROUTER_CONNECTED,
    CHECK_ROUNDS,
    CHECK_LEADER,
    CHECK_LAST_RUN,
    CHECK_LAST_FOUND,
    CHECK_LAST_IN_FLIGHT,
    CHECK_LAST_SUBMITTED,
)
RECORDED = tuple(d for d in METRICS if d.source is Source.RECORDED)


def sample_names() -> frozenset[str]:
    return frozenset(s for d in METRICS for s in d.samples)


# -- backends ----------------------------------------------------------------------------------------
class Instrument(Protocol):
    def record(self, value: float, labels: Mapping[str, str]) -> None: ...


class Backend(Protocol):
    def instrument(self, metric: MetricDef) -> Instrument: ...


class _Nothing:
    def record(self, value: float, labels: Mapping[str, str]) -> None:
        return None


class NullBackend:
    """Records nothing (plain use of the classes, most unit tests)."""

    def instrument(self, metric: MetricDef) -> Instrument:
        return _Nothing()


class _Prom:
    """A prometheus_client metric made (and registered) on its first recording, as a Ray node shows
    a metric only once something was recorded."""

    def __init__(self, make: Callable[[], Any], kind: Kind) -> None:
        self._make = make
        self._metric: Any = None
        self._kind = kind

    def record(self, value: float, labels: Mapping[str, str]) -> None:
        if self._metric is None:
            self._metric = self._make()
        target = self._metric.labels(**labels) if labels else self._metric
        if self._kind is Kind.COUNTER:
            target.inc(value)
        elif self._kind is Kind.HISTOGRAM:
            target.observe(value)
        else:
            target.set(value)


class MemoryBackend:
    """prometheus_client metrics in a registry of their own, under the names Ray would export: the
    stand-in for Ray's metrics agent in unit tests (``exposition()`` is what a node would show)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._made: dict[str, Instrument] = {}

    def instrument(self, metric: MetricDef) -> Instrument:
        """The one instrument of ``metric`` (made again, Ray's are the same series too)."""
        if metric.name not in self._made:
            self._made[metric.name] = _Prom(lambda: self._make(metric), metric.kind)
        return self._made[metric.name]

    def _make(self, metric: MetricDef) -> Any:
        kwargs: dict[str, Any] = {"namespace": RAY_PREFIX.rstrip("_"), "registry": self.registry}
        if metric.kind is Kind.COUNTER:
            return PromCounter(metric.name, metric.help, metric.labels, **kwargs)
        if metric.kind is Kind.HISTOGRAM:
            return PromHistogram(metric.name, metric.help, metric.labels, buckets=metric.buckets, **kwargs)
        return PromGauge(metric.name, metric.help, metric.labels, **kwargs)

    def families(self) -> list[Metric]:
        """What was recorded (without prometheus_client's ``_created`` samples, which Ray has not)."""
        families = []
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            if family.samples:
                families.append(family)
        return families

    def exposition(self) -> str:
        """The text a Ray node's endpoint would show of these metrics."""
        text = generate_latest(self.registry).decode()
        return "\n".join(line for line in text.splitlines() if "_created" not in line) + "\n"


class _Ray:
    def __init__(self, metric: Any, kind: Kind) -> None:
        self._metric = metric
        self._kind = kind

    def record(self, value: float, labels: Mapping[str, str]) -> None:
        tags = dict(labels) or None
        if self._kind is Kind.COUNTER:
            self._metric.inc(value, tags=tags)
        elif self._kind is Kind.HISTOGRAM:
            self._metric.observe(value, tags=tags)
        else:
            self._metric.set(value, tags=tags)


class RayBackend:
    """Ray Serve's metrics (``ray.serve.metrics``): made inside a replica, every series carries its
    ``deployment``, ``replica`` and ``application`` labels. Build it in the replica's ``__init__``."""

    def instrument(self, metric: MetricDef) -> Instrument:
        from ray.serve import metrics as serve_metrics

        tags: Any = metric.labels or None  # Ray's stubs say tuple[str]; any number of keys works
        made: Any
        if metric.kind is Kind.COUNTER:
            made = serve_metrics.Counter(metric.name, metric.help, tag_keys=tags)
        elif metric.kind is Kind.HISTOGRAM:
            made = serve_metrics.Histogram(metric.name, metric.help, boundaries=list(metric.buckets), tag_keys=tags)
        else:
            made = serve_metrics.Gauge(metric.name, metric.help, tag_keys=tags)
        return _Ray(made, metric.kind)


# -- the recorder ------------------------------------------------------------------------------------
class Metrics:
    """What vidx records as work happens; one per process, handed to the plain classes."""

    def __init__(self, backend: Backend | None = None) -> None:
        made = backend or NullBackend()
        self._instruments = {d.name: made.instrument(d) for d in RECORDED}

    def _add(self, metric: MetricDef, value: float, **labels: str) -> None:
        if value > 0:  # Ray's counters refuse 0; nothing happened anyway
            self._instruments[metric.name].record(value, labels)

    def _observe(self, metric: MetricDef, value: float, **labels: str) -> None:
        self._instruments[metric.name].record(max(0.0, value), labels)

    def job(self, outcome: str, duration_s: float) -> None:
        """One index task ended with ``outcome`` (indexed, unchanged, deleted, failed, retry)."""
        self._add(JOBS, 1, outcome=outcome)
        self._observe(JOB_SECONDS, duration_s, outcome=outcome)

    def failed(self, reason: FailureReason, dead_letter_kind: str) -> None:
        """A video failed for good and its dead letter was stored."""
        self._add(FAILURES, 1, reason=reason.value)
        self._add(DEAD_LETTERS, 1, kind=dead_letter_kind)

    def stages(self, seconds: Mapping[str, float]) -> None:
        """One job's time per stage (``StageClock.seconds``)."""
        for stage, value in seconds.items():
            self._observe(STAGE_SECONDS, value, stage=stage if stage in STAGES else "other")

    def frames_embedded(self, n: int) -> None:
        self._add(FRAMES, n)

    def bucket_event(self, kind: str, n: int = 1) -> None:
        self._add(BUCKET_EVENTS, n, kind=kind)

    def encoder_batch(self, method: str, size: int) -> None:
        self._observe(ENCODER_BATCH, size, method=method)

    def search(self, kind: str, seconds: float, outcome: str = "ok") -> None:
        self._observe(SEARCH_SECONDS, seconds, kind=kind, outcome=outcome)

    def reconcile_round(self, findings: Mapping[str, int], submitted: int) -> None:
        self._add(RECONCILE_ROUNDS, 1)
        for finding, count in findings.items():
            self._add(RECONCILE_FINDINGS, count, finding=finding)
        self._add(RECONCILE_REPAIRS, submitted)

    def service_ok(self, service: str, at: float | None = None) -> None:
        """``service`` did its work (a round, a commit) or was seen healthy at ``at`` (now)."""
        self._observe(SERVICE_OK, time.time() if at is None else at, service=service)

    def catalog_commits(self, n: int) -> None:
        self._add(CATALOG_COMMITS, n)
