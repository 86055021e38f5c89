"""The nemesis: seeded schedules of gray faults fired at the real app while uploads, overwrites, deletes
and identical re-uploads stream in, each followed by the checker (Jepsen's shape: faults injected while
a history is recorded, a checker judges it afterwards).

Network faults go through Toxiproxy (Shopify's TCP fault proxy, its own container, driven over its HTTP
API): the app reaches MinIO and RabbitMQ only through it, while the stream and the checker talk to them
directly, so a fault hits the app and never the judge. Process faults signal the app's Ray Serve
replicas: SIGSTOP/SIGCONT (a replica paused by the OS) and SIGKILL.

A schedule is a pure function of its seed (the faults, their parameters and the stream's operations;
not the threads' timing), so a failing one replays: ``python -m bench.nemesis --seed S --schedules 1``.
Its two faults fire one after the other, the first while the stream runs, the second often after the
stream's last operation, while its jobs are still running. After its faults stop,
a schedule must show 0 lost, 0 duplicated, 0 queued/indexing, ``vidx check`` finding nothing, and every
object settled within ``SETTLE_BOUND_S``; anything else is a violation.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from testcontainers.core.container import DockerContainer

from infra.harness.faults import (
    AppHost,
    Fault,
    StreamLog,
    StreamPlan,
    Summary,
    Tables,
    Variant,
    check,
    queues_idle,
    run_stream,
    start_app,
    vidx_check,
)
from infra.harness.services import Services, container_ip, eventually, queue_counts

TOXIPROXY_IMAGE = "vidx/toxiproxy:test"
API_PORT = 8474
#: The proxies' listening ports inside the Toxiproxy container.
PROXY_PORTS = {"s3": 8666, "amqp": 8667}
START_TIMEOUT_S = 60.0

#: The fault kinds, in the order the summary line names them. A schedule's first fault is the kind its
#: seed picks in turn (``seed % 6``), so any 6 consecutive seeds fire every kind.
KINDS = ("latency", "bandwidth", "stall", "reset", "pause", "kill")
#: The replicas a pause may hit, and the one a kill hits.
PAUSE_TARGETS = ("CatalogWriter", "IndexConsumer", "EventRouter")
KILL_TARGET = "CatalogWriter"

#: Operations per schedule, and their pace.
OPS = 10
RATE_PER_S = 2.5
#: Every object settled (indexed at its version, or gone) within this many seconds of the last fault.
SETTLE_BOUND_S = 180.0
#: How long a settled state must hold (queues empty, the check clean) before the schedule counts as
#: settled: the management API refreshes its queue figures every second in our image.
CONFIRM_S = 2.0
#: A slow settle notes what it still waits for this often.
NOTE_EVERY_S = 10.0
POLL_S = 1.0
#: Longest wait for the queues to drain once every schedule ran.
DRAIN_TIMEOUT_S = 300.0
#: The stream's keys of every schedule start with this (``StreamPlan.prefix``).
NEMESIS_PREFIX = "faults/nemesis-"


# -- Toxiproxy ---------------------------------------------------------------------------------------
class Toxiproxy:
    """Toxiproxy's HTTP API, the four calls the nemesis needs (the PyPI client, toxiproxy-python 0.1.1,
    is unmaintained and synchronous-only like this; these are four requests)."""

    def __init__(self, api_url: str) -> None:
        self._http = httpx.Client(base_url=api_url, timeout=10)

    def close(self) -> None:
        self._http.close()

    def version(self) -> str:
        return self._http.get("/version").raise_for_status().text

    def create(self, name: str, listen: str, upstream: str) -> None:
        body = {"name": name, "listen": listen, "upstream": upstream, "enabled": True}
        self._http.post("/proxies", json=body).raise_for_status()

    def add_toxic(self, proxy: str, name: str, kind: str, attributes: dict[str, int], stream: str) -> None:
        body = {"name": name, "type": kind, "stream": stream, "toxicity": 1.0, "attributes": attributes}
        self._http.post(f"/proxies/{proxy}/toxics", json=body).raise_for_status()

    def remove_toxic(self, proxy: str, name: str) -> None:
        self._http.delete(f"/proxies/{proxy}/toxics/{name}").raise_for_status()

    def reset(self) -> None:
        """Every proxy enabled, every toxic removed."""
        self._http.post("/reset").raise_for_status()


@dataclass(frozen=True)
class Proxies:
    """The Toxiproxy container's API and the endpoints the app uses instead of MinIO's and RabbitMQ's."""

    api: Toxiproxy
    s3_endpoint: str
    amqp_url: str

    def app_env(self) -> dict[str, str]:
        return {"VIDX_S3__ENDPOINT_URL": self.s3_endpoint, "VIDX_AMQP__URL": self.amqp_url}


