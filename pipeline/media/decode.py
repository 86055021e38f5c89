"""The decode stage: probe a video and sample its frames (``Sampling``: one every ``every_s`` seconds of
its timeline; ``open_sampled`` does both with one open of the file).

The decoding itself is ``pipeline.media.probe`` and ``pipeline.media.sampler`` (PyAV); here it runs in a worker process
(``pipeline.media.workers``) that is killed, and the decode abandoned, when it overruns
``max_decode_s``: FFmpeg can't be stopped from another thread in the middle of a call. A decoder
that crashes on its input fails that video (``CorruptVideo``), not the consumer.
"""

from __future__ import annotations

import atexit
import resource
import signal
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple, cast

import numpy as np

from pipeline.media.probe import VideoInfo, probe_file, scaled_size, span
from pipeline.media.sampler import DecodeStats, SampledFrame, open_file
from pipeline.media.settings import DecodeLimits, DecodeStrategy
from pipeline.media.workers import (
    DONE,
    ERROR,
    Message,
    Overrun,
    RemoteError,
    StartFailed,
    WorkerDied,
    WorkerPool,
    serve,
)
from storage.errors import CorruptVideo, LimitExceeded, NotAVideo, TransientError
from storage.sampling import Sampling, SamplingStrategy, hms

__all__ = [
    "ABANDON_GRACE_S",
    "WORKER_ENTRY",
    "DecodeLimits",
    "DecodeStats",
    "DecodeStrategy",
    "SampledFrame",
    "SampledVideo",
    "VideoInfo",
    "hms",
    "open_sampled",
    "prestart_workers",
    "probe",
    "sample_frames",
    "scaled_size",
    "serve_worker",
    "span",
]

_INFO, _FRAME, _STATS = b"I", b"F", b"S"

#: Idle workers kept per process (each is an interpreter with PyAV and numpy loaded: tens of MB).
_MAX_IDLE_WORKERS = 8
#: A worker is replaced after this many requests (bounds what a long-lived decoder process accumulates).
_REQUESTS_PER_WORKER = 500
#: Longest wait for a new worker to be ready (an interpreter importing PyAV); not counted as decode time.
_WORKER_START_TIMEOUT_S = 120.0
#: A decode that overruns ``max_decode_s`` while it progresses is stopped by its worker, which names the
#: frame it reached; one that is stuck (inside an FFmpeg call) is killed this much later than the limit.
ABANDON_GRACE_S = 1.0
#: How a decoder that crashed on its input ends (a worker ended from outside gets SIGKILL or SIGTERM).
_CRASH_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT"})

#: Added to a decode worker's nice value: decoding is the bulk of a node's CPU, and it must not take
#: the share of the processes that answer at once (the API, the Serve proxy, the broker); a busy
#: node decodes a little later instead (docs/operations.md).
DECODE_NICENESS = 10

#: What a worker process runs.
WORKER_ENTRY = "from pipeline.media.decode import serve_worker; serve_worker()"

_WORKERS = WorkerPool(
    WORKER_ENTRY,
    max_idle=_MAX_IDLE_WORKERS,
    start_timeout_s=_WORKER_START_TIMEOUT_S,
    requests_per_worker=_REQUESTS_PER_WORKER,
    niceness=DECODE_NICENESS,
)
atexit.register(_WORKERS.close)

#: What a worker raises on purpose, raised again here as itself.
_REMOTE_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (NotAVideo, CorruptVideo, LimitExceeded, ValueError)
}


def prestart_workers(count: int) -> int:
    """Start decode workers until ``count`` are idle (at most ``_MAX_IDLE_WORKERS``): a consumer does this
    while it starts, so its first videos don't pay for starting them. Returns how many it started.

    Raises:
        TransientError: a worker could not be started.
    """
    try:
        return _WORKERS.prestart(count)
    except StartFailed as exc:
        raise TransientError(f"no decode worker: {exc}") from exc


def probe(path: Path, limits: DecodeLimits, *, isolated: bool = True) -> VideoInfo:
    """Read a video's stream facts without decoding it (``duration_s`` on the player's timeline).
    ``isolated``: in a worker process, bounded by ``limits.max_decode_s``; else in this thread.

    Raises:
        NotAVideo, CorruptVideo, LimitExceeded.
        TransientError: no worker could be started, or it was ended from outside.
    """
    if not isolated:
        return probe_file(path, limits)
    info: VideoInfo | None = None
    for message in _in_worker(_request("probe", path, limits), limits.max_decode_s, lambda: "reading the header"):
        if message.kind == _INFO:
            info = VideoInfo(**message.header)
    if info is None:
        raise TransientError("the decode worker answered a probe without the stream facts")
    return info


