"""``python -m bench.ack [--runs N] [--rate R] [--seconds S]``: how fast ``POST /v1/index`` answers.

The real app (``infra.harness.faults.start_app``: Ray Serve over MinIO and RabbitMQ containers, tiny
model), three phases. Idle: one request at a time. Burst, ``N`` runs: an open-loop schedule, request i
sent at t0 + i/R whatever became of the earlier ones, each timed from its scheduled send (no
coordinated omission); between runs the index queue is drained (bounded) so no run inherits a backlog;
the headline figures are medians over runs. Served rate: a closed loop of 32 connections, each sending
its next request when the last is answered, 300 in all; 202s per second of wall time. Every request
names a distinct object under ``ack/`` that was never uploaded, so each job costs the consumers a HEAD
and the catalog's "nothing there" instead of a decode: the figures are the request path's own.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import percentile, save_section

DEFAULT_RATE, DEFAULT_SECONDS, DEFAULT_RUNS = 20.0, 20.0, 5
FULL_SECONDS = 60.0
IDLE_REQUESTS = 20
IDLE_PAUSE_S = 0.25
#: Longest wait for a burst's last answers once its schedule is done.
ANSWER_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 60.0
#: Between runs: longest wait for the index queue to empty (ready + unacknowledged), how often it is
#: read, and how many empty readings in a row count as drained (the broker refreshes its figures
#: every second, so one zero may be stale).
QUEUE_DRAIN_TIMEOUT_S = 150.0
QUEUE_POLL_S = 1.0
QUEUE_EMPTY_READINGS = 2
SERVED_CONNECTIONS = 32
SERVED_REQUESTS = 300
#: No served request is started past this many seconds into the phase.
SERVED_DEADLINE_S = 120.0


@dataclass(frozen=True)
class Answer:
    """One request: milliseconds to its answer (from its scheduled send in the burst, from its send in
    the closed loop), how late the client sent it, and the HTTP status or the client error's name."""

    ms: float
    late_ms: float
    status: int | str


def _statuses(answers: list[Answer]) -> dict[str, int]:
    return dict(sorted(Counter(str(a.status) for a in answers).items()))


def _statuses_line(statuses: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in statuses.items())


def _accepted_ms(answers: list[Answer]) -> list[float]:
    return [a.ms for a in answers if a.status == 202]


def _idle(host: Any, bucket: str) -> list[float]:
    """Milliseconds of ``IDLE_REQUESTS`` requests, one at a time.

    Raises:
        RuntimeError: a request was not answered 202."""
    times = []
    for i in range(IDLE_REQUESTS):
        started = time.perf_counter()
        resp = host.http.post("/v1/index", json={"uri": f"s3://{bucket}/ack/idle-{i:04d}.mp4"})
        times.append(1000 * (time.perf_counter() - started))
        if resp.status_code != 202:
            raise RuntimeError(f"idle request answered {resp.status_code}: {resp.text[:200]}")
        time.sleep(IDLE_PAUSE_S)
    return times


async def _post(client: Any, uri: str) -> int | str:
    """The status of one ``POST /v1/index``, or the name of the client error that ended it."""
    import httpx

    try:
        resp = await client.post("/v1/index", json={"uri": uri})
    except httpx.HTTPError as exc:
        return type(exc).__name__
    return int(resp.status_code)


