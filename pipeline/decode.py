"""Decode a video with PyAV and sample one frame every ``every_s`` seconds by presentation time.

Only sampled frames are converted to RGB, and the conversion scales them down in swscale
(decoder side) rather than in Python. PyAV/FFmpeg exceptions are converted here into
``NotAVideo``, ``CorruptVideo`` and ``LimitExceeded``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import av.error
import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, Field

from pipeline.errors import CorruptVideo, LimitExceeded, NotAVideo

log = logging.getLogger(__name__)


class DecodeLimits(BaseModel):
    """Bounds on one video's decode; each violation names itself in the failure reason."""

    max_duration_s: float = Field(default=4 * 3600.0, gt=0)
    max_pixels: int = Field(default=7680 * 4320, gt=0)
    max_frames: int = Field(default=20_000, gt=0)
    max_decode_s: float = Field(default=1800.0, gt=0)


@dataclass(frozen=True, slots=True)
class VideoInfo:
    duration_s: float | None
    width: int
    height: int
    codec: str
    fps: float | None


@dataclass(frozen=True, slots=True)
class SampledFrame:
    """One sampled frame: its index in the sample sequence, its presentation time, RGB pixels."""

    index: int
    ts_s: float
    rgb: NDArray[np.uint8]


def hms(ts_s: float) -> str:
    total = max(0, int(ts_s))
    return f"{total // 3600:02d}:{total % 3600 // 60:02d}:{total % 60:02d}"


def _scaled_size(width: int, height: int, max_side: int) -> tuple[int, int]:
    scale = min(1.0, max_side / max(width, height))
    # Even dimensions keep swscale's chroma handling exact.
    return max(2, int(width * scale) // 2 * 2), max(2, int(height * scale) // 2 * 2)


def _open(path: Path) -> av.container.InputContainer:
    # FFmpeg reports an empty file as "Invalid data found when processing input"; say what it is.
    if path.is_file() and path.stat().st_size == 0:
        raise CorruptVideo("empty file (0 bytes)")
    try:
        return av.open(str(path), mode="r", metadata_errors="ignore")
    except av.error.InvalidDataError as exc:
        raise CorruptVideo(f"unreadable container: {exc.strerror or exc}") from exc
    except av.error.FFmpegError as exc:
        raise CorruptVideo(f"can't open: {exc.strerror or exc}") from exc


def _info(container: av.container.InputContainer, limits: DecodeLimits) -> tuple[VideoInfo, av.VideoStream]:
    if not container.streams.video:
        raise NotAVideo("no video stream")
    stream = container.streams.video[0]
    ctx = stream.codec_context
    width, height = int(ctx.width or 0), int(ctx.height or 0)
    if width <= 0 or height <= 0:
        raise NotAVideo("the video stream has no picture size")
    duration_s: float | None = None
    if stream.duration is not None and stream.time_base is not None:
        duration_s = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        duration_s = container.duration / av.time_base
    fps = float(stream.average_rate) if stream.average_rate else None
    info = VideoInfo(duration_s=duration_s, width=width, height=height, codec=ctx.name, fps=fps)
    if width * height > limits.max_pixels:
        raise LimitExceeded(f"exceeds max pixels per frame {limits.max_pixels} ({width}x{height} = {width * height})")
    if duration_s is not None and duration_s > limits.max_duration_s:
        raise LimitExceeded(f"exceeds max duration {hms(limits.max_duration_s)} (video is {hms(duration_s)})")
    return info, stream


def probe(path: Path, limits: DecodeLimits) -> VideoInfo:
    """Read a video's stream facts without decoding it.

    Raises:
        NotAVideo, CorruptVideo, LimitExceeded.
    """
    with _open(path) as container:
        return _info(container, limits)[0]


def sample_frames(path: Path, every_s: float, limits: DecodeLimits, max_side: int = 384) -> Iterator[SampledFrame]:
    """Yield one frame per ``every_s`` seconds: for each target time t = 0, every_s, 2·every_s, …
    the first frame presented at or after t (a frame that covers several targets is yielded once).

    Raises:
        NotAVideo: no video stream.
        CorruptVideo: the container can't be read, or no frame could be decoded.
        LimitExceeded: duration, pixels, frame count or decode time over its limit.
    """
    if every_s <= 0:
        raise ValueError("every_s must be positive")
    started = time.monotonic()
    # Time the consumer spends between frames (embedding, thumbnails) is not decode time.
    paused_s = 0.0
    with _open(path) as container:
        info, stream = _info(container, limits)
        stream.thread_type = "AUTO"
        out_w, out_h = _scaled_size(info.width, info.height, max_side)
        time_base = stream.time_base or Fraction(1, 1)
        next_target = 0.0
        index = 0
        last_ts = 0.0
        first_pts: float | None = None
        try:
            for frame in container.decode(stream):
                if frame.pts is None:
                    continue
                ts = float(frame.pts * time_base)
                if first_pts is None:
                    # Streams may start at a non-zero pts (MPEG-TS); times are relative to the first frame.
                    first_pts = ts
                ts -= first_pts
                last_ts = ts
                if ts > limits.max_duration_s:
                    raise LimitExceeded(f"exceeds max duration {hms(limits.max_duration_s)}")
                if time.monotonic() - started - paused_s > limits.max_decode_s:
                    raise LimitExceeded(f"exceeds max decode time {limits.max_decode_s:g}s at {hms(ts)}")
                # A small tolerance absorbs pts rounding: a frame at 3.9999 s is the frame for t = 4.
                if ts + 1e-3 < next_target:
                    continue
                if index >= limits.max_frames:
                    raise LimitExceeded(f"exceeds max frames per video {limits.max_frames}")
                # rgb24 is uint8 already (no copy); asarray narrows to_ndarray's union type for mypy.
                rgb = np.asarray(frame.to_ndarray(format="rgb24", width=out_w, height=out_h), dtype=np.uint8)
                handed_over = time.monotonic()
                yield SampledFrame(index=index, ts_s=round(ts, 3), rgb=rgb)
                paused_s += time.monotonic() - handed_over
                index += 1
                while next_target <= ts + 1e-3:
                    next_target += every_s
        except av.error.FFmpegError as exc:
            raise CorruptVideo(f"at {hms(last_ts)}: {exc.strerror or exc}") from exc
        if index == 0:
            raise CorruptVideo("no frame could be decoded")
