"""Test media: the generators live in ``infra.dev.samples`` (the demo and benchmarks use them too);
the ones only tests need (late-starting streams, MP4 edit lists, EXIF-oriented images) are here."""

from __future__ import annotations

import io
import math
import struct
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from numpy.typing import NDArray
from PIL import Image

from infra.dev.samples import (
    MATRIX_FORMATS,
    VIDEO_FORMATS,
    VideoFormat,
    expected_sample_count,
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

__all__ = [
    "MATRIX_FORMATS",
    "ORIENTATIONS",
    "VIDEO_FORMATS",
    "VideoFormat",
    "expected_sample_count",
    "frame_at",
    "mae",
    "mp4_edit_lists",
    "oriented_image",
    "write_audio_only",
    "write_corrupt_mp4",
    "write_large_video",
    "write_late_video",
    "write_no_streams_mp4",
    "write_pixel_bomb",
    "write_still_image",
    "write_timed_video",
    "write_truncated",
    "write_video",
]

_AUDIO_RATE = 16_000
#: Containers ``write_late_video`` writes, and their audio codec.
_LATE_AUDIO = {".mp4": "aac", ".mov": "aac", ".mkv": "aac", ".ts": "mp2"}


def write_late_video(
    path: Path,
    *,
    video_start_s: float,
    video_s: float = 3.0,
    audio_s: float | None = None,
    clock_s: float = 0.0,
    fps: int = 10,
    size: tuple[int, int] = (160, 120),
    seed: int = 0,
) -> Path:
    """A video with sound whose picture starts after its sound: audio (a tone) from time 0 to
    ``audio_s`` (default: half a second past the video), H.264 video from ``video_start_s`` for
    ``video_s`` seconds. A player's timeline starts with the audio, so the frame it shows at time t
    is drawn as ``frame_at(floor(t), seed, size)``: the frame drawn for second 3 is where a player
    shows second 3. ``clock_s`` (MPEG-TS only) is the value of the stream clock at time 0: every
    timestamp in the file is that much later (ffmpeg's muxer starts at 1.4 s, broadcasts anywhere).
    In MP4/MOV the late start is an edit list (an empty edit before the video). Returns ``path``.

    Raises:
        ValueError: a suffix other than .mp4, .mov, .mkv or .ts, or ``clock_s`` outside MPEG-TS.
    """
    if path.suffix not in _LATE_AUDIO:
        raise ValueError(f"write_late_video writes {sorted(_LATE_AUDIO)}, not {path.suffix}")
    if clock_s and path.suffix != ".ts":
        raise ValueError("clock_s is the MPEG-TS clock; other containers start at 0")
    audio_s = video_start_s + video_s + 0.5 if audio_s is None else audio_s
    video_tb = Fraction(1, 1000)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        audio = container.add_stream(_LATE_AUDIO[path.suffix], rate=_AUDIO_RATE, layout="mono")
        video = container.add_stream("libx264", rate=fps, options={"preset": "ultrafast"})
        assert isinstance(audio, av.AudioStream) and isinstance(video, av.VideoStream)
        video.width, video.height, video.pix_fmt = size[0], size[1], "yuv420p"
        # The encoder's clock too: at its default (1/fps) a start off the frame grid would be rounded.
        video.time_base = video.codec_context.time_base = video_tb
        packets = list(_tone_packets(audio, audio_s, clock_s))
        pictures: dict[int, NDArray[np.uint8]] = {}
        for i in range(round(video_s * fps)):
            t = Fraction(round(video_start_s * 1000), 1000) + Fraction(i, fps)
            second = math.floor(t)
            if second not in pictures:
                pictures[second] = frame_at(second, seed, size)
            frame = av.VideoFrame.from_ndarray(pictures[second], format="rgb24").reformat(format="yuv420p")
            frame.pts = round((t + Fraction(clock_s)) / video_tb)
            frame.time_base = video_tb
            packets.extend(video.encode(frame))
        packets.extend(video.encode(None))
        # In decode order across both streams, as a muxer expects them.
        packets.sort(key=lambda p: (p.dts if p.dts is not None else p.pts or 0) * p.time_base)
        for packet in packets:
            container.mux(packet)
    return path


def _tone_packets(stream: av.AudioStream, seconds: float, clock_s: float) -> Iterator[av.Packet]:
    """Encoded packets of a 440 Hz tone, the first one stamped exactly at ``clock_s``."""
    codec = stream.codec_context
    frame_size = codec.frame_size or 1152
    n_samples = round(seconds * _AUDIO_RATE)
    tone = (0.3 * np.sin(2 * np.pi * 440.0 * np.arange(n_samples) / _AUDIO_RATE)).astype(np.float32)
    fmt = codec.format.name if codec.format else "fltp"
    encoded: list[av.Packet] = []
    for start in range(0, n_samples, frame_size):
        chunk = tone[None, start : start + frame_size]
        if fmt == "s16":
            chunk = (chunk * 32767).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(chunk, format=fmt, layout="mono")
        frame.sample_rate = _AUDIO_RATE
        frame.pts = start
        frame.time_base = Fraction(1, _AUDIO_RATE)
        encoded.extend(stream.encode(frame))
    encoded.extend(stream.encode(None))
    # Restamped one frame after another from the clock's start: the encoder's own stamps begin
    # before 0 by its priming delay, which a muxer would shift everything by.
    first = round(clock_s * _AUDIO_RATE)
    for i, packet in enumerate(encoded):
        packet.pts = packet.dts = first + i * frame_size
        packet.time_base = Fraction(1, _AUDIO_RATE)
        yield packet


def mp4_edit_lists(path: Path) -> dict[str, list[tuple[float, float | None]]]:
    """Each track's edit list in an MP4/MOV, by handler (``vide``, ``soun``): (duration in seconds on
    the movie timeline, start in seconds of the track's media, or None for an empty edit)."""
    data = path.read_bytes()
    moov = next(body for kind, body in _boxes(data) if kind == b"moov")
    mvhd = next(body for kind, body in _boxes(moov) if kind == b"mvhd")
    movie_scale = _timescale(mvhd)
    found: dict[str, list[tuple[float, float | None]]] = {}
    for kind, trak in _boxes(moov):
        if kind != b"trak":
            continue
        children = dict(_boxes(trak))
        mdia = dict(_boxes(children[b"mdia"]))
        handler = mdia[b"hdlr"][8:12].decode()
        media_scale = _timescale(mdia[b"mdhd"])
        edits: list[tuple[float, float | None]] = []
        if b"edts" in children:
            elst = dict(_boxes(children[b"edts"]))[b"elst"]
            version, count = elst[0], struct.unpack(">I", elst[4:8])[0]
            entry = struct.Struct(">QqI" if version == 1 else ">IiI")
            for i in range(count):
                duration, media_time, _rate = entry.unpack_from(elst, 8 + i * entry.size)
                edits.append((duration / movie_scale, None if media_time == -1 else media_time / media_scale))
        found[handler] = edits
    return found


def _boxes(data: bytes) -> Iterator[tuple[bytes, bytes]]:
    offset = 0
    while offset + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[offset : offset + 8])
        header = 8
        if size == 1:
            size, header = struct.unpack(">Q", data[offset + 8 : offset + 16])[0], 16
        elif size == 0:
            size = len(data) - offset
        yield kind, data[offset + header : offset + size]
        offset += size


