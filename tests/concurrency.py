"""The concurrency checker: real ``Indexer`` jobs (real LanceDB on MinIO, real objects in a MinIO
bucket) on threads over a few keys, with seeded random interleavings of upload, overwrite, delete,
re-upload of identical bytes, redelivery (the same task twice at once), retry after a transient
error and restart after a consumer died mid-job, random pauses at every step boundary of every
job, and faults inside catalog writes (a landed write whose reply is lost, a write that lands after
its caller gave up). Text jobs race too: each index job that settles a video whose words are due starts
one (as its handler submits it), and stray text jobs come at random moments (a redelivered or late one);
their reader is a cheap stand-in whose segments depend on the bytes. After every job has run to
completion (at-least-once: an aborted job is run again), the invariant checker (``pipeline.upkeep.check``,
the text table held like the frames) must find nothing and every key must be indexed exactly at its
current bytes, its words too, or gone. For the keys the product leaves to the scheduled check (a task dead-lettered,
or a write whose caller gave up that landed after every job of the key last read the row, as the row's
last word), the checker's repair pass runs first; any other key must be right without it.

    python -m tests.concurrency --seed 1234      # replay one schedule against the services in VIDX_* env
"""

from __future__ import annotations

import argparse
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from events.jobs import IndexJob, JobOp, JobSource
from pipeline.index.clock import StageClock
from pipeline.index.indexer import STEPS, Indexer
from pipeline.index.objects import ObjectSource, S3ObjectSource
from pipeline.settings import ServeSettings, Settings
from pipeline.upkeep.check import Checker
from pipeline.upkeep.sources import S3PageLister
from pipeline.upkeep.text_backfill import TextBackfill
from storage.catalog import Catalog, VideoRecord, VideoStatus
from storage.commits.catalog import CatalogWrites, GroupedCatalogWriter, PendingWrite
from storage.commits.frames import GroupedFrameWriter
from storage.errors import TransientError
from storage.frames import FRAMES
from storage.ids import fingerprint, segment_id, text_fingerprint, video_id
from storage.models import ModelState, ModelTable
from storage.s3 import ObjectHead
from storage.tables import IndexStore
from storage.texts import TextRow

#: Pauses injected at step boundaries (and between bucket operations): one with probability
#: ``PAUSE_P``, of up to ``MAX_PAUSE_S`` — or, one time in ``1 / LONG_PAUSE_P``, of up to
#: ``LONG_PAUSE_S``, long enough for another job's whole commit to land inside it (short pauses
#: alone almost never open the windows the races need: they let every job see the final state).
MAX_PAUSE_S = 0.03
LONG_PAUSE_S = 0.3
LONG_PAUSE_P = 0.1
PAUSE_P = 0.5
#: Times a job that keeps failing transiently is tried before the schedule counts it as lost.
MAX_TRIES = 6
#: Share of failed attempts whose task is given up (retries spent: dead-lettered) instead of retried;
#: those schedules end with a repair pass of the checker, as the scheduled check would run.
GIVE_UP_P = 0.15
#: Bound on one schedule's wall time (every thread is joined within it).
SCHEDULE_TIMEOUT_S = 120.0
#: Seconds to wait for the outcome of a write whose caller gave up on it before the repair pass looks.
LATE_WRITE_WAIT_S = 30.0
#: Share of operations followed by a stray text job of the key (redelivered, or late for an older version).
STRAY_TEXT_P = 0.3
#: The text table of the schedules (its pipeline named for the stand-in reader).
TEXT = ModelTable.for_text("harness-words")
#: A job's ``serve.claim_after_s``, drawn per job: the eager claim, a claim the pauses often outlast, and
#: the deployed default.
CLAIM_AFTER_S = (0.0, 0.05, ServeSettings.model_fields["claim_after_s"].default)
#: The catalog writer's commit interval here: short, so schedules stay quick yet writes of racing jobs share commits.
CATALOG_INTERVAL_S = 0.05


