"""The figures of ``python -m bench.ha`` (bench/ha.py): completions per second over a window, how long
after a fault they ran at half the pre-fault rate again, and what its watch records."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from bench.ha import FAULT_AT, Faults, rate, recovery, slow_ops
from infra.harness.ha_nodes import FaultRecord


def completions(per_second: list[int]) -> list[float]:
    """``per_second[i]`` completions during second i (at i + 0.5 s)."""
    return [i + 0.5 for i, n in enumerate(per_second) for _ in range(n)]


def test_rate_is_completions_per_second_inside_the_window() -> None:
    c = completions([2] * 10 + [0] * 10)
    assert rate(c, 0, 10) == pytest.approx(2.0)
    assert rate(c, 10, 20) == 0.0
    assert rate(c, 5, 15) == pytest.approx(1.0)
    assert rate(c, 30, 40) == 0.0
    assert rate(c, 5, 5) == 0.0  # an empty span has no rate


def test_recovery_is_when_completions_run_at_half_the_rate_before_the_fault_again() -> None:
    # 2/s for 40 s, nothing for 20 s after the fault at t=40, then 2/s again.
    c = completions([2] * 40 + [0] * 20 + [2] * 30)
    # At t=65 the last 10 s hold 5 s at 2/s: 1/s, half the rate before — 25 s after the fault.
    assert recovery(c, FaultRecord("minio_kill", "minio-1", at_s=40.0)) == 25.0
    assert recovery(completions([2] * 40 + [0] * 50), FaultRecord("x", "y", at_s=40.0)) is None
    assert recovery(completions([0] * 90), FaultRecord("x", "y", at_s=40.0)) == 0.0  # idle before: nothing to recover


def test_slow_operations_are_listed_up_to_a_few_and_counted_beyond() -> None:
    assert slow_ops([]) == []
    lines = slow_ops([f"op {i}" for i in range(11)], shown=8)
    assert lines[0] == "slow: op 0" and len(lines) == 9 and lines[-1] == "... and 3 more slow operations"


def test_the_schedule_fires_each_kind_once_in_a_seeded_order() -> None:
    def order(seed: int) -> list[str]:
        faults = Faults(host=None, ha=None, ray=None, started=0.0, rng=random.Random(seed))  # type: ignore[arg-type]
        return [f.name for f in faults.schedule(1000)]

    kinds = {"kill_rabbit_leader", "kill_minio", "kill_ray_worker", "partition_rabbit"}
    assert set(order(0)) == kinds and len(order(0)) == 4
    assert order(0) == order(0)
    assert len({tuple(order(seed)) for seed in range(10)}) > 1
    faults = Faults(host=None, ha=None, ray=None, started=0.0, rng=random.Random(0))  # type: ignore[arg-type]
    assert [f.at_op for f in faults.schedule(1000)] == [int(1000 * at) for at in FAULT_AT]


def test_the_watch_samples_once_a_second_until_stopped_and_records_what_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    from infra.harness.ha_nodes import Watch

    class StubTables:
        def __init__(self, settings: Any) -> None:
            pass

    monkeypatch.setattr("infra.harness.faults.Tables", StubTables)
    calls: list[int] = []

    def sample(self: Watch, tables: Any) -> dict[str, Any]:
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError("a node is away")
        return {"t_s": float(len(calls)), "completed": len(calls)}

    monkeypatch.setattr(Watch, "sample", sample)
    host = type("Host", (), {"settings": None})()
    watch = Watch(host=host, ha=None, ray_nodes=None, limit_s=30)  # type: ignore[arg-type]
    watch.start()
    deadline = time.monotonic() + 10
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    watch.stop.set()
    watch.join(5)
    assert not watch.is_alive()
    assert len(watch.samples) == len(calls) - 1 >= 2
    assert watch.errors and "ConnectionError: a node is away" in watch.errors[0]


def test_the_watch_counts_each_final_state_write_once_and_leaves_gaps_for_probes_that_do_not_answer() -> None:
    import socket
    from datetime import UTC, datetime
    from types import SimpleNamespace

    from infra.harness.ha_nodes import Watch

    with socket.socket() as closed:  # a port nothing listens on: the management API is away
        closed.bind(("127.0.0.1", 0))
        management_url = f"http://127.0.0.1:{closed.getsockname()[1]}"

    class Rabbit:
        def running_nodes(self, timeout_s: float) -> None:
            return None  # a node cut off: the management API does not answer in time

    class RayAway:
        def alive_ids(self) -> set[str]:
            raise ConnectionError("the GCS does not answer")

    settings = SimpleNamespace(serve=SimpleNamespace(index_queue="i"), amqp=SimpleNamespace(events_queue="e"))
    host = SimpleNamespace(settings=settings, services=SimpleNamespace(management_url=management_url))
    watch = Watch(host=host, ha=SimpleNamespace(minio=None, rabbit=Rabbit()), ray_nodes=RayAway(), limit_s=30)  # type: ignore[arg-type]
    at = datetime.fromtimestamp(watch.started + 12.5, UTC)
    rows = {
        "a": {"status": "indexed", "version": "v1", "rev": 3, "updated_at": at},
        "b": {"status": "indexing", "version": "v1", "rev": 1, "updated_at": at},
    }
    tables = SimpleNamespace(videos=lambda: rows)
    sample = watch.sample(tables)
    assert watch.completions == [12.5]
    watch.sample(tables)  # the same write seen again: counted once
    assert watch.completions == [12.5]
    # Overwritten, then overwritten back to the same content and indexed again: a new write, counted.
    rows["a"] = {
        "status": "indexed",
        "version": "v1",
        "rev": 7,
        "updated_at": datetime.fromtimestamp(watch.started + 20, UTC),
    }
    watch.sample(tables)
    assert watch.completions == [12.5, 20.0]
    assert sample["completed"] == 1
    assert sample["backlog"] is None and sample["events_backlog"] is None
    assert sample["rabbit_nodes"] is None and sample["ray_nodes"] is None
