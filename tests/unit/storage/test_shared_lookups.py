"""``SharedLookups``: lookups that arrive while a query runs share the next query, and never take the
answer of a query that began before they arrived; the catalog's row reads go through it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from storage.catalog import VideoRecord, VideoStatus
from storage.db import SharedLookups
from storage.errors import TransientError
from storage.tables import IndexStore


class GatedFetch:
    """Stands in for a table query: records each call's keys and answers ``<key>@<call number>``; the
    first call holds until ``release`` is set."""

    def __init__(self, fail_call: int | None = None) -> None:
        self.calls: list[list[str]] = []
        self.first_running = threading.Event()
        self.release = threading.Event()
        self.fail_call = fail_call
        self._lock = threading.Lock()

    def __call__(self, keys: list[str]) -> Mapping[str, str]:
        with self._lock:
            self.calls.append(list(keys))
            number = len(self.calls)
        if number == 1:
            self.first_running.set()
            assert self.release.wait(10)
        if number == self.fail_call:
            raise TransientError("index table read failed: connection reset by peer")  # as get_many raises
        return {k: f"{k}@{number}" for k in keys if not k.startswith("missing")}


def _lookups_at_once(
    lookups: SharedLookups[str, str], keys: list[str]
) -> tuple[list[threading.Thread], dict[str, object]]:
    got: dict[str, object] = {}

    def look(key: str) -> None:
        try:
            got[key] = lookups.get(key)
        except (TransientError, ValueError) as exc:
            got[key] = exc

    threads = [threading.Thread(target=look, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    return threads, got


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)


def _wait_until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_lookups_arriving_while_a_query_runs_share_the_next_one_and_never_take_the_running_ones() -> None:
    fetch = GatedFetch()
    lookups: SharedLookups[str, str] = SharedLookups(fetch)
    first, got_first = _lookups_at_once(lookups, ["a"])
    assert fetch.first_running.wait(5)
    # These arrive while "a"'s query runs: they wait for a query of their own, even "a" again.
    later, got = _lookups_at_once(lookups, ["b", "c", "d", "a", "missing-e"])
    _wait_until(lambda: lookups._pending is not None and len(lookups._pending.keys) == 5)
    fetch.release.set()
    _join(first + later)
    assert fetch.calls == [["a"], ["a", "b", "c", "d", "missing-e"]]
    assert got_first == {"a": "a@1"}
    assert got == {"a": "a@2", "b": "b@2", "c": "c@2", "d": "d@2", "missing-e": None}


def test_a_failed_query_fails_every_lookup_that_joined_it_and_the_next_wave_runs_anew() -> None:
    fetch = GatedFetch(fail_call=2)
    lookups: SharedLookups[str, str] = SharedLookups(fetch)
    first, _ = _lookups_at_once(lookups, ["a"])
    assert fetch.first_running.wait(5)
    joined, got = _lookups_at_once(lookups, ["b", "c"])
    _wait_until(lambda: lookups._pending is not None and len(lookups._pending.keys) == 2)
    fetch.release.set()
    _join(first + joined)
    assert all(isinstance(v, TransientError) and "connection reset" in str(v) for v in got.values()), got
    assert lookups.get("b") == "b@3"  # nothing stuck: the next lookup runs a query of its own


def test_a_lookup_waits_no_longer_than_its_bound_for_a_stuck_query() -> None:
    fetch = GatedFetch()
    lookups: SharedLookups[str, str] = SharedLookups(fetch, wait_s=0.3)
    first, _ = _lookups_at_once(lookups, ["a"])
    assert fetch.first_running.wait(5)
    started = time.monotonic()
    with pytest.raises(TransientError, match=r"within 0\.3s"):
        lookups.get("b")
    assert time.monotonic() - started < 5
    fetch.release.set()
    _join(first)


def test_concurrent_catalog_reads_share_queries_and_see_a_commit_made_through_another_handle(tmp_path: Path) -> None:
    from storage.config import S3Settings

    writer, reader = IndexStore(S3Settings(), str(tmp_path)), IndexStore(S3Settings(), str(tmp_path))
    assert reader.catalog.get("v1") is None  # the reader's handle is open from here on
    for i in range(8):
        writer.catalog.write(VideoRecord(video_id=f"v{i}", uri=f"s3://b/k{i}", status=VideoStatus.QUEUED), 0)
    queries: list[int] = []
    get_many = reader.catalog.get_many

    def counted(ids: list[str]) -> dict[str, VideoRecord]:
        queries.append(len(ids))
        return get_many(ids)

    reader.catalog._lookups._fetch = counted  # type: ignore[assignment]
    got: dict[int, VideoRecord | None] = {}
    gate = threading.Barrier(8)

    def read(i: int) -> None:
        gate.wait(5)
        got[i] = reader.catalog.get(f"v{i}")

    threads = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    _join(threads)
    assert all((r := got[i]) is not None and r.video_id == f"v{i}" and r.status is VideoStatus.QUEUED for i in range(8))
    assert sum(queries) == 8 and len(queries) < 8, queries  # eight reads, fewer queries


def test_an_error_that_is_not_the_stores_fails_only_the_lookup_it_belongs_to() -> None:
    calls: list[list[str]] = []
    first = threading.Event()

    def fetch(keys: list[str]) -> Mapping[str, str]:
        calls.append(list(keys))
        if not first.is_set():  # the opener's query holds while a, b and c join the next wave
            first.set()
            time.sleep(0.3)
        if "b" in keys:
            raise ValueError("row b: invalid status 'bogus'")
        return {k: f"{k}-row" for k in keys}

    lookups: SharedLookups[str, str] = SharedLookups(fetch)
    opener, got_first = _lookups_at_once(lookups, ["z"])
    assert first.wait(5)
    threads, got = _lookups_at_once(lookups, ["a", "b", "c"])
    _join(opener + threads)
    assert got_first == {"z": "z-row"} and (got["a"], got["c"]) == ("a-row", "c-row")
    assert isinstance(got["b"], ValueError)
    # One shared query met b's row; then each of the three asked on its own.
    assert calls[1] == ["a", "b", "c"] and sorted(calls[2:]) == [["a"], ["b"], ["c"]]
