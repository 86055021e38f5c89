"""The bad-input matrix: odd, broken and oversized objects through real MinIO events, the EventRouter
and the Indexer (tiny SigLIP) into LanceDB on MinIO. Each case must end with its exact status and
reason; nothing crashes or loops; a good video indexes right after the bad ones.

One line per case and a closing ``bad-input matrix: ...`` line are written to the terminal report
(``make test`` runs with ``-q`` and captured output), where lost and duplicated are computed from the
frames table, not assumed.
"""

from __future__ import annotations

import io
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lancedb
import numpy as np
import pytest
from PIL import Image

from events.jobs import IndexJob, JobOp
from events.router import EventRouter
from infra.harness.faults import vidx_check
from infra.harness.services import Services, eventually, unique_prefix
from pipeline.embedding.siglip import SiglipEncoder
from pipeline.index.indexer import Indexer, JobResult, Outcome
from pipeline.index.objects import S3ObjectSource
from pipeline.settings import LimitSettings, Settings
from storage.catalog import VideoStatus
from storage.db import storage_options
from storage.errors import PermanentError, TransientError
from storage.frames import FRAMES
from storage.s3 import ObjectHead
from storage.tables import IndexStore
from tests.harness import WAIT_S, QueueSink, report_lines
from tests.media import (
    MATRIX_FORMATS,
    frame_at,
    mae,
    write_audio_only,
    write_corrupt_mp4,
    write_large_video,
    write_no_streams_mp4,
    write_pixel_bomb,
    write_still_image,
    write_timed_video,
    write_truncated,
    write_video,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

#: Multipart uploads use parts of at least 5 MiB; the video must need two.
PART_BYTES = 5 * 1024 * 1024
VFR_TIMES = [0.0, 0.04, 0.1, 0.5, 0.55, 1.2, 1.25, 1.3, 2.7, 2.9, 3.05]
#: Thumbnails are JPEG: a bit further from the drawn picture than decoded frames.
THUMBNAIL_MAE = 25.0


@dataclass
class Stack:
    settings: Settings
    services: Services
    sink: QueueSink
    store: IndexStore
    encoder: SiglipEncoder

    @property
    def bucket(self) -> str:
        return self.settings.s3.upload_bucket

    def upload(self, key: str, path: Path, part_size: int = 0) -> None:
        self.services.minio_client().fput_object(self.bucket, key, str(path), part_size=part_size)

    def indexer(self, **limits: Any) -> Indexer:
        """An Indexer over the shared store, with ``limits`` overriding the defaults."""
        settings = self.settings.model_copy(update={"limits": LimitSettings(**limits)})
        return Indexer(settings, self.encoder, self.store)

    def frame_rows(self) -> list[dict[str, Any]]:
        db = lancedb.connect(self.settings.s3.index_uri, storage_options=storage_options(self.settings.s3))
        table = db.open_table(FRAMES).to_arrow().select(["frame_id", "video_id", "ts_s", "thumbnail"])
        rows: list[dict[str, Any]] = table.to_pylist()
        return rows


@pytest.fixture(scope="module")
def stack(services: Services, tiny_model_dir: Path) -> Iterator[Stack]:
    prefix = unique_prefix()
    services.prepare_buckets(prefix)
    with pytest.MonkeyPatch.context() as env:
        for key, value in services.env(prefix).items():
            env.setenv(key, value)
        env.setenv("VIDX_MODEL__ID", str(tiny_model_dir))
        settings = Settings()
    store = IndexStore(settings.s3)
    sink = QueueSink()
    router = EventRouter(settings.amqp, settings.videos, sink, settings.s3.buckets)
    stop = threading.Event()
    thread = threading.Thread(target=router.run, args=(stop,), daemon=True)
    thread.start()
    eventually(lambda: router.connected, "the router to connect", WAIT_S)
    yield Stack(settings, services, sink, store, SiglipEncoder(settings.model))
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def report(request: pytest.FixtureRequest) -> Iterator[list[str]]:
    """Lines for the terminal report, written once the module is done (also with ``-q``)."""
    lines: list[str] = []
    yield lines
    report_lines(request.config, lines)


@dataclass
class Case:
    """One object of the matrix and what must become of it."""

    name: str
    key: str
    #: None: no catalog row at all (never indexed, nothing to record).
    status: VideoStatus | None
    #: The exact reason recorded (failed cases), or a pattern for reasons that carry a measurement.
    reason: str | re.Pattern[str] | None = None
    #: Sampled frames written (indexed cases).
    frames: int = 0
    #: Limits of the Indexer that runs this case (defaults otherwise).
    limits: dict[str, Any] = field(default_factory=dict)
    #: Writes the object's bytes into the given directory and returns the file; None: written by hand.
    make: Callable[[Path], Path] | None = None
    #: Extra checks on the final state.
    check: Callable[[Stack, IndexJob], None] | None = None
    #: Filled in by the run.
    jobs: list[IndexJob] = field(default_factory=list)
    results: list[JobResult | str] = field(default_factory=list)


def _video(name: str, **kwargs: Any) -> Callable[[Path], Path]:
    kwargs.setdefault("seconds", 3)
    return lambda d: write_video(d / name, **kwargs)


def _check_upright_thumbnails(stack: Stack, job: IndexJob) -> None:
    rows = sorted((r for r in stack.frame_rows() if r["video_id"] == job.video_id), key=lambda r: r["ts_s"])
    assert [r["ts_s"] for r in rows] == [0.0, 1.0]
    for second, row in enumerate(rows):
        thumbnail = np.asarray(Image.open(io.BytesIO(row["thumbnail"])).convert("RGB"))
        # Portrait, and the picture drawn upright (the stored one is turned a quarter).
        assert thumbnail.shape == (160, 120, 3)
        assert mae(thumbnail, frame_at(second, 31, (120, 160))) < THUMBNAIL_MAE


def _check_vfr_times(stack: Stack, job: IndexJob) -> None:
    times = sorted(r["ts_s"] for r in stack.frame_rows() if r["video_id"] == job.video_id)
    assert times == [0.0, 1.2, 2.7, 3.05]


def _check_multipart(stack: Stack, job: IndexJob) -> None:
    # A multipart ETag is "<md5 of part md5s>-<parts>".
    etag = stack.services.minio_client().stat_object(stack.bucket, job.key).etag
    assert re.fullmatch(r"[0-9a-f]{32}-2", etag or ""), etag


def _matrix() -> list[Case]:
    fmt = MATRIX_FORMATS
    cases = [
        Case("zero-byte", "bad/empty.mp4", VideoStatus.FAILED, "decode error: empty file (0 bytes)"),
        Case(
            "truncated-mp4",
            "bad/truncated.mp4",
            VideoStatus.FAILED,
            "decode error: unreadable container: Invalid data found when processing input",
            make=lambda d: write_truncated(write_video(d / "whole.mp4", seconds=3, seed=2), d / "cut.mp4"),
        ),
        Case(
            "corrupt-mp4",
            "bad/garbage.mp4",
            VideoStatus.FAILED,
            "decode error: unreadable container: Invalid data found when processing input",
            make=lambda d: write_corrupt_mp4(d / "garbage.mp4"),
        ),
        Case(
            "mp4-no-streams",
            "bad/no streams.mp4",
            VideoStatus.FAILED,
            "not a video: no video stream",
            make=lambda d: write_no_streams_mp4(d / "nostreams.mp4"),
        ),
        Case(
            "audio-only",
            "bad/tone.mp4",
            VideoStatus.FAILED,
            "not a video: audio only (aac)",
            make=lambda d: write_audio_only(d / "tone.mp4"),
        ),
        Case("text-as-mp4", "bad/notes.mp4", VideoStatus.FAILED, "not a video: a text file"),
        Case(
            "png-as-mp4",
            "bad/photo.mp4",
            VideoStatus.FAILED,
            "not a video: a still image (png)",
            make=lambda d: write_still_image(d / "photo.png"),
        ),
        Case(
            "jpeg-as-mov",
            "bad/photo.mov",
            VideoStatus.FAILED,
            "not a video: a still image (jpeg)",
            make=lambda d: write_still_image(d / "photo.jpg", image_format="JPEG"),
        ),
    ]
    for n, (name, f) in enumerate(fmt.items()):
        cases.append(
            Case(
                name,
                f"formats/{name}{f.suffix}",
                VideoStatus.INDEXED,
                frames=3,
                make=_video(f"{name}{f.suffix}", codec=f.encoder, pix_fmt=f.pix_fmt, seed=40 + n),
            )
        )
    cases += [
        Case(
            "truncated-mkv",
            "odd/truncated.mkv",
            VideoStatus.INDEXED,
            frames=2,
            make=lambda d: write_truncated(
                write_video(d / "w.mkv", seconds=3, seed=3), d / "cut.mkv", keep_fraction=0.6
            ),
        ),
        Case(
            "rotated-90",
            "odd/phone.mov",
            VideoStatus.INDEXED,
            frames=2,
            make=_video("phone.mov", seconds=2, size=(120, 160), rotation=-90, seed=31),
            check=_check_upright_thumbnails,
        ),
        Case(
            "variable-fps",
            "odd/vfr.mp4",
            VideoStatus.INDEXED,
            frames=4,
            make=lambda d: write_timed_video(d / "vfr.mp4", VFR_TIMES, seed=32),
            check=_check_vfr_times,
        ),
        Case("one-frame", "odd/one.mp4", VideoStatus.INDEXED, frames=1, make=_video("one.mp4", seconds=0.1, seed=33)),
        Case(
            "long-low-fps",
            "odd/timelapse.mp4",
            VideoStatus.INDEXED,
            frames=60,
            # Ten minutes, a frame every 10 s, just inside limits set for it.
            limits={"max_duration_s": 600, "max_frames": 60},
            make=lambda d: write_timed_video(d / "timelapse.mp4", [10.0 * i for i in range(60)], seed=34),
        ),
        Case(
            "over-max-bytes",
            "limits/bytes.mp4",
            VideoStatus.FAILED,
            re.compile(r"exceeds max bytes 1000 \(object is \d+ bytes\)"),
            limits={"max_bytes": 1000},
            make=_video("bytes.mp4", seed=35),
        ),
        Case(
            "over-max-duration",
            "limits/duration.mp4",
            VideoStatus.FAILED,
            "exceeds max duration 2s (video is 3s)",
            limits={"max_duration_s": 2},
            make=_video("duration.mp4", seed=36),
        ),
        Case(
            "over-max-pixels",
            "limits/bomb.mp4",
            VideoStatus.FAILED,
            # The default limit (8K UHD): a 200 kB bomb is refused from its stream parameters.
            "frame 8000x8000 exceeds max pixels per frame 33177600",
            make=lambda d: write_pixel_bomb(d / "bomb.mp4"),
        ),
        Case(
            "over-max-frames",
            "limits/frames.mp4",
            VideoStatus.FAILED,
            "exceeds max frames per video 2 (at 00:00:02)",
            limits={"max_frames": 2},
            make=_video("frames.mp4", seed=37),
        ),
        Case(
            "over-max-decode-time",
            "limits/slow.mp4",
            VideoStatus.FAILED,
            re.compile(r"exceeds max decode time 0s \([0-9.]+s to reach 00:00:00\)"),
            limits={"max_decode_s": 1e-6},
            make=_video("slow.mp4", seed=38),
        ),
    ]
    keys = {
        "key-space": "keys/with space.mp4",
        "key-plus": "keys/a+b.mp4",
        "key-percent": "keys/100% real %2B.mp4",
        "key-unicode": "keys/ünïcødé 日本語 🎬.mp4",
        "key-deep": "keys/" + "/".join(f"d{i}" for i in range(12)) + "/deep.mkv",
    }
    for n, (name, key) in enumerate(keys.items()):
        cases.append(
            Case(name, key, VideoStatus.INDEXED, frames=2, make=_video(f"{name}{key[-4:]}", seconds=2, seed=55 + n))
        )
    cases.append(
        Case(
            "multipart",
            "big/multipart.mp4",
            VideoStatus.INDEXED,
            frames=10,  # 92 frames at 10 fps: a sample at 0, 1, ..., 9 s
            make=lambda d: write_large_video(d / "big.mp4", min_bytes=PART_BYTES + 1, seed=39),
            check=_check_multipart,
        )
    )
    return cases


def _reason_matches(expected: str | re.Pattern[str] | None, actual: str | None) -> bool:
    if isinstance(expected, re.Pattern):
        return actual is not None and expected.fullmatch(actual) is not None
    return expected == actual


def _run(indexer: Indexer, job: IndexJob) -> JobResult | str:
    try:
        return indexer.run(job)
    except PermanentError as exc:
        return exc.reason


def test_bad_input_matrix(stack: Stack, tmp_path: Path, report: list[str]) -> None:
    cases = _matrix()
    # Given every case's object, uploaded by a plain S3 client
    for case in cases:
        if case.make is not None:
            stack.upload(case.key, case.make(tmp_path / case.name), part_size=PART_BYTES)
    minio = stack.services.minio_client()
    minio.put_object(stack.bucket, "bad/empty.mp4", io.BytesIO(b""), 0)
    text = b"these are not the frames you are looking for\n" * 20
    minio.put_object(stack.bucket, "bad/notes.mp4", io.BytesIO(text), len(text))
    # an object deleted before its event is processed
    # Created and deleted before any job ran: both jobs find it gone and nothing indexed, so no row
    # is written at all (a bucket event costs no catalog commit).
    gone = Case("deleted-before-processing", "odd/gone.mp4", None)
    stack.upload(gone.key, write_video(tmp_path / "gone.mp4", seconds=2, seed=60))
    minio.remove_object(stack.bucket, gone.key)
    # and one key overwritten five times within a second, each time with other content
    versions = [write_video(tmp_path / f"over{n}.mp4", seconds=1 + n, seed=70 + n) for n in range(5)]
    overwritten = Case("overwritten-5x", "odd/overwritten.mp4", VideoStatus.INDEXED, frames=5)
    started = time.monotonic()
    for path in versions:
        stack.upload(overwritten.key, path)
    overwrite_s = time.monotonic() - started
    cases += [gone, overwritten]
    by_key = {case.key: case for case in cases}
    # When the router turns their events into jobs, one per event: the deleted object has two (created,
    # removed), the overwritten key five
    for job in stack.sink.take(len(cases) + 1 + 4):
        assert job.key in by_key, f"a job for a key that was never written: {job.key!r}"
        by_key[job.key].jobs.append(job)
    # And the indexer runs each case's jobs in the order they came
    for case in cases:
        indexer = stack.indexer(**case.limits)
        case.results = [_run(indexer, job) for job in case.jobs]
    # And then a good video arrives
    good = Case("good-after-bad", "after/good.mp4", VideoStatus.INDEXED, frames=3)
    stack.upload(good.key, write_video(tmp_path / "good.mp4", seconds=3, seed=80))
    good.jobs = stack.sink.take(1)
    good.results = [_run(stack.indexer(), good.jobs[0])]
    cases.append(good)

    # Then every case ends with its status and reason, and the frames table holds what the catalog says
    rows = stack.frame_rows()
    rows_per_video = Counter(r["video_id"] for r in rows)
    duplicated = sum(n - 1 for n in Counter(r["frame_id"] for r in rows).values() if n > 1)
    lost = 0
    problems: list[str] = []
    statuses: Counter[str] = Counter()
    for case in cases:
        if not case.jobs:
            problems.append(f"{case.name}: no job")
            lost += 1
            continue
        job = case.jobs[0]
        record = stack.store.catalog.get(job.video_id)
        status = record.status if record else None
        written = record.frames if record and status is VideoStatus.INDEXED else 0
        rows_here = rows_per_video.get(job.video_id, 0)
        settled = status in (VideoStatus.INDEXED, VideoStatus.FAILED, VideoStatus.DELETED)
        if not (settled or (status is None and case.status is None and rows_here == 0)) or rows_here < written:
            lost += 1
        duplicated += max(0, rows_here - written)
        statuses[status.value if status else "none"] += 1
        error = record.error if record else None
        detail = error if status is VideoStatus.FAILED else f"{rows_here} frame{'' if rows_here == 1 else 's'}"
        report.append(f"bad-input {case.name}: {status.value if status else 'NO STATUS'} ({detail}) key={case.key!r}")
        if status is not case.status:
            problems.append(f"{case.name}: {status} != {case.status} ({error}; results {case.results})")
        elif case.status is VideoStatus.FAILED and not _reason_matches(case.reason, error):
            problems.append(f"{case.name}: reason {error!r} != {case.reason!r}")
        elif case.status is VideoStatus.INDEXED and (written, rows_here) != (case.frames, case.frames):
            problems.append(f"{case.name}: {written} frames recorded, {rows_here} rows, {case.frames} expected")
        if any(j.key != case.key for j in case.jobs):
            problems.append(f"{case.name}: job keys {[j.key for j in case.jobs]} != {case.key!r}")
        elif case.check is not None and status is case.status:
            case.check(stack, job)
    report.append(
        f"bad-input matrix: {len(cases)} cases, indexed {statuses['indexed']}, failed {statuses['failed']}, "
        f"deleted {statuses['deleted']}, no row {statuses['none']}, lost {lost}, duplicated {duplicated}"
    )
    # The real `vidx check --json` over the matrix's bucket (its own prefix): nothing inconsistent,
    # nothing left queued/indexing; the failed cases are failed at their object's version, not findings.
    env = {**stack.services.env(stack.bucket.removesuffix("-videos")), "VIDX_MODEL__ID": stack.settings.model.id}
    check = vidx_check(bucket=stack.bucket, env=env)
    report.append(check.line("bad-input matrix"))
    report.extend(f"  {item}" for item in check.found[:10])
    for line in report:
        print(line)
    assert not problems, "\n".join(problems)
    assert (lost, duplicated) == (0, 0)
    assert check.inconsistencies == 0 and check.in_flight == 0, check.found
    assert check.report["failed"] == statuses["failed"]
    # The deleted object: both its jobs found it gone with nothing indexed, and wrote nothing
    assert [r.outcome for r in gone.results if isinstance(r, JobResult)] == [Outcome.UNCHANGED, Outcome.UNCHANGED]
    # One job per event; the two events of one key may reach the queue in either order (MinIO publishes
    # each from its own request), and both jobs find the object gone whichever runs first.
    assert sorted(j.op.value for j in gone.jobs) == [JobOp.DELETE.value, JobOp.INDEX.value]
    # The overwritten key: five events, the latest version indexed once, by the first job to run
    assert overwrite_s < 1.0, f"five overwrites took {overwrite_s:.2f}s"
    assert [r.outcome for r in overwritten.results if isinstance(r, JobResult)] == [Outcome.INDEXED] + [
        Outcome.UNCHANGED
    ] * 4
    latest = stack.encoder.embed_images([frame_at(3, 74)])[0]
    top = stack.store.frames.search(latest, 1)[0]
    assert (top["video_id"], top["ts_s"]) == (overwritten.jobs[0].video_id, 3.0)
    # The good video after all the bad ones
    assert good.results == [JobResult(good.jobs[0].video_id, Outcome.INDEXED, frames=3)]


def test_concurrent_downloads_wait_for_a_slot_then_retry(stack: Stack, tmp_path: Path) -> None:
    # One slot; a download into a FIFO holds it until someone reads the FIFO.
    key = "limits/slot.mp4"
    stack.upload(key, write_video(tmp_path / "slot.mp4", seconds=1, seed=90))
    source = S3ObjectSource(stack.settings.s3, LimitSettings(max_concurrent_downloads=1, download_slot_wait_s=0.3))
    head = source.head(stack.bucket, key)
    assert isinstance(head, ObjectHead)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    first: list[int] = []
    holder = threading.Thread(target=lambda: first.append(source.download(head, fifo)), daemon=True)
    holder.start()
    # The holder blocks opening the FIFO for writing, with its slot taken. A second download waits
    # for the bounded time, then fails as transient (the job is retried), naming the limit.
    started = time.monotonic()
    with pytest.raises(TransientError, match=r"^no download slot within 0\.3s \(max concurrent downloads 1\)$"):
        source.download(head, tmp_path / "second.mp4")
    assert 0.25 <= time.monotonic() - started < 5
    with fifo.open("rb") as reader:
        received = reader.read()
    holder.join(timeout=WAIT_S)
    assert not holder.is_alive()
    assert first == [head.size] == [len(received)]
    # The slot is free again.
    assert source.download(head, tmp_path / "third.mp4") == head.size
