"""The concurrency checker in CI: 200 seeded schedules (1000 in ``python -m bench.interleavings``) of
racing real jobs on LanceDB-on-MinIO (tests/concurrency.py), and the delete-vs-reindex interleaving of
issue 8 as a deterministic test."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from events.jobs import IndexJob, JobOp, JobSource
from infra.dev.samples import write_video
from infra.harness.services import Services, unique_prefix
from pipeline.index.indexer import Indexer, Outcome
from pipeline.settings import Settings
from pipeline.upkeep.maintenance import optimize
from storage.catalog import VideoStatus
from storage.ids import video_id
from tests.concurrency import ColourEmbedder, World, run_schedule, sample_videos, world
from tests.harness import report_lines

pytestmark = pytest.mark.integration

#: Schedules per CI run (VIDX_INTERLEAVINGS overrides; ``python -m bench.interleavings`` runs 1000), and
#: the bound on the whole run.
SCHEDULES = int(os.environ.get("VIDX_INTERLEAVINGS", "200"))
FIRST_SEED = int(os.environ.get("VIDX_INTERLEAVINGS_SEED", "1"))
RUN_BOUND_S = float(os.environ.get("VIDX_INTERLEAVINGS_BOUND_S", "1800"))
#: Schedules run over one set of tables; the next ones start on fresh tables (a new prefix). A schedule's
#: cost grows with the rows every earlier one left (a frames commit joins against the whole table, and a
#: compaction rewrites it), so one set of tables for all of them made the run's cost grow with its square.
SCHEDULES_PER_WORLD = 20
#: Schedules between compactions of a set of tables (reads and commits slow down as fragments and
#: versions pile up); the schedules between two compactions start on another schedule's fragments.
COMPACT_EVERY = 5
KEYS = 2


#: Blocks of schedules run side by side, each on a world of its own: a schedule keeps about one of the two
#: cores busy (its jobs' threads, MinIO), so two at once take the run's time down by about a third.
PARALLEL_WORLDS = int(os.environ.get("VIDX_INTERLEAVINGS_PARALLEL", "2"))
_ENV = threading.Lock()


def world_settings(services: Services, prefix: str) -> Settings:
    """Settings for ``prefix``'s buckets and queues (read from the environment, set only while read)."""
    with _ENV:
        mp = pytest.MonkeyPatch()
        try:
            for name, value in services.env(prefix).items():
                mp.setenv(name, value)
            return Settings()
        finally:
            mp.undo()


@contextmanager
def fresh_world(services: Services, videos: dict[str, Path]) -> Iterator[World]:
    """A ``World`` over tables and a bucket of its own (a new prefix)."""
    prefix = unique_prefix()
    services.prepare_buckets(prefix)
    with world(world_settings(services, prefix), services.minio_client(), videos) as w:
        yield w


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return sample_videos(tmp_path_factory.mktemp("interleavings"), write_video)


@pytest.fixture(scope="module")
def shared(services: Services, videos: dict[str, Path]) -> Iterator[World]:
    with fresh_world(services, videos) as w:
        yield w


@dataclass
class _Tally:
    jobs: int = 0
    repaired: int = 0
    failures: list[str] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)


def _run_block(services: Services, videos: dict[str, Path], block: range, started: float, tally: _Tally) -> None:
    """``block``'s schedules in turn on a world of their own (compacted every ``COMPACT_EVERY``)."""
    with fresh_world(services, videos) as w:
        for n, seed in enumerate(block):
            if n % COMPACT_EVERY == COMPACT_EVERY - 1:
                optimize(w.stores[0], keep_versions_s=1.0)  # between schedules: no job of this world runs
            outcome = run_schedule(w, seed, keys=KEYS)
            tally.jobs += outcome.jobs
            tally.repaired += outcome.repaired
            if outcome.violations:
                tally.failures.append(
                    f"seed {seed} (replay: python -m tests.concurrency --seed {seed}): " + "; ".join(outcome.violations)
                )
            took_s = time.monotonic() - started
            assert took_s < RUN_BOUND_S, f"schedules up to seed {seed} took over {RUN_BOUND_S}s"
        if w.catalog_writes is not None:
            tally.faults.update(w.catalog_writes.counts)