class SampledVideo(NamedTuple):
    """A video opened once for sampling: its stream facts and the generator of its sampled frames
    (closing it, or dropping it, ends the decode and frees its worker)."""

    info: VideoInfo
    frames: Generator[SampledFrame, None, None]


def open_sampled(
    path: Path,
    sampling: Sampling,
    limits: DecodeLimits,
    max_side: int = 384,
    *,
    strategy: DecodeStrategy = DecodeStrategy.AUTO,
    threads: int = 0,
    stats: DecodeStats | None = None,
    isolated: bool = True,
) -> SampledVideo:
    """``probe`` and ``sample_frames`` with one open of the file: returns once the stream facts are
    read and checked (``info``, as ``probe`` gives them), with ``frames`` yielding what
    ``sample_frames`` yields. The parameters are ``sample_frames``'s; ``max_decode_s`` bounds the
    whole of it, the header included.

    Raises:
        NotAVideo, CorruptVideo, LimitExceeded, TransientError: as ``probe``, here; as
            ``sample_frames``, from ``frames``.
    """
    stats = stats if stats is not None else DecodeStats()
    if not isolated:
        return SampledVideo(*open_file(path, sampling, limits, max_side, DecodeStrategy(strategy), threads, stats))
    request = _request(
        "sample",
        path,
        limits,
        # The interval as a float: the label rounds it to 6 digits.
        every_s=sampling.every_s,
        sampling_strategy=sampling.strategy.value,
        max_side=max_side,
        strategy=DecodeStrategy(strategy).value,
        threads=threads,
    )
    video = _sample_in_worker(request, limits.max_decode_s, stats)
    # The generator runs up to the stream facts: errors before them are raised here, and the worker
    # is held by a started generator, which its close (or collection) hands back or ends.
    info = next(video, None)
    if not isinstance(info, VideoInfo):
        raise TransientError("the decode worker ended a decode without the stream facts")
    return SampledVideo(info, cast("Generator[SampledFrame, None, None]", video))


def sample_frames(
    path: Path,
    sampling: Sampling,
    limits: DecodeLimits,
    max_side: int = 384,
    *,
    strategy: DecodeStrategy = DecodeStrategy.AUTO,
    threads: int = 0,
    stats: DecodeStats | None = None,
    isolated: bool = True,
) -> Iterator[SampledFrame]:
    """Yield one frame per ``sampling.every_s`` seconds: for each target time t = 0, every_s, 2·every_s, …
    of the player's timeline, the first frame presented at or after t (a frame that covers several
    targets is yielded once). A video stream that starts late on the timeline (after the audio, or
    late on an MPEG-TS clock) yields its first frame at its own time, for every target up to it.

    ``strategy`` picks how (see ``DecodeStrategy``; all but ``keyframes`` yield the same frames);
    ``threads`` is the decoder's thread count (0: one for the strategies that decode sparsely, where
    frame threads cost CPU time and barely shorten the decode; FFmpeg's choice, one per core and one
    more, for ``sequential``);
    ``stats``, when given, is filled in with what the decode did. ``isolated`` (the default) decodes
    in a worker process; the time it takes (not the time the caller holds a frame) is checked at
    every frame against ``limits.max_decode_s``, and a worker still stuck a moment past the limit is
    killed. With ``False`` the decode runs in this thread (profiling): its time is only checked at
    frames, and a decode stuck inside FFmpeg can't be abandoned.

    Raises:
        NotAVideo: no video stream.
        CorruptVideo: the container can't be read, no frame could be decoded, or the decoder crashed.
        LimitExceeded: duration, pixels, frame count or decode time over its limit.
        TransientError: no worker could be started, or it was ended from outside.

    Frames whose stream carries a display matrix are rotated upright (a portrait phone video yields
    portrait frames), after scaling, so ``max_side`` bounds the longer side either way.
    """
    video = open_sampled(
        path, sampling, limits, max_side, strategy=strategy, threads=threads, stats=stats, isolated=isolated
    )
    yield from video.frames