async def _burst(api_url: str, bucket: str, run: int, rate: float, seconds: float) -> list[Answer]:
    """Send ``rate`` requests a second for ``seconds`` on an open-loop schedule; one answer each (status
    ``unanswered`` for those still open ``ANSWER_TIMEOUT_S`` after the schedule ended)."""
    import httpx

    n = int(rate * seconds)
    answers: list[Answer] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=api_url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        loop = asyncio.get_running_loop()

        async def one(i: int, scheduled: float) -> None:
            sent = loop.time()
            status = await _post(client, f"s3://{bucket}/ack/burst-{run}-{i:05d}.mp4")
            answers.append(Answer(1000 * (loop.time() - scheduled), 1000 * (sent - scheduled), status))

        t0 = loop.time() + 0.1
        tasks = []
        for i in range(n):
            scheduled = t0 + i / rate
            await asyncio.sleep(max(0.0, scheduled - loop.time()))
            tasks.append(asyncio.create_task(one(i, scheduled)))
        _, pending = await asyncio.wait(tasks, timeout=ANSWER_TIMEOUT_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return answers + [Answer(math.nan, math.nan, "unanswered")] * (n - len(answers))


async def _served(api_url: str, bucket: str) -> tuple[list[Answer], float]:
    """``SERVED_CONNECTIONS`` workers, each sending its next request once the last is answered, until
    ``SERVED_REQUESTS`` are sent or ``SERVED_DEADLINE_S`` has passed; the answers and the wall seconds
    from the first send to the last answer."""
    import httpx

    answers: list[Answer] = []
    taken = 0
    limits = httpx.Limits(max_connections=SERVED_CONNECTIONS, max_keepalive_connections=SERVED_CONNECTIONS)
    async with httpx.AsyncClient(base_url=api_url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + SERVED_DEADLINE_S

        async def worker() -> None:
            nonlocal taken
            while taken < SERVED_REQUESTS and loop.time() < deadline:
                i, taken = taken, taken + 1
                sent = loop.time()
                status = await _post(client, f"s3://{bucket}/ack/served-{i:05d}.mp4")
                answers.append(Answer(1000 * (loop.time() - sent), 0.0, status))

        await asyncio.gather(*(worker() for _ in range(SERVED_CONNECTIONS)))
        wall_s = loop.time() - started
    return answers, wall_s


def _drain(host: Any) -> tuple[bool, float]:
    """Wait, at most ``QUEUE_DRAIN_TIMEOUT_S``, until the queue the consumers read holds nothing ready
    or unacknowledged; whether it did, and the seconds waited."""
    from infra.harness.services import queue_info

    queue = host.settings.serve.index_queue
    started = time.monotonic()
    deadline = started + QUEUE_DRAIN_TIMEOUT_S
    empty = 0
    while time.monotonic() < deadline:
        info = queue_info(host.services, queue)
        # {}: the broker did not answer, which says nothing about the queue.
        held = int(info.get("messages_ready") or 0) + int(info.get("messages_unacknowledged") or 0) if info else -1
        empty = empty + 1 if held == 0 else 0
        if empty >= QUEUE_EMPTY_READINGS:
            return True, time.monotonic() - started
        time.sleep(min(QUEUE_POLL_S, max(0.0, deadline - time.monotonic())))
    return False, time.monotonic() - started


def _run_figures(run: int, answers: list[Answer], drained: bool, drain_s: float) -> dict[str, Any]:
    ok = _accepted_ms(answers)
    return {
        "run": run,
        "p50_ms": round(percentile(ok, 50), 1),
        "p95_ms": round(percentile(ok, 95), 1),
        "p99_ms": round(percentile(ok, 99), 1),
        "max_ms": round(max(ok), 1) if ok else math.nan,
        "requests": len(answers),
        "accepted": len(ok),
        "statuses": _statuses(answers),
        "client_late_ms_p99": round(percentile([a.late_ms for a in answers if not math.isnan(a.late_ms)], 99), 1),
        "drained_after": drained,
        "drain_s": round(drain_s, 1),
    }


def _run_line(r: dict[str, Any]) -> str:
    drain = f"drained in {r['drain_s']:g} s" if r["drained_after"] else f"NOT drained after {r['drain_s']:g} s"
    return (
        f"run {r['run']}: p50 {r['p50_ms']:g} ms, p95 {r['p95_ms']:g} ms, p99 {r['p99_ms']:g} ms, "
        f"max {r['max_ms']:g} ms; {r['accepted']}/{r['requests']} accepted ({_statuses_line(r['statuses'])}); "
        f"client late p99 {r['client_late_ms_p99']:g} ms; queue {drain}"
    )


def _median(values: list[float]) -> float:
    """The median of the values that are numbers; NaN if none is."""
    numbers = [v for v in values if not math.isnan(v)]
    return round(statistics.median(numbers), 1) if numbers else math.nan


def _profile_burst(host: Any, folder: Path, seconds: float) -> list[Any]:
    """py-spy on the Api replica and Serve's HTTP proxy for the burst's length."""
    import ray
    from ray.util.state import list_actors

    from bench.pyspy import start_py_spy

    pids = {"api": host.replica_pids("Api")[0]}
    actors = list_actors(
        address=ray.get_runtime_context().gcs_address,
        filters=[("class_name", "=", "ProxyActor"), ("state", "=", "ALIVE")],
        raise_on_missing_output=False,
    )
    if actors:
        pids["proxy"] = actors[0].pid
    return [start_py_spy(pid, int(seconds) + 2, folder / f"ack-{name}.svg") for name, pid in pids.items()]


def _metrics(
    idle: list[float],
    runs: list[dict[str, Any]],
    served: list[Answer],
    served_wall_s: float,
    rate: float,
    seconds: float,
) -> dict[str, Any]:
    totals: Counter[str] = Counter()
    for r in runs:
        totals.update(r["statuses"])
    accepted, requests = sum(r["accepted"] for r in runs), sum(r["requests"] for r in runs)
    served_ok = _accepted_ms(served)
    return {
        "ack_p50_ms": _median([r["p50_ms"] for r in runs]),
        "ack_p95_ms": _median([r["p95_ms"] for r in runs]),
        "ack_p99_ms": _median([r["p99_ms"] for r in runs]),
        "ack_max_ms": _median([r["max_ms"] for r in runs]),
        "ack_runs": runs,
        "ack_run_count": len(runs),
        "ack_idle_p50_ms": round(percentile(idle, 50), 1),
        "ack_requests": requests,
        "ack_accepted": accepted,
        "ack_503": totals.get("503", 0),
        "ack_other": requests - accepted - totals.get("503", 0),
        "ack_statuses": _statuses_line(dict(sorted(totals.items()))),
        "ack_offered_rps": rate,
        "ack_burst_s": seconds,
        "ack_client_late_ms_p99": max((r["client_late_ms_p99"] for r in runs), default=math.nan),
        "ack_undrained_runs": sum(not r["drained_after"] for r in runs),
        "ack_served_rps_32c": round(len(served_ok) / served_wall_s, 1) if served_wall_s > 0 else math.nan,
        "ack_served_p50_ms": round(percentile(served_ok, 50), 1),
        "ack_served_p95_ms": round(percentile(served_ok, 95), 1),
        "ack_served_requests": len(served),
        "ack_served_accepted": len(served_ok),
        "ack_served_statuses": _statuses_line(_statuses(served)),
        "ack_served_wall_s": round(served_wall_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ack", description=__doc__)
    parser.add_argument("--full", action="store_true", help=f"{FULL_SECONDS:g} s burst runs")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS, help=f"burst runs (default {DEFAULT_RUNS})")
    parser.add_argument("--rate", type=float, default=DEFAULT_RATE, help="requests per second in a burst")
    parser.add_argument("--seconds", type=float, help=f"length of each burst run (default {DEFAULT_SECONDS:g})")
    parser.add_argument(
        "--profile",
        type=Path,
        help="py-spy the Api replica and Serve's proxy during the first burst run (SVGs in this folder; "
        "that run's figures then include py-spy's own cost)",
    )
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    seconds = args.seconds or (FULL_SECONDS if args.full else DEFAULT_SECONDS)

    from bench.pyspy import PY_SPY_WRITE_S, finish_py_spy
    from infra.dev.tinymodel import build_tiny_siglip
    from infra.harness.faults import start_app
    from infra.harness.services import start_services, unique_prefix

    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vidx-ack-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build_tiny_siglip(tmp / "tiny", seed=0)
        with (
            start_services() as services,
            start_app(services, unique_prefix(), model_dir, tmp / "state", metrics_push_ms=None) as host,
        ):
            bucket, api_url = host.bucket, host.settings.api_url
            for i in range(3):  # first requests: connection set-up, lazy imports
                host.http.post("/v1/index", json={"uri": f"s3://{bucket}/ack/warm-{i}.mp4"})
            idle = _idle(host, bucket)
            print(f"idle p50 {percentile(idle, 50):.1f} ms", flush=True)
            _drain(host)
            for run in range(args.runs):
                spies = _profile_burst(host, args.profile, seconds) if args.profile and run == 0 else []
                answers = asyncio.run(_burst(api_url, bucket, run, args.rate, seconds))
                for spy in spies:
                    finish_py_spy(spy, seconds + PY_SPY_WRITE_S)
                runs.append(_run_figures(run, answers, *_drain(host)))
                print(_run_line(runs[-1]), flush=True)
            served, served_wall_s = asyncio.run(_served(api_url, bucket))
    metrics = _metrics(idle, runs, served, served_wall_s, args.rate, seconds)
    metrics["wall_s"] = round(time.monotonic() - started, 1)
    notes = [
        f"burst: {len(runs)} runs, each open loop at {args.rate:g} req/s for {seconds:g} s, every POST /v1/index "
        "timed from its scheduled send (httpx, one client per run, connections pooled); each run's "
        "percentiles are over its 202s; ack_p50_ms, ack_p95_ms, ack_p99_ms and ack_max_ms are the MEDIANS "
        "over runs of each run's figure (every run is in ack_runs); request and status counts are totals "
        "over runs; client_late is how late the client sent (its own lag, included in each time), worst run.",
        f"after each run (and before the first) the index queue is waited on until it holds nothing ready "
        f"or unacknowledged ({QUEUE_EMPTY_READINGS} readings {QUEUE_POLL_S:g} s apart), at most "
        f"{QUEUE_DRAIN_TIMEOUT_S:g} s; ack_undrained_runs counts runs whose wait ran out (the next run then "
        "started with a backlog).",
        f"served: a closed loop after the bursts, {SERVED_CONNECTIONS} connections (httpx AsyncClient, "
        f"{SERVED_CONNECTIONS} workers each sending its next request once the last is answered), "
        f"{SERVED_REQUESTS} requests in all (none started past {SERVED_DEADLINE_S:g} s); ack_served_rps_32c "
        "is the 202s per second of wall time from the first send to the last answer; its latencies are "
        "from each request's send. The client shares the machine's cores with the app.",
        f"idle: {IDLE_REQUESTS} requests one at a time, {IDLE_PAUSE_S:g} s apart, before the bursts.",
        "each request names a distinct object never uploaded (see the module docstring): the consumers "
        "run the jobs meanwhile, as they would in a flood.",
        *[_run_line(r) for r in runs],
    ]
    save_section("ack", metrics, notes)
    for k, v in metrics.items():
        if k != "ack_runs":
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
