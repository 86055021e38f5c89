"""pipeline/media/decode.py's worker processes: a decode that hangs is abandoned at ``max_decode_s``, a decoder
that crashes fails its video, and neither leaves a thread or a process behind."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from pipeline.media.decode import (
    ABANDON_GRACE_S,
    DECODE_NICENESS,
    DecodeLimits,
    DecodeStats,
    open_sampled,
    prestart_workers,
    probe,
    sample_frames,
)
from storage.errors import CorruptVideo, LimitExceeded, NotAVideo, TransientError
from storage.sampling import Sampling
from tests.media import mae, write_corrupt_mp4, write_video

MAX_DECODE_S = 1.5
#: When a stuck worker is killed: a moment after the limit (a worker that progresses reports it itself).
ABANDON_AFTER_S = MAX_DECODE_S + ABANDON_GRACE_S
#: How much later than that an abandoned decode may return (killing and reaping the worker).
ABANDON_SLACK_S = 1.0


def child_pids() -> set[int]:
    """This process's children (zombies included: a child that was never reaped still shows)."""
    me, found = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name is in parentheses and may hold spaces: the fields after it are plain.
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:
            found.add(int(entry.name))
    return found


def pid_reading(path: Path) -> int:
    """The child process that has ``path`` open."""
    for pid in child_pids():
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == str(path):
                    return pid
            except OSError:
                continue
    raise AssertionError(f"no child has {path} open")


@dataclass
class Stalled:
    """A named pipe that serves the first ``prefix`` bytes of a video, then nothing (without ending)."""

    path: Path
    opened: threading.Event
    release: threading.Event


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_video(tmp_path_factory.mktemp("src") / "src.ts", seconds=6, fps=10, codec="mpeg2video", seed=31)


@pytest.fixture
def stalled(tmp_path: Path, source: Path, request: pytest.FixtureRequest) -> Iterator[Stalled]:
    fraction: float = getattr(request, "param", 0.7)
    data = source.read_bytes()[: int(source.stat().st_size * fraction)]
    path = tmp_path / "stalled.ts"
    os.mkfifo(path)
    stall = Stalled(path, threading.Event(), threading.Event())

    def serve() -> None:
        try:
            with path.open("wb") as pipe:  # blocks until the reader opens it
                stall.opened.set()
                pipe.write(data)
                pipe.flush()
                stall.release.wait()
        except BrokenPipeError:
            pass  # the reader was killed: what the tests want

    writer = threading.Thread(target=serve, name="stalled-writer")
    writer.start()
    yield stall
    stall.release.set()
    if not stall.opened.is_set():
        # Nobody opened the pipe: open it here, so the writer's open returns.
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    writer.join(timeout=10)
    assert not writer.is_alive()


@pytest.fixture
def warm(source: Path) -> None:
    """A worker started and idle, so a timing measures the decode, not an interpreter starting."""
    probe(source, DecodeLimits())


@pytest.mark.parametrize(
    ("stalled", "where"),
    [(0.3, r"before the first frame"), (0.7, r"after the frame at 00:00:0\d")],
    indirect=["stalled"],
    ids=["in-the-header", "mid-stream"],
)
def test_a_decode_whose_read_blocks_is_abandoned_at_max_decode_s(stalled: Stalled, warm: None, where: str) -> None:
    # Given a worker that will block reading (the pipe holds part of a video and never ends)
    threads = set(threading.enumerate())
    children = child_pids()
    got: list[float] = []
    started = time.monotonic()
    # When the frames are sampled with a decode time limit
    with pytest.raises(LimitExceeded) as info:
        for frame in sample_frames(stalled.path, Sampling(1.0), DecodeLimits(max_decode_s=MAX_DECODE_S)):
            got.append(frame.ts_s)
    elapsed = time.monotonic() - started
    # Then the decode is given up at the limit, with the limit and how far it got as the reason
    assert ABANDON_AFTER_S <= elapsed < ABANDON_AFTER_S + ABANDON_SLACK_S
    assert info.value.reason.startswith(f"exceeds max decode time {MAX_DECODE_S:g}s (stuck ")
    assert info.value.reason.endswith("; abandoned)")
    assert re.search(where, info.value.reason)
    # The frames before the pipe ran dry came through.
    assert got == [float(i) for i in range(len(got))] and (len(got) > 0) is ("after" in where)
    # And the stuck worker is gone (killed and reaped), and no thread was left running
    assert child_pids() < children
    assert set(threading.enumerate()) == threads


def test_a_worker_that_hangs_is_not_reused(stalled: Stalled, warm: None, source: Path) -> None:
    with pytest.raises(LimitExceeded):
        list(sample_frames(stalled.path, Sampling(1.0), DecodeLimits(max_decode_s=0.5)))

    # The next decode gets a sound worker and all its frames.
    assert [f.ts_s for f in sample_frames(source, Sampling(1.0), DecodeLimits())] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_the_time_a_caller_holds_a_frame_is_not_decode_time(source: Path, warm: None) -> None:
    # Holding each frame longer than the limit: the decode itself is quick, so it is not abandoned.
    got = []
    for frame in sample_frames(source, Sampling(2.0), DecodeLimits(max_decode_s=0.5)):
        time.sleep(0.6)
        got.append(frame.ts_s)

    assert got == [0.0, 2.0, 4.0]


