"""pipeline/upkeep/service.py and pipeline/serve/ingest.py: the Upkeep and EventRouter deployments'
plain objects run the model preflight before anything starts, name each service they start, and
stop them all; pipeline/index/writers.py: one frame writer per table, however many threads ask."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, cast

import pytest

from pipeline.index.writers import FrameWriters
from pipeline.serve.ingest import EventIntake
from pipeline.settings import WriterSettings
from pipeline.upkeep.service import BACKFILL, MAINTENANCE, SCHEDULED_CHECK, UpkeepServices
from storage.errors import ModelConfigError

WAIT_S = 10.0


class FakeService:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log
        self.stop = threading.Event()

    def start(self) -> tuple[threading.Thread, threading.Event]:
        self.log.append(self.name)
        thread = threading.Thread(target=self.stop.wait, name=self.name, daemon=True)
        thread.start()
        return thread, self.stop


#: ``ScheduledCheck``: its ``state`` answers ``as_json``.
FAKE_CHECK = SimpleNamespace(
    state=SimpleNamespace(as_json=lambda: {"rounds": 3, "leader": True, "last": None, "last_error": None})
)


def services(log: list[str], preflight: Any = None) -> tuple[UpkeepServices, list[FakeService]]:
    started = [FakeService(name, log) for name in (MAINTENANCE, BACKFILL, SCHEDULED_CHECK)]
    upkeep = UpkeepServices(
        preflight or (lambda: log.append("preflight")),
        {s.name: s for s in started},
        FAKE_CHECK,  # type: ignore[arg-type]
    )
    return upkeep, started


def test_upkeep_runs_the_preflight_then_starts_each_service_under_its_name_and_stops_them_all() -> None:
    log: list[str] = []
    upkeep, started = services(log)
    upkeep.start()
    assert log == ["preflight", MAINTENANCE, BACKFILL, SCHEDULED_CHECK]
    assert upkeep.running() == {MAINTENANCE: True, BACKFILL: True, SCHEDULED_CHECK: True}
    assert upkeep.check_state()["rounds"] == 3
    upkeep.stop()
    assert all(s.stop.is_set() for s in started)


def test_upkeep_starts_nothing_when_the_preflight_refuses_the_model() -> None:
    log: list[str] = []

    def refuse() -> None:
        raise ModelConfigError("the index answers with another model")

    upkeep, _ = services(log, refuse)
    with pytest.raises(ModelConfigError):
        upkeep.start()
    assert log == [] and upkeep.running() == {}


class FakeRouter:
    connected = True

    def __init__(self) -> None:
        self.stats = {"jobs_index": 2}
        self.ran = threading.Event()

    def run(self, stop: threading.Event) -> None:
        self.ran.set()
        stop.wait(WAIT_S)


def test_the_intake_takes_no_event_before_the_preflight_passed() -> None:
    router = FakeRouter()

    def refuse() -> None:
        raise ModelConfigError("the index answers with another model")

    refused = EventIntake(router, refuse)  # type: ignore[arg-type]
    with pytest.raises(ModelConfigError):
        refused.start()
    assert not router.ran.is_set() and not refused.alive

    intake = EventIntake(router, lambda: None)  # type: ignore[arg-type]
    intake.start()
    assert router.ran.wait(WAIT_S) and intake.alive
    assert intake.stats() == {"jobs_index": 2, "connected": 1}
    intake.stop()


class FakeTables:
    """``IndexStore.table_for``: a store per name that takes grouped replaces."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def table_for(self, name: str) -> Any:
        self.asked.append(name)
        return self

    def replace_many(self, videos: Sequence[Any], timeout: Any = None) -> None:
        return None


def test_threads_asking_at_once_for_a_tables_writer_share_one() -> None:
    tables = FakeTables()
    writers = FrameWriters(tables, WriterSettings())  # type: ignore[arg-type]
    barrier = threading.Barrier(8)
    got: list[Any] = []

    def ask(table: str) -> None:
        barrier.wait(WAIT_S)
        got.append((table, writers(table)))

    threads = [threading.Thread(target=ask, args=("frames_a" if i % 2 else "frames_b",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    by_table: dict[str, set[int]] = {}
    for table, writer in got:
        by_table.setdefault(table, set()).add(id(writer))
    assert {t: len(ids) for t, ids in by_table.items()} == {"frames_a": 1, "frames_b": 1}
    assert sorted(tables.asked) == ["frames_a", "frames_b"]
    for table in ("frames_a", "frames_b"):
        writers(table).close()


def test_each_service_reports_its_last_success_in_the_state_and_the_metrics() -> None:
    """A service's rounds that succeed move its ``last_ok``; the state and the gauge
    ``vidx_service_ok_timestamp_seconds{service=...}`` carry it; a failing service keeps its old one."""
    import time

    from pipeline.metrics import MemoryBackend, Metrics
    from pipeline.upkeep.leased_loop import LeasedLoop
    from storage.leases import Leases

    class Loop:
        def __init__(self, name: str, fail: bool) -> None:
            self.fail = fail
            self.loop = LeasedLoop(name, cast(Leases, None), name, every_s=0.01, ttl_s=1, first_tick_now=True)

        def tick(self) -> None:
            if self.fail:
                raise OSError("store down")

        def start(self) -> tuple[threading.Thread, threading.Event]:
            return self.loop.start(self.tick)

        @property
        def last_ok(self) -> float | None:
            return self.loop.last_ok

    good, bad = Loop("maintenance", fail=False), Loop("backfill", fail=True)
    backend = MemoryBackend()
    services = UpkeepServices(lambda: None, {"maintenance": good, "backfill": bad}, cast(Any, None), Metrics(backend))
    before = time.time()
    services.start()
    try:
        deadline = time.monotonic() + 10
        while good.last_ok is None and time.monotonic() < deadline:
            time.sleep(0.01)
        state = services.services_state()
    finally:
        services.stop()
    assert state["maintenance"]["alive"] and state["maintenance"]["last_ok"] >= before
    assert state["backfill"] == {"alive": True, "last_ok": None}
    exposition = backend.exposition()
    assert 'ray_vidx_service_ok_timestamp_seconds{service="maintenance"}' in exposition
    assert 'service="backfill"' not in exposition