@pytest.mark.timeout(RUN_BOUND_S + 60)
def test_seeded_interleavings_leave_no_violation(
    services: Services, videos: dict[str, Path], pytestconfig: pytest.Config
) -> None:
    started = time.monotonic()
    seeds = range(FIRST_SEED, FIRST_SEED + SCHEDULES)
    blocks = [seeds[i : i + SCHEDULES_PER_WORLD] for i in range(0, len(seeds), SCHEDULES_PER_WORLD)]
    tallies = [_Tally() for _ in blocks]
    with ThreadPoolExecutor(PARALLEL_WORLDS, thread_name_prefix="world") as pool:
        runs = [pool.submit(_run_block, services, videos, b, started, t) for b, t in zip(blocks, tallies, strict=True)]
        for run in runs:
            run.result()  # a block's error (its bound, a failed setup) fails the test
    failures = sorted((f for t in tallies for f in t.failures), key=lambda f: int(f.split()[1]))
    jobs, repaired = sum(t.jobs for t in tallies), sum(t.repaired for t in tallies)
    faults = sum((t.faults for t in tallies), Counter[str]())
    took = time.monotonic() - started
    report_lines(
        pytestconfig,
        [
            f"interleavings: {SCHEDULES} schedules, {KEYS} keys, {len(failures)} violations "
            f"({jobs} jobs, {repaired} schedules healed by a repair pass after a dead letter or a late write, "
            f"in {took:.1f}s, {PARALLEL_WORLDS} worlds at once, "
            f"seeds {FIRST_SEED}..{FIRST_SEED + SCHEDULES - 1}; faults inside catalog writes: {dict(faults)})"
        ],
    )
    assert not failures, "\n".join(failures)


def test_delete_racing_a_reindex_of_the_same_bytes_converges(shared: World, pytestconfig: pytest.Config) -> None:
    """Issue 8's interleaving, step by step with real threads: index job I commits its frames; delete
    job D removes them and writes ``deleted``; the same bytes are uploaded again; I settles; D looks
    once more; the re-upload's own job R runs last. The index must hold the video with its rows."""
    w = shared
    key = f"{unique_prefix()}/race.mp4"
    vid = video_id(w.bucket, key)
    body = w.videos["a"]
    gates = {name: threading.Event() for name in ("i_written", "i_go", "d_settled", "d_go")}

    def put() -> None:
        import io

        w.minio.put_object(w.bucket, key, io.BytesIO(body), len(body))  # type: ignore[attr-defined]

    def indexer(hooks: object) -> Indexer:
        return Indexer(w.settings, ColourEmbedder(), w.stores[0], w.objects, hooks=hooks)  # type: ignore[arg-type]

    i_rounds: list[str] = []

    def i_hooks(step: str, _job: IndexJob) -> None:
        i_rounds.append(step)
        if step == "written" and not gates["i_written"].is_set():
            gates["i_written"].set()
            assert gates["i_go"].wait(30)

    def d_hooks(step: str, _job: IndexJob) -> None:
        if step == "settled" and not gates["d_settled"].is_set():
            gates["d_settled"].set()
            assert gates["d_go"].wait(30)

    results: dict[str, object] = {}

    def run(name: str, ix: Indexer, op: JobOp) -> None:
        try:
            results[name] = ix.run(IndexJob(op=op, bucket=w.bucket, key=key, source=JobSource.EVENT), name)
        except Exception as exc:  # reported below
            results[name] = exc

    put()
    i = threading.Thread(target=run, args=("I", indexer(i_hooks), JobOp.INDEX))
    i.start()
    assert gates["i_written"].wait(30), "I never committed its frames"
    w.minio.remove_object(w.bucket, key)  # type: ignore[attr-defined]
    d = threading.Thread(target=run, args=("D", indexer(d_hooks), JobOp.DELETE))
    d.start()
    assert gates["d_settled"].wait(30), "D never wrote deleted"
    put()  # the same bytes again
    gates["i_go"].set()  # I settles after D removed its rows, the object there again
    i.join(30)
    gates["d_go"].set()  # D looks once more
    d.join(30)
    # Before the re-upload's own job: I and D alone must already have left the video right.
    before = w.stores[0].catalog.get(vid)
    assert before is not None and before.status is VideoStatus.INDEXED, before
    assert w.stores[0].frames.count(vid) == before.frames == w.frames_of["a"]
    run("R", indexer(lambda step, job: None), JobOp.INDEX)  # the re-upload's own event
    assert not i.is_alive() and not d.is_alive()
    record = w.stores[0].catalog.get(vid)
    rows = w.stores[0].frames.count(vid)
    outcomes = ", ".join(f"{n} {getattr(r, 'outcome', r)}" for n, r in results.items())
    said = f"{record.status.value} {record.frames} frames" if record else "no row"
    report_lines(pytestconfig, [f"delete-vs-reindex: {outcomes}; catalog {said}, table {rows} rows"])
    assert all(not isinstance(r, Exception) for r in results.values()), results
    assert record is not None and record.status is VideoStatus.INDEXED
    assert rows == record.frames == w.frames_of["a"]
    assert getattr(results["R"], "outcome", None) in (Outcome.UNCHANGED, Outcome.INDEXED)