class ColourEmbedder:
    """Deterministic stand-in for the encoder: mean colour and its square, normalised."""

    model_id = "test/mean-colour"

    def embed_images(self, images: Sequence[NDArray[np.uint8]]) -> NDArray[np.float32]:
        means = np.stack([img.reshape(-1, 3).mean(axis=0) for img in images]).astype(np.float32) + 1.0
        vectors = np.concatenate([means, means**2 / 255.0], axis=1)
        return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


class StandInWords:
    """A text job's reader: the object's words as segments that depend on its bytes (video "a" has one,
    "b" two), at no cost."""

    def __init__(self, segments_of: dict[str, int]) -> None:
        self._segments_of = segments_of

    def rows(self, head: ObjectHead, video_id_: str, clock: StageClock) -> list[TextRow]:
        n = self._segments_of[head.version]
        return [
            TextRow(segment_id(video_id_, i), float(i), i + 1.0, f"words {i} of {head.version}", "subtitle", 1.0)
            for i in range(n)
        ]


class Abort(Exception):
    """Injected at a step boundary: the job's consumer dies (or its attempt fails) right there."""


#: Share of catalog writes that fail mid-write rather than at a step boundary (``FaultyWrites``).
WRITE_FAULT_P = 0.08


class FaultyWrites:
    """The catalog writer as the jobs see it, with seeded faults inside a write rather than between
    steps: a write that lands but whose reply is lost (the caller gets a transient error for a landed
    write), and a write whose caller gives up at once while it lands a moment later (its outcome in
    doubt when the caller reads back; or it loses its compare-and-set). ``reseed`` at each schedule's
    start: the draws replay, which writes they hit depends on the threads' timing, like the pauses."""

    def __init__(self, inner: CatalogWrites) -> None:
        self._inner = inner
        self._rng = random.Random(0)
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        # The writes whose caller gave up on them (they land, or lose, later), since ``late_last_words``,
        # each with when its outcome came (appended by the writer's thread).
        self._abandoned: list[tuple[PendingWrite, list[float]]] = []

    def reseed(self, seed: int) -> None:
        with self._lock:
            self._rng = random.Random(seed ^ 0xFA017)
            self._abandoned.clear()

    def late_last_words(self, catalog: Catalog, timeout_s: float) -> dict[str, float]:
        """The videos whose row is, right now, what a write its caller gave up on wrote, each with when
        that write's outcome came (waiting for every such outcome first; one still unknown after
        ``timeout_s`` counts as landing now). Forgets them."""
        with self._lock:
            abandoned, self._abandoned = self._abandoned, []
        found: dict[str, float] = {}
        for pending, came in abandoned:
            try:
                landed = pending.result(timeout_s)
            except TransientError:
                continue  # the commit failed: nothing landed
            if landed is None:
                continue  # lost its compare-and-set: a job's write came first
            now = catalog.get(landed.video_id)
            if now is not None and now.write_id == landed.write_id:
                found[landed.video_id] = max(found.get(landed.video_id, 0.0), came[0] if came else time.monotonic())
        return found

    def submit(self, record: VideoRecord, expected_rev: int) -> PendingWrite:
        pending = self._inner.submit(record, expected_rev)
        with self._lock:
            roll = self._rng.random()
            fault = "reply lost" if roll < WRITE_FAULT_P / 2 else "gave up early" if roll < WRITE_FAULT_P else None
            if fault is not None:
                self.counts[fault] += 1
        if fault == "reply lost":
            return _ReplyLost(pending)
        if fault == "gave up early":
            came: list[float] = []
            future = getattr(pending, "future", None)
            if future is not None:  # the grouped writer's: note when the outcome comes
                future.add_done_callback(lambda _f: came.append(time.monotonic()))
            with self._lock:
                self._abandoned.append((pending, came))
            return _GaveUp()
        return pending


class _ReplyLost:
    def __init__(self, pending: PendingWrite) -> None:
        self._pending = pending

    def result(self, timeout_s: float) -> VideoRecord | None:
        self._pending.result(timeout_s)  # landed (or lost to another writer): either way, no answer
        raise TransientError("catalog write failed: the reply was lost (injected)")


class _GaveUp:
    def result(self, timeout_s: float) -> VideoRecord | None:
        raise TransientError("catalog write failed: no answer in time (injected; the write lands later)")


