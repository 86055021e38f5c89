"""storage/leases.py over a local LanceDB: a lease has one holder until it lapses, the holder renews
it, and of workers racing for a free or lapsed lease exactly one gets it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from storage.config import S3Settings
from storage.tables import IndexStore

TTL_S = 60.0
RACERS = 8
RACE_ROUNDS = 10
#: Longest a racer waits for the others at the barrier, and for a racer to finish.
RACE_WAIT_S = 30.0


@pytest.fixture
def db_dir(tmp_path: Path) -> Path:
    return tmp_path / "lance"


@pytest.fixture
def store(db_dir: Path) -> IndexStore:
    return IndexStore(S3Settings(), uri=str(db_dir))


def test_a_lease_has_one_holder_until_it_lapses(store: IndexStore) -> None:
    assert store.leases.acquire("job", "a", TTL_S, now_s=1000.0)
    assert not store.leases.acquire("job", "b", TTL_S, now_s=1000.0 + TTL_S - 1)
    assert store.leases.acquire("job", "b", TTL_S, now_s=1000.0 + TTL_S + 1)  # a stopped renewing
    assert not store.leases.acquire("job", "a", TTL_S, now_s=1000.0 + TTL_S + 2)


def test_the_holder_renews_its_lease(store: IndexStore) -> None:
    assert store.leases.acquire("job", "a", TTL_S, now_s=1000.0)
    assert store.leases.acquire("job", "a", TTL_S, now_s=1000.0 + TTL_S / 2)
    # Past the first term but within the renewed one: still a's.
    assert not store.leases.acquire("job", "b", TTL_S, now_s=1000.0 + TTL_S + 1)


def test_leases_of_different_names_are_independent(store: IndexStore) -> None:
    assert store.leases.acquire("maintenance", "a", TTL_S, now_s=1000.0)
    assert store.leases.acquire("check", "b", TTL_S, now_s=1000.0)
    assert not store.leases.acquire("check", "a", TTL_S, now_s=1001.0)


def test_quotes_in_holder_names_are_literal(store: IndexStore) -> None:
    assert store.leases.acquire("job", "o'k", TTL_S, now_s=1000.0)
    assert store.leases.acquire("job", "o'k", TTL_S, now_s=1001.0)
    assert not store.leases.acquire("job", "o", TTL_S, now_s=1002.0)


@pytest.mark.parametrize("lapsed", [False, True], ids=["free", "lapsed"])
def test_racing_workers_exactly_one_takes_the_lease(db_dir: Path, lapsed: bool) -> None:
    """RACERS threads, each with its own connection, released together, all ask for one lease."""
    seed = IndexStore(S3Settings(), uri=str(db_dir))
    racers = [IndexStore(S3Settings(), uri=str(db_dir)) for _ in range(RACERS)]
    now_s = 1000.0
    # The table exists before the race: the race is for the lease.
    assert seed.leases.acquire("warm-up", "seed", TTL_S, now_s)
    for round_ in range(RACE_ROUNDS):
        name = f"lease-{round_}"
        if lapsed:
            assert seed.leases.acquire(name, "dead", TTL_S, now_s - 2 * TTL_S)
        barrier = threading.Barrier(RACERS)
        results: list[bool | BaseException | None] = [None] * RACERS

        def race(i: int, name: str, barrier: threading.Barrier, results: list[bool | BaseException | None]) -> None:
            try:
                barrier.wait(RACE_WAIT_S)
                results[i] = racers[i].leases.acquire(name, f"racer-{i}", TTL_S, now_s)
            except BaseException as exc:
                results[i] = exc

        threads = [threading.Thread(target=race, args=(i, name, barrier, results)) for i in range(RACERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(RACE_WAIT_S * 2)
        assert not any(t.is_alive() for t in threads)
        assert all(isinstance(r, bool) for r in results), results
        winners = [i for i, r in enumerate(results) if r is True]
        assert len(winners) == 1, f"round {round_}: {winners} all took the lease"
        # The winner holds it: it renews, everyone else (the dead holder included) is refused.
        (i,) = winners
        assert seed.leases.acquire(name, f"racer-{i}", TTL_S, now_s + 1)
        assert not seed.leases.acquire(name, f"racer-{(i + 1) % RACERS}", TTL_S, now_s + 1)
        assert not seed.leases.acquire(name, "dead", TTL_S, now_s + 1)
