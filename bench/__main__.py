"""``python -m bench [--full]``: every benchmark in its own process (fresh memory, fresh caches), then
the report. Defaults are sized to finish in ≤ 32 minutes on a quiet 2-core machine (events, ack, cpu,
relevance and text_cost add ~5, ~2, ~4, ~4 and ~3 minutes to the ~12 of the others); ``--full`` runs the
bigger sizes and search at 10M frames (``bench.stages.search_10m``: ~25 more minutes and ~36 GiB of disk)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from bench import report

#: Each benchmark's module under ``bench`` (the stage benches are in ``bench/stages/``).
MODULES = {
    "decode": "stages.decode",
    "encode": "stages.encode",
    "write": "stages.write",
    "search": "stages.search",
    "e2e": "e2e",
    "cpu": "cpu",
    "events": "stages.events",
    "ack": "ack",
    "relevance": "relevance",
    "text_cost": "stages.text_cost",
    "search_10m": "stages.search_10m",
}
BENCHMARKS = ["decode", "encode", "write", "search", "e2e", "cpu", "events", "ack", "relevance", "text_cost"]
#: Run by ``--full`` (or named in ``--only``) only.
FULL_ONLY = ["search_10m"]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--full", action="store_true", help="bigger inputs (much longer)")
    parser.add_argument("--only", nargs="*", choices=BENCHMARKS + FULL_ONLY, help="run only these")
    args = parser.parse_args()
    failed = []
    for name in args.only or BENCHMARKS + (FULL_ONLY if args.full else []):
        started = time.monotonic()
        print(f"== bench {name}", flush=True)
        cmd = [sys.executable, "-m", f"bench.{MODULES[name]}", *(["--full"] if args.full else [])]
        if subprocess.run(cmd, check=False).returncode != 0:
            failed.append(name)
        print(f"== bench {name}: {time.monotonic() - started:.0f}s", flush=True)
    report.main()
    if failed:
        sys.exit(f"benchmarks failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