@dataclass
class World:
    """The services one run of schedules shares: a bucket, an index database, two consumer processes."""

    settings: Settings
    bucket: str
    videos: dict[str, bytes]
    frames_of: dict[str, int]
    minio: object
    stores: list[IndexStore] = field(default_factory=list)
    writers: list[GroupedFrameWriter] = field(default_factory=list)
    objects: ObjectSource | None = None
    #: The cluster's one catalog writer (the CatalogWriter deployment's plain object).
    catalog_writer: GroupedCatalogWriter | None = None
    #: What the jobs write through: ``catalog_writer`` with faults inside writes.
    catalog_writes: FaultyWrites | None = None
    #: The text segments of each version (by ETag): what a text job writes.
    segments_of: dict[str, int] = field(default_factory=dict)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        if self.catalog_writer is not None:
            self.catalog_writer.close()


@contextmanager
def world(settings: Settings, minio: object, videos: dict[str, Path]) -> Iterator[World]:
    """Two "consumer processes" (an index-store connection and a grouped frame writer each) and one
    grouped catalog writer of their own (as the CatalogWriter deployment is) over the settings' index
    database, and the sample videos' bytes and sampled-frame counts."""
    from pipeline.media.decode import sample_frames

    data = {name: path.read_bytes() for name, path in videos.items()}
    frames_of = {
        name: sum(1 for _ in sample_frames(path, settings.sampling.spec, settings.limits, max_side=64))
        for name, path in videos.items()
    }
    import hashlib

    w = World(settings, settings.s3.upload_bucket, data, frames_of, minio)
    w.segments_of = {hashlib.md5(body).hexdigest(): n + 1 for n, body in enumerate(data[name] for name in sorted(data))}
    for _ in range(2):
        store = IndexStore(settings.s3)
        w.stores.append(store)
        w.writers.append(GroupedFrameWriter(store.frames, max_videos=4, wait_s=0.01, commit_timeout_s=30))
    w.objects = S3ObjectSource(settings.s3, settings.limits)
    w.catalog_writer = GroupedCatalogWriter(IndexStore(settings.s3).catalog, min_interval_s=CATALOG_INTERVAL_S)
    w.catalog_writes = FaultyWrites(w.catalog_writer)
    # The lifecycle row the text backfill reads: the jobs' frames table active, the schedules' text table live.
    registry = w.stores[0].models
    if registry.read().text is None:
        registry.write(
            ModelState(active=ModelTable(ColourEmbedder.model_id, 0, FRAMES), text=TEXT), registry.read().rev
        )
    try:
        yield w
    finally:
        w.close()


@dataclass
class Outcome:
    seed: int
    keys: int
    jobs: int
    violations: list[str]
    #: The checker's repair pass ran: some task was given up (dead-lettered), or a write whose caller
    #: gave up on it was the last word on a row.
    repaired: bool = False