def _timescale(full_box: bytes) -> int:
    # mvhd/mdhd: version, flags, then creation and modification times (4 or 8 bytes each), timescale.
    at = 20 if full_box[0] == 1 else 12
    return int(struct.unpack(">I", full_box[at : at + 4])[0])


#: EXIF orientation -> the stored picture made from the upright one (viewers turn it back).
ORIENTATIONS: dict[int, Callable[[NDArray[np.uint8]], NDArray[np.uint8]]] = {
    1: lambda a: a,
    2: np.fliplr,
    3: lambda a: np.rot90(a, 2),
    4: np.flipud,
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, 1),  # "rotate 90 CW to view": stored turned counter-clockwise
    7: lambda a: np.rot90(a, 2).transpose(1, 0, 2),
    8: lambda a: np.rot90(a, -1),
}


def oriented_image(upright: NDArray[np.uint8], orientation: int, image_format: str = "PNG") -> bytes:
    """``upright`` as a phone stores it: the pixels turned per EXIF ``orientation``, and the EXIF tag
    that tells viewers how to turn them back; encoded as ``image_format`` (PNG and WebP keep the
    pixels exactly)."""
    stored = np.ascontiguousarray(ORIENTATIONS[orientation](upright))
    exif = Image.Exif()
    exif[0x0112] = orientation  # Orientation
    out = io.BytesIO()
    options: dict[str, object] = {"lossless": True} if image_format == "WEBP" else {}
    if image_format == "JPEG":
        options = {"quality": 95}
    Image.fromarray(stored).save(out, format=image_format, exif=exif, **options)
    return out.getvalue()