def _sample_in_worker(
    request: dict[str, Any], max_decode_s: float, stats: DecodeStats
) -> Generator[VideoInfo | SampledFrame, None, None]:
    """The stream facts, then the frames, of a ``sample`` request run in a worker."""
    last_ts: float | None = None

    def where() -> str:
        return "before the first frame" if last_ts is None else f"after the frame at {hms(last_ts)}"

    for message in _in_worker(request, max_decode_s, where):
        if message.kind == _INFO:
            yield VideoInfo(**message.header)
        elif message.kind == _FRAME:
            header = message.header
            # The payload is a fresh bytearray: the array owns writable memory, no copy.
            rgb = np.frombuffer(message.payload, dtype=np.uint8).reshape(header["shape"])
            last_ts = header["ts_s"]
            yield SampledFrame(index=header["index"], ts_s=header["ts_s"], rgb=rgb)
        elif message.kind == _STATS:
            for name, value in message.header.items():
                setattr(stats, name, value)


def _request(op: str, path: Path, limits: DecodeLimits, **fields: Any) -> dict[str, Any]:
    decode_limits = {name: getattr(limits, name) for name in DecodeLimits.model_fields}
    return {"op": op, "path": str(Path(path).absolute()), "limits": decode_limits, **fields}


def _in_worker(request: dict[str, Any], max_decode_s: float, where: Callable[[], str]) -> Iterator[Message]:
    """Run ``request`` in a worker and yield its messages up to DONE. Waiting for them counts against
    ``max_decode_s`` (and a grace); a worker that overruns is killed. ``where`` says how far it got."""
    left_s = max_decode_s + ABANDON_GRACE_S
    try:
        with _WORKERS.lease() as worker:
            worker.request(request)
            while True:
                waiting = time.monotonic()
                message = worker.receive(left_s)
                left_s -= time.monotonic() - waiting
                if message.kind == DONE:
                    return
                if message.kind == ERROR:
                    raise _remote_error(message.header)
                yield message
    except Overrun as exc:
        raise LimitExceeded(f"exceeds max decode time {span(max_decode_s)} (stuck {where()}; abandoned)") from exc
    except WorkerDied as exc:
        if exc.signal_name in _CRASH_SIGNALS:
            raise CorruptVideo(f"the decoder crashed ({exc.signal_name}) {where()}") from exc
        raise TransientError(f"the decode worker ended ({exc}) {where()}") from exc
    except StartFailed as exc:
        raise TransientError(f"no decode worker: {exc}") from exc


def _remote_error(header: dict[str, Any]) -> Exception:
    cls = _REMOTE_ERRORS.get(header["type"])
    error = cls(header["message"]) if cls else RuntimeError(f"decode worker: {header['type']}: {header['message']}")
    if "cause" in header:
        error.__cause__ = RemoteError(header["cause"]["type"], header["cause"]["message"])
    return error


# The worker's side.


def serve_worker() -> None:
    """The loop of a decode worker process: run the requests of ``probe``/``sample_frames`` here."""
    # A worker is ended by its parent (input closed, or killed); Ctrl-C on a terminal is the parent's.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(_handle)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _handle(request: dict[str, Any], reply: Callable[[Message], None]) -> None:
    limits = DecodeLimits.model_validate(request["limits"])
    path = Path(request["path"])
    if request["op"] == "probe":
        reply(Message(_INFO, asdict(probe_file(path, limits))))
        return
    stats = DecodeStats()
    started = _cpu_s()
    strategy = DecodeStrategy(request["strategy"])
    try:
        # One open: the stream facts first, then the frames.
        info, frames = open_file(
            path,
            Sampling(request["every_s"], SamplingStrategy(request["sampling_strategy"])),
            limits,
            request["max_side"],
            strategy,
            request["threads"],
            stats,
        )
        reply(Message(_INFO, asdict(info)))
        for frame in frames:
            pixels = np.ascontiguousarray(frame.rgb)
            header = {"index": frame.index, "ts_s": frame.ts_s, "shape": list(pixels.shape)}
            reply(Message(_FRAME, header, pixels.data.cast("B")))
    finally:
        stats.worker_cpu_s = _cpu_s() - started
        reply(Message(_STATS, asdict(stats)))
