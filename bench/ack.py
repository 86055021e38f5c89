"""``python -m bench.ack [--rate R] [--seconds S]``: how fast ``POST /v1/index`` answers under a burst.

The real app (``infra.harness.faults.start_app``: Ray Serve over MinIO and RabbitMQ containers, tiny
model). First the idle figure (one request at a time), then an open-loop schedule: request i is sent
at t0 + i/R whatever became of the earlier ones (as clients of a public API behave), each timed from
its scheduled send, so a slow server can't hide its backlog (no coordinated omission). Every request
names a distinct object under ``ack/`` that was never uploaded: the API does the same work as for a
real video (the job is submitted, the catalog told), and each job costs the consumers one HEAD and
the catalog writes of "nothing there" instead of a decode, so the figure is the request path's own.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import percentile, save_section

DEFAULT_RATE, DEFAULT_SECONDS = 20.0, 20.0
FULL_SECONDS = 60.0
IDLE_REQUESTS = 20
IDLE_PAUSE_S = 0.25
#: Longest wait for the burst's last answers once the schedule is done.
DRAIN_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 60.0


def _idle(host: Any, bucket: str) -> list[float]:
    """Milliseconds of ``IDLE_REQUESTS`` requests, one at a time."""
    times = []
    for i in range(IDLE_REQUESTS):
        started = time.perf_counter()
        resp = host.http.post("/v1/index", json={"uri": f"s3://{bucket}/ack/idle-{i:04d}.mp4"})
        times.append(1000 * (time.perf_counter() - started))
        if resp.status_code != 202:
            raise RuntimeError(f"idle request answered {resp.status_code}: {resp.text[:200]}")
        time.sleep(IDLE_PAUSE_S)
    return times


async def _burst(api_url: str, bucket: str, rate: float, seconds: float) -> list[dict[str, Any]]:
    """Send ``rate`` requests a second for ``seconds`` on an open-loop schedule; one record each."""
    import httpx

    n = int(rate * seconds)
    results: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=api_url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        loop = asyncio.get_running_loop()

        async def one(i: int, scheduled: float) -> None:
            sent = loop.time()
            status: int | str
            try:
                resp = await client.post("/v1/index", json={"uri": f"s3://{bucket}/ack/burst-{i:05d}.mp4"})
                status = resp.status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            done = loop.time()
            results.append({"ms": 1000 * (done - scheduled), "late_ms": 1000 * (sent - scheduled), "status": status})

        t0 = loop.time() + 0.1
        tasks = []
        for i in range(n):
            scheduled = t0 + i / rate
            await asyncio.sleep(max(0.0, scheduled - loop.time()))
            tasks.append(asyncio.create_task(one(i, scheduled)))
        await asyncio.wait_for(asyncio.gather(*tasks), DRAIN_TIMEOUT_S)
    return results


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


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ack", description=__doc__)
    parser.add_argument("--full", action="store_true", help=f"a {FULL_SECONDS:g} s burst")
    parser.add_argument("--rate", type=float, default=DEFAULT_RATE, help="requests per second")
    parser.add_argument("--seconds", type=float, help=f"burst length (default {DEFAULT_SECONDS:g})")
    parser.add_argument(
        "--profile",
        type=Path,
        help="py-spy the Api replica and Serve's proxy during the burst (SVGs in this folder; the figures "
        "then include py-spy's own cost)",
    )
    args = parser.parse_args()
    seconds = args.seconds or (FULL_SECONDS if args.full else DEFAULT_SECONDS)

    from bench.pyspy import PY_SPY_WRITE_S, finish_py_spy
    from infra.dev.tinymodel import build_tiny_siglip
    from infra.harness.faults import start_app
    from infra.harness.services import start_services, unique_prefix

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vidx-ack-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build_tiny_siglip(tmp / "tiny", seed=0)
        with start_services() as services, start_app(services, unique_prefix(), model_dir, tmp / "state") as host:
            bucket = host.bucket
            for i in range(3):  # first requests: connection set-up, lazy imports
                host.http.post("/v1/index", json={"uri": f"s3://{bucket}/ack/warm-{i}.mp4"})
            idle = _idle(host, bucket)
            print(f"idle p50 {percentile(idle, 50):.1f} ms", flush=True)
            spies = _profile_burst(host, args.profile, seconds) if args.profile else []
            results = asyncio.run(_burst(host.settings.api_url, bucket, args.rate, seconds))
            for spy in spies:
                finish_py_spy(spy, seconds + PY_SPY_WRITE_S)
    ok = [r["ms"] for r in results if r["status"] == 202]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    metrics: dict[str, Any] = {
        "ack_p50_ms": round(percentile(ok, 50), 1),
        "ack_p95_ms": round(percentile(ok, 95), 1),
        "ack_p99_ms": round(percentile(ok, 99), 1),
        "ack_max_ms": round(max(ok), 1) if ok else float("nan"),
        "ack_idle_p50_ms": round(percentile(idle, 50), 1),
        "ack_requests": len(results),
        "ack_accepted": len(ok),
        "ack_503": statuses.get("503", 0),
        "ack_other": len(results) - len(ok) - statuses.get("503", 0),
        "ack_statuses": ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())),
        "ack_offered_rps": args.rate,
        "ack_burst_s": seconds,
        "ack_client_late_ms_p99": round(percentile([r["late_ms"] for r in results], 99), 1),
        "wall_s": round(time.monotonic() - started, 1),
    }
    notes = [
        f"open loop: {args.rate:g} req/s for {seconds:g} s, each POST /v1/index timed from its scheduled send "
        "(httpx, one client, connections pooled); percentiles over the 202s; client_late is how late the "
        f"client sent (its own lag, included in each time). Idle: {IDLE_REQUESTS} requests one at a time, "
        f"{IDLE_PAUSE_S:g} s apart.",
        "each request names a distinct object never uploaded (see the module docstring): the consumers "
        "run the jobs meanwhile, as they would in a flood.",
    ]
    save_section("ack", metrics, notes)
    for k, v in metrics.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