@contextlib.contextmanager
def start_toxiproxy(services: Services) -> Iterator[Proxies]:
    """A Toxiproxy container with a proxy to MinIO (``s3``) and one to RabbitMQ (``amqp``), each
    reaching its upstream at the container's address on the container network."""
    container = DockerContainer(TOXIPROXY_IMAGE).with_exposed_ports(API_PORT, *PROXY_PORTS.values())
    container.start()
    try:
        host = container.get_container_host_ip()
        api = Toxiproxy(f"http://{host}:{container.get_exposed_port(API_PORT)}")

        def up() -> bool:
            try:
                return bool(api.version())
            except httpx.HTTPError:
                return False

        eventually(up, "Toxiproxy's API", START_TIMEOUT_S, poll_s=0.3)
        upstreams = {"s3": f"{container_ip(services.minio)}:9000", "amqp": f"{container_ip(services.rabbit)}:5672"}
        for name, port in PROXY_PORTS.items():
            api.create(name, f"0.0.0.0:{port}", upstreams[name])
        s3 = f"http://{host}:{container.get_exposed_port(PROXY_PORTS['s3'])}"
        direct = urlsplit(services.amqp_url)
        userinfo, at, _ = direct.netloc.rpartition("@")
        proxied = f"{userinfo}{at}{host}:{container.get_exposed_port(PROXY_PORTS['amqp'])}"
        amqp = urlunsplit(direct._replace(netloc=proxied))
        try:
            yield Proxies(api, s3, amqp)
        finally:
            api.close()
    finally:
        container.stop()


# -- schedules ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FaultSpec:
    """One fault of a schedule: its kind, what it hits (a proxy or a deployment), after how many of the
    stream's operations it fires, how long it holds, and the toxic's attributes."""

    kind: str
    target: str
    at_op: int
    hold_s: float
    attributes: tuple[tuple[str, int], ...] = ()

    def describe(self) -> str:
        attrs = ", ".join(f"{k} {v}" for k, v in self.attributes)
        return f"{self.kind} {self.target} {self.hold_s:.1f}s{f' ({attrs})' if attrs else ''} at op {self.at_op}"