def run_schedule(w: World, seed: int, *, keys: int = 2, ops: int = 5) -> Outcome:
    """One seeded schedule over ``keys`` fresh keys; returns what the checker found (nothing is right)."""
    import io

    rng = random.Random(seed)
    text_rng = random.Random(f"text-{seed}")
    if w.catalog_writes is not None:
        w.catalog_writes.reseed(seed)
    prefix = f"sched-{seed}-{uuid.uuid4().hex[:6]}/"
    names = [f"{prefix}k{i}.mp4" for i in range(keys)]
    dead: set[str] = set()
    lock = threading.Lock()
    threads: list[threading.Thread] = []
    retries: list[tuple[IndexJob, str, str | None]] = []
    lost: list[str] = []
    given_up: list[IndexJob] = []
    text_jobs: list[IndexJob] = []
    #: When a round of a job last began reading each video's row.
    read_at: dict[str, float] = {}
    jobs = 0
    deadline = time.monotonic() + SCHEDULE_TIMEOUT_S

    def launch_text_jobs() -> None:
        """The text jobs the settled index jobs submitted so far, each once (each may abort at a step)."""
        with lock:
            batch, text_jobs[:] = list(text_jobs), []
        for text in batch:
            abort_at = text_rng.choice(STEPS) if text_rng.random() < 0.3 else None
            launch(text, uuid.uuid4().hex, abort_at, draw=text_rng)

    def _join_all() -> None:
        """Every thread joined, and the text jobs they submitted run too, until none is left (bounded)."""
        for _ in range(MAX_TRIES):
            _join(threads, deadline)
            with lock:
                if not text_jobs:
                    return
            launch_text_jobs()
        _join(threads, deadline)

    def put(key: str, name: str) -> tuple[str, int]:
        """Upload ``name``'s video as ``key``; its ETag and size (what the upload's bucket event reports)."""
        body = w.videos[name]
        written = w.minio.put_object(w.bucket, key, io.BytesIO(body), len(body), content_type="video/mp4")  # type: ignore[attr-defined]
        return str(written.etag).strip('"'), len(body)

    def launch(
        job: IndexJob,
        task_id: str,
        abort_at: str | None,
        holder: str | None = None,
        draw: random.Random = rng,
        *,
        again: bool = False,
    ) -> None:
        """``draw``: where the job's choices come from (the text jobs' own, so that how many of them the
        threads' timing makes does not shift the schedule's main sequence: a seed replays). ``again``: a
        retry or a redelivery of the task (it claims the row at once)."""
        nonlocal jobs
        jobs += 1
        job_rng = random.Random(draw.random())
        n = draw.randrange(len(w.stores))
        holder = holder or f"proc:sched:{uuid.uuid4().hex[:8]}"
        # When the job claims the row: at once (the eager claim), soon, or as deployed (most jobs here
        # finish sooner and settle without one): both paths race in every schedule.
        claim_after_s = job_rng.choice(CLAIM_AFTER_S)
        settings = w.settings.model_copy(
            update={"serve": w.settings.serve.model_copy(update={"claim_after_s": claim_after_s})}
        )

        def hooks(step: str, _job: IndexJob) -> None:
            pause(job_rng)
            if step == abort_at:
                raise Abort(step)
            if step == "read":  # a round reads the row right after this
                with lock:
                    read_at[_job.video_id] = time.monotonic()

        indexer = Indexer(
            settings,
            ColourEmbedder(),
            w.stores[n],
            w.objects,
            writer=w.writers[n],
            catalog_writes=w.catalog_writes,
            holder=holder,
            holder_alive=lambda h: h not in dead,
            hooks=hooks,
            text_table=lambda: TEXT,
            words=StandInWords(w.segments_of),
        )

        def body() -> None:
            try:
                result = indexer.run(job, task_id, redelivered=again)
                if result.text_due:  # its handler submits the text job: it runs as soon as a thread takes it
                    with lock:
                        text_jobs.append(job.model_copy(update={"source": JobSource.TEXT, "op": JobOp.INDEX}))
            except Abort:
                died = job_rng.random() < 0.5  # the consumer died (a restart elsewhere) or the attempt failed
                with lock:
                    if died:
                        dead.add(holder)
                        retries.append((job, task_id, None))
                    elif job_rng.random() < GIVE_UP_P:
                        given_up.append(job)  # its retries are spent: a dead letter, no further run
                    else:
                        retries.append((job, task_id, holder))
            except TransientError as exc:
                with lock:
                    retries.append((job, task_id, holder))
                    lost.append(f"transient on first try: {exc}")  # kept only if the retries fail too

        thread = threading.Thread(target=body, daemon=True)
        threads.append(thread)
        thread.start()

    for _ in range(ops):
        key = rng.choice(names)
        action = rng.choice(["upload_a", "upload_b", "reupload", "delete", "upload_a"])
        etag, size = None, None
        if action == "delete":
            w.minio.remove_object(w.bucket, key)  # type: ignore[attr-defined]
        else:
            etag, size = put(key, "a" if action in ("upload_a", "reupload") else "b")
        op = JobOp.DELETE if action == "delete" else JobOp.INDEX
        # As the event router makes it: an upload's job carries the ETag and size its event reported (a first
        # start's first round fetches on the ETag instead of HEADing; a later upload makes it stale).
        job = IndexJob(op=op, bucket=w.bucket, key=key, source=JobSource.EVENT, hint_etag=etag, hint_size=size)
        task_id = uuid.uuid4().hex
        abort_at = rng.choice(STEPS) if rng.random() < 0.3 else None
        launch(job, task_id, abort_at)
        if rng.random() < 0.3:
            launch(job, task_id, None, again=True)  # redelivered while the first delivery still runs
        if rng.random() < STRAY_TEXT_P:
            stray = IndexJob(op=JobOp.INDEX, bucket=w.bucket, key=key, source=JobSource.TEXT)
            launch(stray, uuid.uuid4().hex, rng.choice(STEPS) if rng.random() < 0.3 else None)
        launch_text_jobs()
        pause(rng)
    _join_all()
    lost.clear()
    # At least once: every attempt that failed or died runs again until it completes (bounded).
    for _ in range(MAX_TRIES):
        if not retries:
            break
        batch, retries[:] = list(retries), []
        threads.clear()
        for job, task_id, holder in batch:
            launch(job, task_id, None, holder, again=True)
        _join_all()
    # The scheduled check's repair pass, as it would run later, where the product leaves a key to it: a
    # task given up (a dead letter), or a write whose caller gave up on it that landed after every job
    # of the key last read the row (no job could know of it) and is the row's last word. Whatever is
    # wrong with any other key before the pass is a violation all the same. The repair's own jobs can
    # leave such a write too: then it runs again (bounded).
    keys_of = {video_id(w.bucket, k): k for k in names}
    excused = {j.key for j in given_up}
    violations: list[str] = []
    repaired = False
    for _ in range(MAX_TRIES):
        late = w.catalog_writes.late_last_words(w.stores[0].catalog, LATE_WRITE_WAIT_S) if w.catalog_writes else {}
        newly = {keys_of[v] for v, came in late.items() if v in keys_of and came > read_at.get(v, float("-inf"))}
        if repaired and not newly:
            break
        if not repaired and not (excused | newly):
            break
        excused |= newly
        # Per key only: a row left in flight is counted by key below, the checker's total is not one key's.
        before = _violations(w, prefix, names)
        violations += [
            f"{msg} (before the repair pass)" for key, msg in before if key is not None and key not in excused
        ]
        repaired = True
        sink = _ListSink()
        repairer = _checker(w, sink)
        repairer.run([w.bucket], prefix=prefix, repair=True)
        repairer.stuck(repair=True)
        # And the text backfill's round, as it would run later: a video whose text job was given up gets
        # another (its index job is not redone when the row and the tables agree).
        words = _ListSink()
        store = w.stores[0]
        TextBackfill(store, words, interval_s=1, max_outstanding=1000, resubmit_after_s=1, lease_ttl_s=10).round()
        sink.jobs += [j for j in words.jobs if j.key.startswith(prefix)]
        for _ in range(MAX_TRIES):
            batch = [(job, uuid.uuid4().hex, None) for job in sink.jobs] + list(retries)
            sink.jobs.clear()
            retries.clear()
            if not batch:
                break
            threads.clear()
            for job, task_id, holder in batch:
                launch(job, task_id, None, holder)
            _join_all()
    violations += [f"a job still failed after {MAX_TRIES} tries: {j.uri}" for j, _, _ in retries]
    violations += [msg for _key, msg in _violations(w, prefix, names)]
    return Outcome(seed, keys, jobs, violations, repaired=repaired)


