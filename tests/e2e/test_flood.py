"""A small flood through the whole app (bench/flood.py's ``run_flood``): ~200 uploads in a short
ramp / sustained / 2× spike / sustained / ramp-down profile while the app may scale. Only the
invariants are asserted — nothing failed, nothing lost, nothing indexed twice, the checker green —
never timings (they depend on the machine); the figures are printed."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.flood import FloodPlan, run_flood
from infra.harness.services import Services

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1500)]

PLAN = FloodPlan(
    videos=120,  # the CI size (a fresh clone's `make test` within 60 minutes); bench.flood runs 2,000
    duration_s=45.0,
    # The profile's length is fixed (not shortened to reach a multiple of the capacity): the test
    # wants a flood it can wait for on any machine, the benchmark the overload.
    overload=0.0,
    capacity_videos=10,
    distinct_clips=8,
    probe_every=20,
    ack_requests=10,
    drain_timeout_s=600.0,
    cooldown_s=20.0,
    env={"VIDX_AUTOSCALE__ENABLED": "true"},
)


def test_a_small_flood_is_indexed_exactly_once(services: Services, tiny_model_dir: Path, tmp_path: Path) -> None:
    result = run_flood(services, tiny_model_dir, tmp_path, PLAN)
    m = result.metrics
    print(
        "flood: "
        + ", ".join(f"{k} {m[k]}" for k in sorted(m) if not isinstance(m[k], dict))
        + f"; {len(result.samples)} samples, {len(result.decisions)} scaling decisions"
    )
    for d in result.decisions:
        print(f"flood decision: {d}")
    for note in result.notes:
        print(f"flood note: {note}")
    assert m["upload_errors"] == 0, result.notes
    assert m["uploads"] == PLAN.videos
    assert m["failed"] == 0
    assert m["lost"] == 0, result.check["found"]
    assert m["duplicates"] == 0, result.check["found"]
    assert result.check["inconsistencies"] == 0, result.check["found"]
    assert m["indexed"] == PLAN.videos
    # Every probe video was returned by the search endpoint (no timing asserted).
    assert m["latency_timed"] == m["latency_probes"] == PLAN.videos // PLAN.probe_every