def _spec(rng: random.Random, kind: str, at_op: int) -> FaultSpec:
    proxy = rng.choice(sorted(PROXY_PORTS))
    if kind == "latency":  # 100 ms - 5 s on every chunk, with jitter
        latency = rng.randint(100, 5000)
        jitter = rng.randint(latency // 10, latency // 2)
        return FaultSpec(kind, proxy, at_op, rng.uniform(2.0, 5.0), (("latency", latency), ("jitter", jitter)))
    if kind == "bandwidth":  # KB/s
        return FaultSpec(kind, proxy, at_op, rng.uniform(2.0, 5.0), (("rate", rng.choice((4, 16, 64))),))
    if kind == "stall":  # nothing gets through; each connection closed after the stall
        hold = rng.uniform(1.0, 4.0)
        return FaultSpec(kind, proxy, at_op, hold, (("timeout", int(hold * 1000)),))
    if kind == "reset":  # connections reset by peer, at once or a little later
        return FaultSpec(kind, proxy, at_op, rng.uniform(1.0, 3.0), (("timeout", rng.randint(0, 500)),))
    if kind == "pause":
        return FaultSpec(kind, rng.choice(PAUSE_TARGETS), at_op, rng.uniform(1.0, 5.0))
    if kind == "kill":
        return FaultSpec(kind, KILL_TARGET, at_op, 0.0)
    raise ValueError(f"unknown fault kind {kind!r}")


def schedule(seed: int) -> list[FaultSpec]:
    """The faults of schedule ``seed``: the kind ``seed`` picks in turn, then one drawn at random,
    fired after the first and the fifth of the stream's operations (the second once the first has
    ended)."""
    rng = random.Random(seed)
    kinds = [KINDS[seed % len(KINDS)], rng.choice(KINDS)]
    return [_spec(rng, kind, at_op) for kind, at_op in zip(kinds, (1, 5), strict=True)]


# -- firing ------------------------------------------------------------------------------------------
TOXIC_TYPES = {"latency": "latency", "bandwidth": "bandwidth", "stall": "timeout", "reset": "reset_peer"}


class Nemesis:
    """Fires a schedule's faults at the app; remembers when the last one ended."""

    def __init__(self, host: AppHost, proxies: Proxies, seed: int) -> None:
        self._host = host
        self._proxies = proxies
        self._rng = random.Random(seed ^ 0x5EED)  # which consumer a pause hits
        self.last_ended = time.monotonic()

    def fault(self, spec: FaultSpec) -> Fault:
        def inject() -> str:
            try:
                return self._fire(spec)
            finally:
                self.last_ended = time.monotonic()

        return Fault(spec.at_op, spec.describe(), inject)

    def _fire(self, spec: FaultSpec) -> str:
        if spec.kind in TOXIC_TYPES:
            api, name = self._proxies.api, f"nemesis-{spec.kind}"
            # Latency and bandwidth slow the answers; a stall or a reset cuts both directions.
            streams = ["downstream"] if spec.kind in ("latency", "bandwidth") else ["downstream", "upstream"]
            for stream in streams:
                api.add_toxic(spec.target, f"{name}-{stream}", TOXIC_TYPES[spec.kind], dict(spec.attributes), stream)
            try:
                time.sleep(spec.hold_s)
            finally:
                for stream in streams:
                    api.remove_toxic(spec.target, f"{name}-{stream}")
            return f"{TOXIC_TYPES[spec.kind]} toxic on {spec.target} for {spec.hold_s:.1f}s"
        if spec.kind == "pause":
            pids = self._host.replica_pids(spec.target)
            if not pids:
                raise RuntimeError(f"no live replica of {spec.target} to pause")
            pid = self._rng.choice(pids)
            return pause(pid, spec.hold_s, spec.target)
        if spec.kind == "kill":
            return self._host.kill_replica(spec.target)
        raise ValueError(f"unknown fault kind {spec.kind!r}")


def pause(pid: int, seconds: float, what: str) -> str:
    """SIGSTOP ``pid`` for ``seconds``, then SIGCONT it."""
    if pid <= 0:  # never signal 0 or -1: that would stop this process group, or everything
        raise RuntimeError(f"{what} has no process ({pid})")
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    return f"{what} pid {pid} SIGSTOPped for {seconds:.1f}s"


# -- one schedule, many schedules ----------------------------------------------------------------------
@dataclass
class ScheduleRun:
    seed: int
    faults: list[FaultSpec]
    plan: StreamPlan
    log: StreamLog
    summary: Summary
    #: Seconds from the end of the last fault until every object of the schedule was settled (indexed
    #: at its version, or gone with its row ``deleted``), still so ``CONFIRM_S`` later (None: not within
    #: ``SETTLE_BOUND_S``).
    settled_s: float | None
    violations: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        s = self.summary
        settled = f"{self.settled_s:.1f}s" if self.settled_s is not None else f"not within {SETTLE_BOUND_S:g}s"
        head = (
            f"schedule {self.seed}: {', '.join(f.describe() for f in self.faults)}; uploads {s.uploads} "
            f"(re-uploads {self.log.reuploads}), deletes {s.deletes}, indexed {s.indexed}, lost {s.lost}, "
            f"duplicated {s.duplicated}, settled {settled} after the last fault"
        )
        return [head, *(f"  {note}" for note in self.log.notes), *self.violation_lines()]

    def violation_lines(self) -> list[str]:
        replay = f"(replay: python -m bench.nemesis --seed {self.seed} --schedules 1)"
        return [f"  VIOLATION schedule {self.seed}: {v}  {replay}" for v in self.violations]


def settle(host: AppHost, plan: StreamPlan, log: StreamLog, since: float) -> tuple[Summary, float | None]:
    """Wait (at most until ``since + SETTLE_BOUND_S``) until the index matches the bucket for the
    schedule's keys, still so ``CONFIRM_S`` later. Returns the last summary and when it first held
    (seconds after ``since``), or None. (Jobs with nothing left to do may still wait in the queue:
    ``run_nemesis`` drains it at the end and checks every schedule again.)"""
    tables = judge_tables(host)
    deadline = since + SETTLE_BOUND_S
    next_note = time.monotonic() + NOTE_EVERY_S
    summary = check(host, plan, log, tables)
    while True:
        if summary.ok:
            first = time.monotonic()
            time.sleep(CONFIRM_S)
            summary = check(host, plan, log, tables)
            if summary.ok:
                return summary, first - since
            continue
        if time.monotonic() >= deadline:
            return summary, None
        if time.monotonic() >= next_note:  # what a slow settle still waits for
            next_note += NOTE_EVERY_S
            counts = {q: queue_counts(host.services, q) for q in _queues(host)}
            log.notes.append(
                f"settling t={time.monotonic() - since:.0f}s: queues (ready, unacked) {counts}, "
                f"e.g. {summary.problems[0]}"
            )
        time.sleep(POLL_S)
        summary = check(host, plan, log, tables)


def judge_tables(host: AppHost) -> Tables:
    """The index tables as the checker reads them: straight from MinIO, never through Toxiproxy."""
    s = host.settings
    direct = s.model_copy(update={"s3": s.s3.model_copy(update={"endpoint_url": host.services.s3_endpoint})})
    return Tables(direct)


def _queues(host: AppHost) -> tuple[str, str]:
    return host.settings.amqp.events_queue, host.settings.serve.index_queue


def run_schedule(host: AppHost, proxies: Proxies, variants: list[Variant], seed: int) -> ScheduleRun:
    faults = schedule(seed)
    plan = StreamPlan(f"nemesis-{seed}", OPS, seed=seed, rate_per_s=RATE_PER_S, keys=4, reupload_share=0.4)
    nemesis = Nemesis(host, proxies, seed)
    log = run_stream(host, plan, variants, [nemesis.fault(f) for f in faults])
    proxies.api.reset()  # nothing left behind if a fault's removal failed (that is an error of its own)
    summary, settled_s = settle(host, plan, log, nemesis.last_ended)
    run = ScheduleRun(seed, faults, plan, log, summary, settled_s)
    run.violations += [f"fault error: {e}" for e in log.errors]
    run.violations += [f"{n} operations of the stream never went through" for n in [log.failed_ops] if n]
    run.violations += [f"index vs bucket: {p}" for p in summary.problems]
    if settled_s is None:
        run.violations.append(f"not settled within {SETTLE_BOUND_S:g}s of the last fault")
    return run


def final_check(host: AppHost, runs: list[ScheduleRun]) -> float:
    """Once every schedule ran: wait (at most ``DRAIN_TIMEOUT_S``) for the queues to drain — jobs left
    over from the faults, retries, redeliveries — then hold every schedule's keys against the bucket
    again (a late job must not undo a settled video) and run ``vidx check`` over all of them once; a
    finding goes to the schedule whose keys it names. Returns the seconds the drain took."""
    started = time.monotonic()
    drained = False
    while time.monotonic() - started < DRAIN_TIMEOUT_S:
        if queues_idle(host):
            time.sleep(CONFIRM_S)
            if drained := queues_idle(host):
                break
        time.sleep(POLL_S)
    drain_s = time.monotonic() - started
    tables = judge_tables(host)
    by_prefix = {run.plan.prefix: run for run in runs}
    for run in runs:
        if not drained:
            counts = {q: queue_counts(host.services, q) for q in _queues(host)}
            run.violations.append(f"queues not drained within {DRAIN_TIMEOUT_S:g}s: {counts}")
        late = check(host, run.plan, run.log, tables)
        run.violations += [f"after the queues drained: {p}" for p in late.problems]
    checked = vidx_check(prefix=NEMESIS_PREFIX, env={"VIDX_S3__ENDPOINT_URL": host.services.s3_endpoint})
    for item in checked.report["found"]:
        uri = str(item["uri"] or "")
        key = uri.removeprefix(f"s3://{host.bucket}/")
        owner = next((r for p, r in by_prefix.items() if key.startswith(p)), runs[-1])
        owner.violations.append(f"vidx check: {item['finding']} {uri or item['video_id']} ({item['detail']})")
    if checked.in_flight and runs:
        runs[-1].violations.append(f"vidx check: {checked.in_flight} videos still queued/indexing")
    return drain_s


@dataclass
class NemesisReport:
    runs: list[ScheduleRun]
    elapsed_s: float
    #: Seconds the queues took to drain after the last schedule (``final_check``).
    drain_s: float = 0.0

    @property
    def faults(self) -> Counter[str]:
        fired = Counter({kind: 0 for kind in KINDS})
        fired.update(f.kind for run in self.runs for f in run.faults)
        return fired

    @property
    def violations(self) -> int:
        return sum(len(run.violations) for run in self.runs)

    @property
    def settled_max_s(self) -> float | None:
        times = [run.settled_s for run in self.runs if run.settled_s is not None]
        return max(times) if times else None

    def violation_lines(self) -> list[str]:
        return [line for run in self.runs for line in run.violation_lines()]

    def line(self) -> str:
        faults = ", ".join(f"{kind}: {n}" for kind, n in self.faults.items())
        worst = self.settled_max_s
        settled = f"settled ≤ {worst:.1f} s after the last fault" if worst is not None else "nothing settled"
        return f"nemesis: {len(self.runs)} schedules, faults {{{faults}}}, {self.violations} violations, {settled}"

    def as_json(self) -> dict[str, Any]:
        settled = sorted(run.settled_s for run in self.runs if run.settled_s is not None)
        return {
            "schedules": len(self.runs),
            "faults": dict(self.faults),
            "violations": self.violations,
            "settle_bound_s": SETTLE_BOUND_S,
            "settled_max_s": self.settled_max_s,
            "settled_p50_s": settled[len(settled) // 2] if settled else None,
            "uploads": sum(r.summary.uploads for r in self.runs),
            "reuploads": sum(r.log.reuploads for r in self.runs),
            "deletes": sum(r.summary.deletes for r in self.runs),
            "elapsed_s": round(self.elapsed_s, 1),
            "drain_s": round(self.drain_s, 1),
            "failing_seeds": [r.seed for r in self.runs if r.violations],
        }


def run_nemesis(
    host: AppHost,
    proxies: Proxies,
    variants: list[Variant],
    seeds: range,
    progress: Callable[[ScheduleRun], None] | None = None,
) -> NemesisReport:
    started = time.monotonic()
    runs = []
    for seed in seeds:
        run = run_schedule(host, proxies, variants, seed)
        runs.append(run)
        if progress is not None:
            progress(run)
    drain_s = final_check(host, runs) if runs else 0.0
    return NemesisReport(runs, time.monotonic() - started, drain_s)


@contextlib.contextmanager
def start_nemesis_app(
    services: Services, prefix: str, model_dir: Path, state_dir: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[AppHost, Proxies]]:
    """Toxiproxy in front of ``services``, and the app reaching them only through it."""
    with (
        start_toxiproxy(services) as proxies,
        start_app(services, prefix, model_dir, state_dir, env={**proxies.app_env(), **(env or {})}) as host,
    ):
        yield host, proxies
