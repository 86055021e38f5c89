"""The nemesis's schedules (infra/harness/nemesis.py) are pure functions of their seeds, so a failing
one replays; any six consecutive seeds fire every fault kind; parameters stay in their stated ranges."""

from __future__ import annotations

from collections import Counter

from infra.harness.nemesis import KINDS, PAUSE_TARGETS, PROXY_PORTS, schedule


def test_a_schedule_is_a_function_of_its_seed() -> None:
    assert [schedule(seed) for seed in range(50)] == [schedule(seed) for seed in range(50)]
    assert schedule(1) != schedule(2)


def test_twenty_consecutive_seeds_fire_every_kind_at_least_twice() -> None:
    for first in (0, 7, 1000):
        fired = Counter(f.kind for seed in range(first, first + 20) for f in schedule(seed))
        assert set(fired) == set(KINDS)
        assert min(fired.values()) >= 2, fired


def test_fault_parameters_stay_in_their_ranges() -> None:
    for seed in range(300):
        for fault in schedule(seed):
            attrs = dict(fault.attributes)
            if fault.kind in ("latency", "bandwidth", "stall", "reset"):
                assert fault.target in PROXY_PORTS
            if fault.kind == "latency":
                assert 100 <= attrs["latency"] <= 5000 and 0 < attrs["jitter"] <= attrs["latency"] // 2
            if fault.kind == "pause":
                assert fault.target in PAUSE_TARGETS and 1.0 <= fault.hold_s <= 5.0
            if fault.kind == "kill":
                assert fault.target == "CatalogWriter"
