"""Decode a video with PyAV and sample one frame every ``every_s`` seconds by presentation time.

Only sampled frames are converted to RGB, and the conversion scales them down in swscale
(decoder side) rather than in Python; frames carrying a display matrix (phone videos) are turned
upright. PyAV/FFmpeg exceptions are converted here into ``NotAVideo``, ``CorruptVideo`` and
``LimitExceeded``; each limit violation names the limit and the value that broke it.
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

    #: Longest video, by container duration or by the presentation time of any decoded frame.
    max_duration_s: float = Field(default=4 * 3600.0, gt=0)
    #: Largest picture (width x height; 8K UHD by default), checked from the stream parameters
    #: before any frame is decoded (decompression bombs) and again for every decoded frame.
    max_pixels: int = Field(default=7680 * 4320, gt=0)
    #: Most sampled frames per video (rows written), not decoded frames.
    max_frames: int = Field(default=20_000, gt=0)
    #: Longest wall time spent decoding one video (time the consumer holds a frame is not counted).
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


#: Bytes read from the start of a file that FFmpeg can't open, to tell text from damaged media.
_SNIFF_BYTES = 4096

#: Demuxers that read one still image (FFmpeg probes content, not the name: a PNG named .mp4).
_STILL_IMAGE_SUFFIX = "_pipe"


def hms(ts_s: float) -> str:
    total = max(0, int(ts_s))
    return f"{total // 3600:02d}:{total % 3600 // 60:02d}:{total % 60:02d}"


def span(seconds: float) -> str:
    """A duration for people: ``4h``, ``5h02m``, ``2m30s``, ``3s``, ``2.5s``."""
    if seconds < 60:
        return f"{round(seconds, 1):g}s"
    total = int(seconds)
    hours, minutes, secs = total // 3600, total % 3600 // 60, total % 60
    if hours:
        return f"{hours}h{minutes:02d}m" if minutes else f"{hours}h"
    return f"{minutes}m{secs:02d}s" if secs else f"{minutes}m"


def _looks_like_text(path: Path) -> bool:
    with path.open("rb") as f:
        head = f.read(_SNIFF_BYTES)
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        # A multi-byte character cut at the sniff boundary is still text.
        try:
            text = head[:-3].decode("utf-8")
        except UnicodeDecodeError:
            return False
    return bool(text) and all(c.isprintable() or c in "\t\n\r\f" for c in text)


def _check_pixels(width: int, height: int, limits: DecodeLimits) -> None:
    if width * height > limits.max_pixels:
        raise LimitExceeded(f"frame {width}x{height} exceeds max pixels per frame {limits.max_pixels}")


def _scaled_size(width: int, height: int, max_side: int) -> tuple[int, int]:
    scale = min(1.0, max_side / max(width, height))
    # Even dimensions keep swscale's chroma handling exact.
    return max(2, int(width * scale) // 2 * 2), max(2, int(height * scale) // 2 * 2)


def _open(path: Path) -> av.container.InputContainer:
    # FFmpeg reports an empty file as "Invalid data found when processing input"; say what it is.
    if path.is_file() and path.stat().st_size == 0:
        raise CorruptVideo("empty file (0 bytes)")
    try:
        container = av.open(str(path), mode="r", metadata_errors="ignore")
    except av.error.InvalidDataError as exc:
        if path.is_file() and _looks_like_text(path):
            raise NotAVideo("a text file") from exc
        raise CorruptVideo(f"unreadable container: {exc.strerror or exc}") from exc
    except av.error.FFmpegError as exc:
        raise CorruptVideo(f"can't open: {exc.strerror or exc}") from exc
    format_name = container.format.name
    if format_name.endswith(_STILL_IMAGE_SUFFIX):
        container.close()
        raise NotAVideo(f"a still image ({format_name.removesuffix(_STILL_IMAGE_SUFFIX)})")
    # FFmpeg's probes guess some audio or subtitle format for many texts.
    if not container.streams.video and _looks_like_text(path):
        container.close()
        raise NotAVideo("a text file")
    return container


def _info(container: av.container.InputContainer, limits: DecodeLimits) -> tuple[VideoInfo, av.VideoStream]:
    if not container.streams.video:
        if container.streams.audio:
            raise NotAVideo(f"audio only ({container.streams.audio[0].codec_context.name})")
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
    # The codec, not the decoder that FFmpeg picked for it (AV1 decodes with libdav1d).
    codec = ctx.codec.canonical_name if ctx.codec else ctx.name
    info = VideoInfo(duration_s=duration_s, width=width, height=height, codec=codec, fps=fps)
    # From the stream parameters, before a single frame is decoded.
    _check_pixels(width, height, limits)
    if duration_s is not None and duration_s > limits.max_duration_s:
        raise LimitExceeded(f"exceeds max duration {span(limits.max_duration_s)} (video is {span(duration_s)})")
    return info, stream


def _upright_rgb(frame: av.VideoFrame, width: int, height: int) -> NDArray[np.uint8]:
    # rgb24 is uint8 already (no copy); asarray narrows to_ndarray's union type for mypy.
    rgb = np.asarray(frame.to_ndarray(format="rgb24", width=width, height=height), dtype=np.uint8)
    # ``rotation`` is the counter-clockwise turn (a multiple of 90 for every real camera) that
    # displays the frame upright, as np.rot90 turns.
    quarter_turns = round(frame.rotation / 90) % 4
    if quarter_turns:
        rgb = np.ascontiguousarray(np.rot90(rgb, k=quarter_turns))
    return rgb


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

    Frames whose stream carries a display matrix are rotated upright (a portrait phone video yields
    portrait frames), after scaling, so ``max_side`` bounds the longer side either way.
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
                    raise LimitExceeded(f"exceeds max duration {span(limits.max_duration_s)} (a frame at {span(ts)})")
                decode_s = time.monotonic() - started - paused_s
                if decode_s > limits.max_decode_s:
                    raise LimitExceeded(
                        f"exceeds max decode time {span(limits.max_decode_s)} ({span(decode_s)} to reach {hms(ts)})"
                    )
                # A stream may change its picture size mid-way (a bomb behind a small first frame).
                _check_pixels(frame.width, frame.height, limits)
                # A small tolerance absorbs pts rounding: a frame at 3.9999 s is the frame for t = 4.
                if ts + 1e-3 < next_target:
                    continue
                if index >= limits.max_frames:
                    raise LimitExceeded(f"exceeds max frames per video {limits.max_frames} (at {hms(ts)})")
                rgb = _upright_rgb(frame, out_w, out_h)
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
