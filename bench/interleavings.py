"""``python -m bench.interleavings [--schedules N] [--seed S]``: the seeded interleavings
(tests/integration/test_interleavings.py: racing real jobs on LanceDB-on-MinIO, pauses at every step,
aborts, faults inside catalog writes) at full size — 1000 schedules by default, against the 200 that
``make test`` runs. It runs that test with ``VIDX_INTERLEAVINGS`` set (its time bound scaled to
match) and prints its ``interleavings:`` line; a failure prints each failing seed and how to replay it."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from bench.common import ROOT

#: Seconds per schedule the run may take, at most (the CI size's bound is 1800 s for 200).
BOUND_PER_SCHEDULE_S = 9.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.interleavings", description=__doc__)
    parser.add_argument("--schedules", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1, help="the first schedule's seed")
    args = parser.parse_args(argv)
    env = {
        **os.environ,
        "VIDX_INTERLEAVINGS": str(args.schedules),
        "VIDX_INTERLEAVINGS_SEED": str(args.seed),
        "VIDX_INTERLEAVINGS_BOUND_S": str(max(1800.0, args.schedules * BOUND_PER_SCHEDULE_S)),
    }
    test = "tests/integration/test_interleavings.py::test_seeded_interleavings_leave_no_violation"
    cmd = [sys.executable, "-m", "pytest", test, "-q", "-p", "no:cacheprovider"]
    return subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
