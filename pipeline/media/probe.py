"""Open a video with PyAV and read its stream facts: what it is (or why it isn't a video), its size,
codec and duration on the player's timeline (``timeline_zero`` says where its zero is), checked
against the decode limits before any frame is decoded. PyAV/FFmpeg exceptions are converted here
into ``NotAVideo``, ``CorruptVideo`` and ``LimitExceeded``.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import av.error

from pipeline.media.settings import DecodeLimits
from storage.errors import CorruptVideo, LimitExceeded, NotAVideo


@dataclass(frozen=True, slots=True)
class VideoInfo:
    duration_s: float | None
    width: int
    height: int
    codec: str
    fps: float | None
    #: Audio and subtitle tracks the container carries (what a text source could read besides pictures);
    #: None: not counted (a text source may then read the video).
    audio_tracks: int | None = None
    subtitle_tracks: int | None = None


#: Bytes read from the start of a file that FFmpeg can't open, to tell text from damaged media.
_SNIFF_BYTES = 4096

#: Demuxers that read one still image (FFmpeg probes content, not the name: a PNG named .mp4).
_STILL_IMAGE_SUFFIX = "_pipe"


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


def check_pixels(width: int, height: int, limits: DecodeLimits) -> None:
    if width * height > limits.max_pixels:
        raise LimitExceeded(f"frame {width}x{height} exceeds max pixels per frame {limits.max_pixels}")


def scaled_size(width: int, height: int, max_side: int) -> tuple[int, int]:
    """The size a ``width`` x ``height`` frame is scaled to: longer side at most ``max_side``, even sides."""
    scale = min(1.0, max_side / max(width, height))
    # Even dimensions keep swscale's chroma handling exact.
    return max(2, int(width * scale) // 2 * 2), max(2, int(height * scale) // 2 * 2)


def open_container(path: Path) -> av.container.InputContainer:
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


#: Containers whose timestamps run on a free-running system clock (MPEG's 90 kHz) with no defined zero.
_FREE_RUNNING_CLOCKS = frozenset({"mpegts", "mpegtsraw", "mpeg"})


def timeline_zero(container: av.container.InputContainer) -> Fraction | None:
    """Where a player's time 0 lies on the container's clock, in seconds (None: at the first frame).

    MP4/MOV, Matroska/WebM, AVI, Ogg have a zero of their own (MP4's is the movie's start, edit lists
    applied by FFmpeg's demuxer: a video track that starts after the audio begins at its empty edit),
    and browsers present video at the demuxed time as it is: Chromium's FFmpeg demuxer never shifts
    video timestamps (a positive start is kept, per the HTML "offsets into the media resource"; a
    negative one shifts audio only). MPEG-TS and MPEG-PS carry a clock that starts anywhere (1.4 s
    after ffmpeg's muxer, any value off a broadcast); their players put 0 at the earliest timestamp
    of the audio and video streams (hls.js over MSE: its ``initPTS`` is the smaller of the two).
    """
    if container.format.name not in _FREE_RUNNING_CLOCKS:
        return Fraction(0)
    starts = [
        s.start_time * s.time_base
        for s in container.streams
        if s.type in ("audio", "video") and s.start_time is not None and s.time_base is not None
    ]
    return min(starts) if starts else None


def _duration_s(container: av.container.InputContainer, zero: Fraction | None) -> float | None:
    """The media's duration on the timeline: from its zero to where its last stream ends (what a
    player reports as ``duration``; sound that outlasts the pictures counts)."""
    if zero is None:
        return None if container.duration is None else container.duration / av.time_base
    ends = [
        (s.start_time + s.duration) * s.time_base
        for s in container.streams
        if s.type in ("audio", "video") and s.start_time is not None and s.duration and s.time_base is not None
    ]
    if container.duration is not None:
        # A duration read from a header (MP4's movie, Matroska's segment) counts from the container's
        # zero; one measured from timestamps (MPEG-TS/PS) from the earliest of them.
        free_running = container.format.name in _FREE_RUNNING_CLOCKS
        start = Fraction(container.start_time or 0, av.time_base) if free_running else Fraction(0)
        ends.append(start + Fraction(container.duration, av.time_base))
    return max(0.0, float(max(ends) - zero)) if ends else None


def stream_info(
    container: av.container.InputContainer, limits: DecodeLimits
) -> tuple[VideoInfo, av.VideoStream, Fraction | None]:
    if not container.streams.video:
        if container.streams.audio:
            raise NotAVideo(f"audio only ({container.streams.audio[0].codec_context.name})")
        raise NotAVideo("no video stream")
    stream = container.streams.video[0]
    ctx = stream.codec_context
    width, height = int(ctx.width or 0), int(ctx.height or 0)
    if width <= 0 or height <= 0:
        raise NotAVideo("the video stream has no picture size")
    zero = timeline_zero(container)
    duration_s = _duration_s(container, zero)
    fps = float(stream.average_rate) if stream.average_rate else None
    # The codec, not the decoder that FFmpeg picked for it (AV1 decodes with libdav1d).
    codec = ctx.codec.canonical_name if ctx.codec else ctx.name
    info = VideoInfo(
        duration_s=duration_s,
        width=width,
        height=height,
        codec=codec,
        fps=fps,
        audio_tracks=len(container.streams.audio),
        subtitle_tracks=len(container.streams.subtitles),
    )
    # From the stream parameters, before a single frame is decoded.
    check_pixels(width, height, limits)
    if duration_s is not None and duration_s > limits.max_duration_s:
        raise LimitExceeded(f"exceeds max duration {span(limits.max_duration_s)} (video is {span(duration_s)})")
    return info, stream, zero


def probe_file(path: Path, limits: DecodeLimits) -> VideoInfo:
    """``pipeline.media.decode.probe``, in this process."""
    with open_container(path) as container:
        return stream_info(container, limits)[0]
