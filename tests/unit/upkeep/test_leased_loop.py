"""pipeline/upkeep/leased_loop.py over a local LanceDB: a round runs only while this worker holds the lease
(on demand and on two loops' threads at once), a failing tick is reported and the loop goes on, and
the loop stops when asked, in the middle of a long wait."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.upkeep.leased_loop import LeasedLoop
from storage.config import S3Settings
from storage.tables import IndexStore

#: Longest a thread or a number of ticks is waited for.
WAIT_S = 10.0
TTL_S = 60.0


@pytest.fixture
def store(tmp_path: Path) -> IndexStore:
    return IndexStore(S3Settings(), uri=str(tmp_path / "lance"))


def leased(
    store: IndexStore,
    holder: str,
    clock: Callable[[], float] = time.time,
    every_s: float = 0.01,
    first_tick_now: bool = False,
) -> LeasedLoop:
    return LeasedLoop(
        "test-service",
        store.leases,
        "job",
        every_s=every_s,
        ttl_s=TTL_S,
        first_tick_now=first_tick_now,
        holder=holder,
        clock=clock,
    )


def wait_until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, "waited too long"
        time.sleep(0.005)


def test_a_round_runs_only_while_this_worker_holds_the_lease(store: IndexStore) -> None:
    now = [1000.0]
    a, b = leased(store, "a", lambda: now[0]), leased(store, "b", lambda: now[0])
    ran: list[str] = []

    def round_of(name: str) -> Callable[[], str]:
        def work() -> str:
            ran.append(name)
            return name

        return work

    assert a.once(round_of("a")) == "a" and a.leader
    assert b.once(round_of("b")) is None and not b.leader
    now[0] += TTL_S / 2
    assert a.once(round_of("a")) == "a"  # the holder renews
    assert b.once(round_of("b")) is None
    now[0] += TTL_S + 1  # a stopped renewing: the lease lapsed
    assert b.once(round_of("b")) == "b" and b.leader
    assert a.once(round_of("a")) is None and not a.leader
    assert ran == ["a", "a", "b"]


def test_of_two_loops_running_at_once_only_the_holder_runs_rounds(store: IndexStore, tmp_path: Path) -> None:
    assert store.leases.acquire("warm-up", "seed", TTL_S, time.time())  # the table exists before the race
    other = IndexStore(S3Settings(), uri=str(tmp_path / "lance"))  # a second worker: its own connection
    loops = [leased(store, "a"), leased(other, "b")]
    ran: list[str] = []

    def tick_of(loop: LeasedLoop) -> Callable[[], object]:
        return lambda: loop.once(lambda: ran.append(loop.holder))

    started = [loop.start(tick_of(loop)) for loop in loops]
    try:
        wait_until(lambda: len(ran) >= 5)
    finally:
        for thread, stop in started:
            stop.set()
            thread.join(WAIT_S)
    assert len(set(ran)) == 1
    assert [loop.leader for loop in loops].count(True) == 1
    assert not any(thread.is_alive() for thread, _ in started)


def test_a_failing_tick_is_reported_and_the_loop_goes_on(store: IndexStore) -> None:
    ticks: list[int] = []
    errors: list[str] = []

    def tick() -> None:
        ticks.append(1)
        if len(ticks) <= 2:
            raise OSError("store unreachable")

    thread, stop = leased(store, "a").start(tick, errors.append)
    try:
        wait_until(lambda: len(ticks) >= 4)
    finally:
        stop.set()
        thread.join(WAIT_S)
    assert not thread.is_alive()
    assert errors == ["OSError: store unreachable"] * 2


@pytest.mark.parametrize("first_tick_now", [False, True], ids=["after-one-interval", "at-start"])
def test_the_loop_stops_when_asked_in_the_middle_of_its_wait(store: IndexStore, first_tick_now: bool) -> None:
    ticks: list[int] = []
    loop = leased(store, "a", every_s=3600.0, first_tick_now=first_tick_now)
    thread, stop = loop.start(lambda: ticks.append(1))
    assert thread.name == "test-service" and thread.daemon
    if first_tick_now:
        wait_until(lambda: len(ticks) == 1)
    stop.set()
    thread.join(WAIT_S)  # well within one interval
    assert not thread.is_alive()
    assert len(ticks) == int(first_tick_now)  # a later tick would have come an hour on
