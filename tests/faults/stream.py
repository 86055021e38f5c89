"""The long fault stream: uploads, overwrites and deletes with RabbitMQ restarted twice and the
IndexConsumer killed twice (SIGKILL, mid-video) while it runs; prints the scenario summary line, the
elapsed time and the throughput.

    eval "$(infra/containers/engine.sh)" && .venv/bin/python -m tests.faults.stream --ops 500

It starts its own MinIO and RabbitMQ containers and its own Ray instance; exit status 1 when
anything was lost or duplicated. ``tests/integration/test_faults.py`` runs ``run_long_stream`` on
the shared app of that module.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from infra.harness.faults import (
    AppHost,
    Fault,
    StreamLog,
    StreamPlan,
    Summary,
    converge,
    kill_mid_video,
    make_variants,
    run_stream,
    start_app,
)
from infra.harness.services import restart_rabbitmq, start_services, unique_prefix

#: Longest wait for the index to catch up with the bucket after the stream.
CONVERGE_TIMEOUT_S = 1200.0


@dataclass(frozen=True)
class LongRun:
    plan: StreamPlan
    log: StreamLog
    summary: Summary
    converge_s: float

    @property
    def elapsed_s(self) -> float:
        return self.log.stream_s + self.converge_s

    def lines(self) -> list[str]:
        ops = self.plan.ops
        return [
            self.summary.line(self.plan.name),
            f"fault {self.plan.name}: {ops} ops in {self.elapsed_s:.1f}s ({ops / self.elapsed_s:.2f} ops/s end to "
            f"end; stream {self.log.stream_s:.1f}s at {self.plan.rate_per_s:g} ops/s, converged "
            f"{self.converge_s:.1f}s after it), {self.log.failed_ops} ops refused",
            *(f"  {note}" for note in self.log.notes),
            *(f"  fault error: {err}" for err in self.log.errors),
            *(f"  {p}" for p in self.summary.problems[:20]),
        ]


def run_long_stream(
    host: AppHost, variants_dir: Path, ops: int = 500, seed: int = 2024, rate_per_s: float = 4.0
) -> LongRun:
    """``ops`` operations; RabbitMQ restarts at 20% and 60% of them, consumer kills at 40% and 80%."""
    plan = StreamPlan(name=f"stream{ops}", ops=ops, seed=seed, rate_per_s=rate_per_s)
    variants = make_variants(variants_dir, host.settings.sampling.every_s)
    faults = [
        Fault(ops * 2 // 10, "rabbitmq restart", lambda: f"down {restart_rabbitmq(host.services, down_s=3.0):.1f}s"),
        Fault(ops * 4 // 10, "consumer SIGKILL", lambda: kill_mid_video(host, plan, "IndexConsumer")),
        Fault(ops * 6 // 10, "rabbitmq restart", lambda: f"down {restart_rabbitmq(host.services, down_s=3.0):.1f}s"),
        Fault(ops * 8 // 10, "consumer SIGKILL", lambda: kill_mid_video(host, plan, "IndexConsumer")),
    ]
    log = run_stream(host, plan, variants, faults)
    summary, converge_s = converge(host, plan, log, CONVERGE_TIMEOUT_S)
    return LongRun(plan, log, summary, converge_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=500)
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument("--rate", type=float, default=4.0, help="operations per second, at most")
    args = parser.parse_args(argv)

    from infra.dev.tinymodel import build_tiny_siglip

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vidx-faults-") as tmp, start_services() as services:
        root = Path(tmp)
        model_dir = build_tiny_siglip(root / "tiny-siglip", seed=0)
        (root / "state").mkdir()
        (root / "media").mkdir()
        with start_app(services, unique_prefix(), model_dir, root / "state") as host:
            print(f"app up in {time.monotonic() - started:.1f}s", flush=True)
            run = run_long_stream(host, root / "media", ops=args.ops, seed=args.seed, rate_per_s=args.rate)
    for line in run.lines():
        print(line, flush=True)
    return 0 if run.summary.ok and not run.log.errors else 1


if __name__ == "__main__":
    sys.exit(main())