class _ListSink:
    def __init__(self) -> None:
        self.jobs: list[IndexJob] = []

    def submit(self, job: IndexJob) -> str:
        if not any((j.key, j.source) == (job.key, job.source) for j in self.jobs):
            self.jobs.append(job)
        return "repair"


def _checker(w: World, sink: _ListSink | None) -> Checker:
    settings = w.settings
    store = w.stores[0]
    return Checker(
        model_id=ColourEmbedder.model_id,
        sampling=settings.sampling.spec,
        extensions=settings.videos.extensions,
        catalog=store.catalog,
        frames=store.frames,
        lister=S3PageLister(settings.s3),
        sink=sink,
        in_flight_grace_s=0,
        new_object_grace_s=0,
        models=lambda: [ModelTable(ColourEmbedder.model_id, 0, FRAMES), TEXT],
        frames_for=store.table_for,
    )


def pause(rng: random.Random) -> None:
    """Maybe sleep, as the module's pause constants say."""
    if rng.random() < PAUSE_P:
        time.sleep(rng.uniform(0, LONG_PAUSE_S if rng.random() < LONG_PAUSE_P else MAX_PAUSE_S))


def _join(threads: list[threading.Thread], deadline: float) -> None:
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            raise TimeoutError("a job outlived the schedule's time bound")


