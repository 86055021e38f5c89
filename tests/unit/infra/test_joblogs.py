"""The benchmarks' completion watch over the index replicas' log files (infra/harness/joblogs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.harness.joblogs import JobLogWatch


def line(vid: str, outcome: str, **more: object) -> str:
    record = {"message": f"job index -> {outcome}", "video_id": vid, "outcome": outcome, "stage": "done"}
    return json.dumps(record | more)


def test_outcomes_are_read_across_replicas_files_as_they_grow_and_a_partial_line_waits(tmp_path: Path) -> None:
    a = tmp_path / "replica_vidx_IndexConsumer_a.log"
    a.write_text(line("v-old", "indexed") + "\n")
    watch = JobLogWatch(tmp_path).skip_existing()
    (tmp_path / "replica_vidx_Api_x.log").write_text(line("v-api", "indexed") + "\n")  # not an index replica
    with a.open("a") as f:
        f.write(json.dumps({"message": "job start", "video_id": "v1"}) + "\n")  # no outcome
        f.write(line("v1", "indexed") + "\n" + line("v2", "indexed")[:20])  # v2's line is half written
    watch.poll()
    assert watch.outcomes == {"v1": "indexed"}
    with a.open("a") as f:
        f.write(line("v2", "indexed")[20:] + "\n")
    (tmp_path / "replica_vidx_IndexConsumer_b.log").write_text(line("v3", "unchanged") + "\n")  # a later replica
    watch.wait(["v1", "v2", "v3"], timeout_s=1)
    assert watch.outcomes == {"v1": "indexed", "v2": "indexed", "v3": "unchanged"}


def test_a_failed_video_ends_the_wait_with_its_reason_and_a_missing_one_times_out(tmp_path: Path) -> None:
    (tmp_path / "replica_vidx_IndexConsumer_a.log").write_text(
        line("v1", "error") + "\n" + line("v2", "failed", message="job index -> failed: not a video") + "\n"
    )
    watch = JobLogWatch(tmp_path)
    with pytest.raises(RuntimeError, match="v2 failed: job index -> failed: not a video"):
        watch.wait(["v1", "v2"], timeout_s=1)
    with pytest.raises(TimeoutError, match="1 of 1 videos not indexed"):
        watch.wait(["v1"], timeout_s=0.1, poll_s=0.02)  # a transient error is retried: not done yet