def test_a_decoder_that_crashes_fails_its_video_not_the_caller(stalled: Stalled, warm: None) -> None:
    frames = sample_frames(stalled.path, Sampling(1.0), DecodeLimits(max_decode_s=30))
    assert next(frames).ts_s == 0.0
    children = child_pids()

    # A segfault in FFmpeg on this input, as a crafted file would cause it.
    os.kill(pid_reading(stalled.path), signal.SIGSEGV)
    with pytest.raises(CorruptVideo) as info:
        list(frames)

    assert info.value.reason.startswith("decode error: the decoder crashed (SIGSEGV) after the frame at 00:00:0")
    assert child_pids() < children


def test_a_worker_ended_from_outside_is_worth_a_retry(stalled: Stalled, warm: None) -> None:
    frames = sample_frames(stalled.path, Sampling(1.0), DecodeLimits(max_decode_s=30))
    next(frames)

    os.kill(pid_reading(stalled.path), signal.SIGKILL)
    with pytest.raises(TransientError, match=r"^the decode worker ended \(SIGKILL\) after the frame at "):
        list(frames)


def test_workers_are_reused(source: Path, warm: None) -> None:
    # The start of a worker is paid once, not per video.
    children = child_pids()
    for _ in range(3):
        assert len(list(sample_frames(source, Sampling(1.0), DecodeLimits()))) == 6
        assert probe(source, DecodeLimits()).width == 160
    assert child_pids() == children


def test_prestarted_workers_serve_the_first_concurrent_requests_without_a_start(source: Path) -> None:
    prestart_workers(2)
    children = child_pids()
    assert prestart_workers(2) == 0  # two are idle already: nothing more is started
    # Two decodes at once, each holding its worker until its generator ends: neither starts a process.
    held = [open_sampled(source, Sampling(1.0), DecodeLimits()) for _ in range(2)]
    assert child_pids() == children
    for video in held:
        assert len(list(video.frames)) == 6
    assert child_pids() == children


def test_decode_workers_run_at_a_lower_priority_than_their_caller(source: Path, warm: None) -> None:
    frames = sample_frames(source, Sampling(1.0), DecodeLimits())
    next(frames)
    workers = child_pids()
    assert workers and {os.getpriority(os.PRIO_PROCESS, pid) for pid in workers} == {
        os.getpriority(os.PRIO_PROCESS, 0) + DECODE_NICENESS
    }
    frames.close()


def test_stopping_early_ends_the_worker_it_held(source: Path, warm: None) -> None:
    children = child_pids()
    frames = sample_frames(source, Sampling(1.0), DecodeLimits())
    next(frames)
    busy = child_pids()
    frames.close()

    # The worker was mid-decode: it can't be handed to someone else, so it is gone.
    assert child_pids() < busy
    assert busy == children
    assert len(list(sample_frames(source, Sampling(1.0), DecodeLimits()))) == 6


def test_closing_an_opened_video_before_its_frames_ends_the_worker_it_held(source: Path, warm: None) -> None:
    children = child_pids()
    info, frames = open_sampled(source, Sampling(1.0), DecodeLimits())
    assert info.width == 160
    # One request holds the worker from the stream facts to the last frame.
    busy = child_pids()
    frames.close()

    assert child_pids() < busy
    assert busy == children
    assert [f.ts_s for f in open_sampled(source, Sampling(1.0), DecodeLimits()).frames] == [
        0.0,
        1.0,
        2.0,
        3.0,
        4.0,
        5.0,
    ]


def test_errors_in_the_worker_keep_their_type_reason_and_cause(tmp_path: Path) -> None:
    corrupt = write_corrupt_mp4(tmp_path / "corrupt.mp4")
    text = tmp_path / "notes.mp4"
    text.write_text("not the frames you are looking for\n")

    with pytest.raises(CorruptVideo) as corrupted:
        list(sample_frames(corrupt, Sampling(1.0), DecodeLimits()))
    with pytest.raises(NotAVideo) as not_a_video:
        probe(text, DecodeLimits())

    assert corrupted.value.reason.startswith("decode error: unreadable container: ")
    assert "InvalidDataError" in str(corrupted.value.__cause__)
    assert not_a_video.value.reason == "not a video: a text file"


def test_a_worker_decodes_what_this_thread_decodes(tmp_path: Path) -> None:
    path = write_video(tmp_path / "v.mp4", seconds=3, fps=25, size=(320, 240), seed=32)
    worker_stats, here_stats = DecodeStats(), DecodeStats()

    in_worker = list(sample_frames(path, Sampling(0.5), DecodeLimits(), 160, stats=worker_stats))
    here = list(sample_frames(path, Sampling(0.5), DecodeLimits(), 160, stats=here_stats, isolated=False))

    assert [(f.index, f.ts_s) for f in in_worker] == [(f.index, f.ts_s) for f in here]
    for a, b in zip(in_worker, here, strict=True):
        assert a.rgb.dtype == np.uint8 and a.rgb.flags.writeable and a.rgb.flags.c_contiguous
        assert mae(a.rgb, b.rgb) == 0.0
    assert worker_stats.frames_decoded == here_stats.frames_decoded > 0
    assert worker_stats.worker_cpu_s > 0 and here_stats.worker_cpu_s == 0