def _violations(w: World, prefix: str, names: list[str]) -> list[tuple[str | None, str]]:
    """What is wrong after a schedule, each with its key (None: not one key's)."""
    settings = w.settings
    store = w.stores[0]
    report = _checker(w, None).run([w.bucket], prefix=prefix)
    key_of_uri = {f"s3://{w.bucket}/{k}": k for k in names}
    found: list[tuple[str | None, str]] = [
        (key_of_uri.get(i.uri), f"{i.finding.value} {i.uri}: {i.detail}") for i in report.found
    ]
    if report.in_flight:
        found.append((None, f"{report.in_flight} videos left queued/indexing with no job alive"))
    import hashlib

    by_etag = {hashlib.md5(body).hexdigest(): name for name, body in w.videos.items()}
    for key in names:
        vid = video_id(w.bucket, key)
        record = store.catalog.get(vid)
        head = w.objects.head(w.bucket, key) if w.objects else None
        rows = store.frames.count(vid)
        if head is None:
            if rows or (record is not None and record.status is not VideoStatus.DELETED):
                found.append(
                    (key, f"{key}: gone, but catalog {record.status.value if record else '-'} and {rows} rows")
                )
            continue
        want = fingerprint(head.version, ColourEmbedder.model_id, settings.sampling.spec)
        frames = w.frames_of[by_etag[head.version]]
        if record is None or record.status is not VideoStatus.INDEXED or record.fingerprint != want or rows != frames:
            said = f"{record.status.value} {record.fingerprint}" if record else "no row"
            found.append((key, f"{key}: at {head.version}, catalog {said}, {rows} rows (want indexed, {frames} rows)"))
            continue
        # Its words: read at this version, as many as the bytes have, and the row says so
        words = store.text_table(TEXT.table).summary(vid)
        entry = record.index_in(TEXT.table)
        want_text = text_fingerprint(head.version, TEXT.pipeline or "")
        segments = w.segments_of[head.version]
        if (
            entry is None
            or entry.fingerprint != want_text
            or words.rows != segments
            or set(words.fingerprints) != {want_text}
        ):
            said = f"entry {entry.fingerprint if entry else '-'}, rows {dict(words.fingerprints)}"
            found.append((key, f"{key}: at {head.version}, words {said} (want {segments} of {want_text})"))
    return found


def main() -> None:  # pragma: no cover - a replay tool
    from minio import Minio

    from infra.dev.samples import write_video

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--keys", type=int, default=2)
    parser.add_argument("--ops", type=int, default=5)
    args = parser.parse_args()
    settings = Settings()
    s3 = settings.s3
    host = s3.endpoint_url.removeprefix("http://").removeprefix("https://")
    client = Minio(host, s3.access_key.get_secret_value(), s3.secret_key.get_secret_value(), secure=False)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        videos = sample_videos(Path(tmp), write_video)
        with world(settings, client, videos) as w:
            outcome = run_schedule(w, args.seed, keys=args.keys, ops=args.ops)
    print(f"seed {outcome.seed}: {outcome.jobs} jobs, {len(outcome.violations)} violations")
    for v in outcome.violations:
        print(f"  {v}")


def sample_videos(directory: Path, write_video: object) -> dict[str, Path]:
    """Two small different videos: "a" and "b" (different bytes, different frame counts)."""
    make = write_video  # infra.dev.samples.write_video
    return {
        "a": make(directory / "a.mp4", seconds=2, fps=5, size=(64, 48), seed=1),  # type: ignore[operator]
        "b": make(directory / "b.mp4", seconds=3, fps=5, size=(64, 48), seed=2),  # type: ignore[operator]
    }


if __name__ == "__main__":  # pragma: no cover
    main()
