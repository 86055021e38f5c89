"""``python -m bench.nemesis``: the nemesis at full size — ``--schedules`` (default 200) seeded schedules
of gray faults against the real app (infra/harness/nemesis.py: Toxiproxy latency, bandwidth, stalls and
resets between the app and MinIO/RabbitMQ; SIGSTOP of a replica; SIGKILL of the CatalogWriter) while
uploads, overwrites, deletes and identical re-uploads stream in. Prints one line per schedule, then

    nemesis: N schedules, faults {latency: a, ...}, V violations, settled ≤ S s after the last fault

and writes bench/results/nemesis.json. Exit status 1 when any schedule broke an invariant; each such
schedule prints its seed, and ``--seed S --schedules 1`` replays it. Starts its own MinIO, RabbitMQ and
Toxiproxy containers and its own Ray instance. Not part of ``make bench`` (about 20 s a schedule);
``make test`` runs 20 schedules (tests/integration/test_nemesis.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.nemesis", description=__doc__)
    parser.add_argument("--schedules", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0, help="the first schedule's seed; the others follow it")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "nemesis.json")
    args = parser.parse_args(argv)

    from infra.dev.tinymodel import build_tiny_siglip
    from infra.harness.faults import make_variants
    from infra.harness.nemesis import ScheduleRun, run_nemesis, start_nemesis_app
    from infra.harness.services import start_services, unique_prefix

    def progress(run: ScheduleRun) -> None:
        for line in run.lines():
            print(line, flush=True)

    with tempfile.TemporaryDirectory(prefix="vidx-nemesis-") as tmp, start_services() as services:
        root = Path(tmp)
        model_dir = build_tiny_siglip(root / "tiny-siglip", seed=0)
        (root / "state").mkdir()
        with start_nemesis_app(services, unique_prefix(), model_dir, root / "state") as (host, proxies):
            variants = make_variants(root, host.settings.sampling.every_s)
            seeds = range(args.seed, args.seed + args.schedules)
            report = run_nemesis(host, proxies, variants, seeds, progress)
    for line in report.violation_lines():
        print(line, flush=True)
    print(report.line(), flush=True)
    print(f"in {report.elapsed_s:.0f}s (the queues drained {report.drain_s:.0f}s after the last schedule)", flush=True)
    if args.schedules >= 20:  # a replay of a few schedules doesn't replace the run's figures
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"line": report.line(), **report.as_json()}, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0 if report.violations == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
