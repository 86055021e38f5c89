"""Generated sample media: videos whose content is known per second (the demo, tests, benchmarks).

Every second of a generated video shows one picture: an 8x6 grid of random colours seeded by
``(seed, second index)``. Pictures of different seconds or seeds differ a lot (mean absolute error
around 85 per channel), all frames within one second are identical, and flat blocks compress well,
so a decoded frame can be matched to the second it came from with ``frame_at`` and ``mae``.
"""

from __future__ import annotations

import io
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from numpy.typing import NDArray
from PIL import Image

#: Grid of flat colour blocks drawn for each second (columns, rows).
GRID = (8, 6)

#: Encoder options that keep generation fast; codecs not listed use FFmpeg's defaults.
_FAST_OPTIONS: dict[str, dict[str, str]] = {
    "libx264": {"preset": "ultrafast"},
    # x265 reads its own log level from x265-params, not from FFmpeg's options.
    "libx265": {"preset": "ultrafast", "x265-params": "log-level=error"},
    "libsvtav1": {"preset": "12"},
    "libvpx": {"deadline": "realtime", "cpu-used": "8"},
    "libvpx-vp9": {"deadline": "realtime", "cpu-used": "8"},
}

#: Bit rates for encoders without a constant-quality default: FFmpeg's 200 kb/s blurs scene cuts.
_BIT_RATES: dict[str, int] = {"mpeg4": 2_000_000, "mpeg2video": 2_000_000, "mpeg1video": 2_000_000}

#: An encoder that suits each container suffix, all present in the pinned PyAV wheel.
#: Use: ``write_video(p, codec=VIDEO_FORMATS[p.suffix])``.
VIDEO_FORMATS: dict[str, str] = {
    ".mp4": "libx264",
    ".mkv": "libx264",
    ".mov": "libx264",
    ".avi": "mpeg4",
    ".webm": "libvpx-vp9",
    ".ts": "mpeg2video",
    ".mpg": "mpeg2video",
}


@dataclass(frozen=True, slots=True)
class VideoFormat:
    """One container/codec combination of the bad-input matrix, and the codec a decoder reports."""

    suffix: str
    encoder: str
    codec: str
    pix_fmt: str = "yuv420p"


#: Every format vidx must index, by name; all encoders are in the pinned PyAV wheel.
MATRIX_FORMATS: dict[str, VideoFormat] = {
    "h264-mp4": VideoFormat(".mp4", "libx264", "h264"),
    "h264-mkv": VideoFormat(".mkv", "libx264", "h264"),
    "h264-mov": VideoFormat(".mov", "libx264", "h264"),
    "hevc10-mp4": VideoFormat(".mp4", "libx265", "hevc", "yuv420p10le"),
    "hevc10-mkv": VideoFormat(".mkv", "libx265", "hevc", "yuv420p10le"),
    "av1-mp4": VideoFormat(".mp4", "libsvtav1", "av1"),
    "av1-webm": VideoFormat(".webm", "libsvtav1", "av1"),
    "vp8-webm": VideoFormat(".webm", "libvpx", "vp8"),
    "vp9-webm": VideoFormat(".webm", "libvpx-vp9", "vp9"),
    "mpeg2-mpg": VideoFormat(".mpg", "mpeg2video", "mpeg2video"),
    "mpeg2-ts": VideoFormat(".ts", "mpeg2video", "mpeg2video"),
    "mpeg4-avi": VideoFormat(".avi", "mpeg4", "mpeg4"),
}

#: Picture for output frame ``i`` at presentation time ``ts_s``: (i, ts_s) -> RGB.
_Painter = Callable[[int, float], NDArray[np.uint8]]


#: Muxers for ``write_video(..., seekable=False)``, which can't infer the format from a file name.
_STREAM_FORMATS = {".mkv": "matroska", ".webm": "webm", ".ts": "mpegts"}


class _NonSeekable(io.RawIOBase):
    """A write-only sink that can't seek, like a pipe: muxers leave out duration and index."""

    def __init__(self, raw: io.BufferedWriter) -> None:
        super().__init__()
        self._raw = raw

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data: bytes) -> int:  # type: ignore[override]
        return self._raw.write(data)


def frame_at(seconds_index: int, seed: int, size: tuple[int, int] = (160, 120)) -> NDArray[np.uint8]:
    """The RGB picture (height x width x 3) drawn for second ``seconds_index`` of a video made with
    ``seed``, before compression. ``size`` is (width, height)."""
    width, height = size
    cols, rows = GRID
    rng = np.random.default_rng([seed, seconds_index])
    colours = rng.integers(0, 256, size=(rows, cols, 3), dtype=np.uint8)
    row_of_y = np.arange(height) * rows // height
    col_of_x = np.arange(width) * cols // width
    return np.ascontiguousarray(colours[row_of_y[:, None], col_of_x[None, :]])


def mae(a: NDArray[np.uint8], b: NDArray[np.uint8]) -> float:
    """Mean absolute error between two images of the same shape, per channel value (0-255)."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    return float(np.mean(np.abs(a.astype(np.int16) - b.astype(np.int16))))


def write_video(
    path: Path,
    *,
    seconds: float,
    fps: int = 10,
    size: tuple[int, int] = (160, 120),
    codec: str = "libx264",
    seed: int = 0,
    gop: int | None = None,
    pix_fmt: str = "yuv420p",
    seekable: bool = True,
    rotation: int = 0,
) -> Path:
    """Encode ``round(seconds * fps)`` frames; frame i shows ``frame_at(i // fps, seed, size)``.

    The container is inferred from the suffix (.mp4, .mkv, .mov, .avi, .webm, .ts, .mpg, ...).
    ``gop`` is the keyframe interval in frames (None: the encoder's default). ``seekable=False``
    writes through a pipe-like sink (.mkv, .webm, .ts only), so the container carries no duration.
    ``rotation`` (a multiple of 90, counter-clockwise) stores the pictures turned the other way with
    a display matrix that turns them back, like a phone held upright: ``size`` is the upright size.
    Returns ``path``.

    Raises:
        ValueError: no frame to write (``seconds * fps`` rounds to 0), ``seekable=False`` with a
            suffix that has no streaming muxer here, or a rotation that isn't a multiple of 90.
    """
    n_frames = round(seconds * fps)
    if n_frames <= 0:
        raise ValueError("seconds * fps must give at least one frame")
    pictures = [frame_at(second, seed, size) for second in range(math.ceil(n_frames / fps))]
    return _write(
        path,
        [Fraction(i, fps) for i in range(n_frames)],
        lambda i, _ts: pictures[i // fps],
        fps=fps,
        size=size,
        codec=codec,
        gop=gop,
        pix_fmt=pix_fmt,
        seekable=seekable,
        rotation=rotation,
    )


def write_timed_video(
    path: Path,
    times_s: Sequence[float],
    *,
    size: tuple[int, int] = (160, 120),
    codec: str = "libx264",
    seed: int = 0,
) -> Path:
    """Encode one frame per presentation time in ``times_s`` (strictly increasing, from 0, on a
    millisecond clock); the frame at t shows ``frame_at(floor(t), seed, size)``. Irregular times
    make a variable-frame-rate video; sparse ones a long low-fps video. Returns ``path``.

    Raises:
        ValueError: no times, or times that don't increase.
    """
    ticks = [Fraction(round(t * 1000), 1000) for t in times_s]
    if not ticks or any(b <= a for a, b in itertools.pairwise(ticks)):
        raise ValueError("times_s must be non-empty and strictly increasing (1 ms apart at least)")
    pictures: dict[int, NDArray[np.uint8]] = {}

    def paint(_i: int, ts_s: float) -> NDArray[np.uint8]:
        second = math.floor(ts_s + 1e-9)
        if second not in pictures:
            pictures[second] = frame_at(second, seed, size)
        return pictures[second]

    # The stream's nominal rate only sets the encoder's rate control; times come from the pts.
    return _write(path, ticks, paint, fps=1000, size=size, codec=codec, time_base=Fraction(1, 1000))


def write_textured_video(
    path: Path,
    *,
    seconds: float,
    fps: int = 30,
    size: tuple[int, int] = (160, 120),
    gop_s: float = 2.0,
    codec: str = "libx264",
    preset: str = "superfast",
    seed: int = 0,
    times_s: Sequence[float] | None = None,
    seekable: bool = True,
    options: dict[str, str] | None = None,
) -> Path:
    """A video like a camera's, for decode benchmarks and for checking decoders frame by frame: a
    textured picture (soft blobs under fine grain) panning a few pixels a frame, so every frame
    differs from its neighbours and nothing compresses away; encoded with a keyframe every ``gop_s``
    seconds and B-frames (x264/x265 ``preset``; ``superfast`` keeps CABAC, deblocking and three
    B-frames, as real H.264 has, while encoding quickly).

    ``times_s`` (strictly increasing, from 0, millisecond clock) makes a variable-frame-rate video
    with those presentation times instead of ``seconds * fps`` regular ones; ``seekable=False`` writes
    through a pipe-like sink (.mkv, .webm, .ts: no duration, no index). ``options`` are passed to
    the encoder in place of the preset. Returns ``path``.

    Raises:
        ValueError: no frame to write, times that don't increase, or an unstreamable suffix.
    """
    width, height = size
    rng = np.random.default_rng(seed)
    blobs = rng.integers(0, 256, size=(max(2, height // 24), max(2, width // 24), 3), dtype=np.uint8)
    # Twice the frame in each direction, so a pan is a slice (no copy).
    soft = np.asarray(Image.fromarray(blobs).resize((width, height), Image.Resampling.BILINEAR))
    grain = rng.integers(-24, 25, size=(height, width, 3), dtype=np.int16)
    # Tiled, so the pan wraps around without a cut (which the encoder would answer with a keyframe).
    texture = np.tile(np.clip(soft.astype(np.int16) + grain, 0, 255).astype(np.uint8), (2, 2, 1))

    def paint(i: int, _ts: float) -> NDArray[np.uint8]:
        x0, y0 = (3 * i) % width, (2 * i) % height
        return np.ascontiguousarray(texture[y0 : y0 + height, x0 : x0 + width])

    if times_s is None:
        n_frames = round(seconds * fps)
        if n_frames <= 0:
            raise ValueError("seconds * fps must give at least one frame")
        times = [Fraction(i, fps) for i in range(n_frames)]
        time_base = Fraction(1, fps)
        rate = fps
    else:
        times = [Fraction(round(t * 1000), 1000) for t in times_s]
        if not times or any(b <= a for a, b in itertools.pairwise(times)):
            raise ValueError("times_s must be non-empty and strictly increasing (1 ms apart at least)")
        time_base = Fraction(1, 1000)
        # The nominal rate only sets the encoder's rate control (and, with B-frames, its dts step).
        rate = 1000
    if options is None:
        options = {"preset": preset}
        if codec == "libx265":
            options["x265-params"] = "log-level=error"
    return _write(
        path,
        times,
        paint,
        fps=rate,
        size=size,
        codec=codec,
        # In frames; at the mean frame rate for a variable one.
        gop=max(1, round(gop_s * (fps if times_s is None else len(times) / max(float(times[-1]), 1 / fps)))),
        seekable=seekable,
        time_base=time_base,
        options=options,
    )


def write_large_video(path: Path, *, min_bytes: int, seed: int = 0, size: tuple[int, int] = (320, 240)) -> Path:
    """A lossless H.264 video of at least ``min_bytes`` (for multipart uploads): 10 fps, second s
    shows ``frame_at(s, seed, size)`` under fresh noise of +-12 per frame so nothing compresses away
    (a decoded frame stays within MAE 8 of its picture). Returns ``path``.
    """
    width, height = size
    # About 0.3 bytes per noisy channel value survive lossless compression; 0.25 leaves some slack.
    n_frames = max(10, math.ceil(min_bytes / (width * height * 3 * 0.25)))
    fps = 10
    rng = np.random.default_rng(seed)

    def paint(i: int, _ts: float) -> NDArray[np.uint8]:
        noise = rng.integers(-12, 13, size=(height, width, 3), dtype=np.int16)
        return np.clip(frame_at(i // fps, seed, size).astype(np.int16) + noise, 0, 255).astype(np.uint8)

    _write(
        path,
        [Fraction(i, fps) for i in range(n_frames)],
        paint,
        fps=fps,
        size=size,
        codec="libx264",
        options={"preset": "ultrafast", "qp": "0"},
    )
    if path.stat().st_size < min_bytes:
        raise AssertionError(f"{path} came out at {path.stat().st_size} bytes, under {min_bytes}")
    return path


def _write(
    path: Path,
    times: Sequence[Fraction],
    paint: _Painter,
    *,
    fps: int,
    size: tuple[int, int],
    codec: str,
    gop: int | None = None,
    pix_fmt: str = "yuv420p",
    seekable: bool = True,
    rotation: int = 0,
    time_base: Fraction | None = None,
    options: dict[str, str] | None = None,
) -> Path:
    if not seekable and path.suffix not in _STREAM_FORMATS:
        raise ValueError(f"seekable=False needs one of {sorted(_STREAM_FORMATS)}")
    if rotation % 90:
        raise ValueError("rotation must be a multiple of 90 degrees")
    path.parent.mkdir(parents=True, exist_ok=True)
    encode = _Encode(
        times=times,
        paint=paint,
        fps=fps,
        size=size,
        codec=codec,
        gop=gop,
        pix_fmt=pix_fmt,
        rotation=rotation,
        time_base=time_base or Fraction(1, fps),
        options=options if options is not None else _FAST_OPTIONS.get(codec, {}),
    )
    if seekable:
        encode(str(path), None)
    else:
        with path.open("wb") as raw:
            encode(_NonSeekable(raw), _STREAM_FORMATS[path.suffix])
    return path


@dataclass(frozen=True, slots=True)
class _Encode:
    times: Sequence[Fraction]
    paint: _Painter
    fps: int
    size: tuple[int, int]
    codec: str
    gop: int | None
    pix_fmt: str
    rotation: int
    time_base: Fraction
    options: dict[str, str]

    def __call__(self, target: str | io.RawIOBase, format_name: str | None) -> None:
        # Stored pictures are turned clockwise by ``rotation``; the display matrix turns them back.
        turns = -(self.rotation // 90)
        width, height = self.size if turns % 2 == 0 else self.size[::-1]
        with av.open(target, mode="w", format=format_name) as container:
            stream = container.add_stream(self.codec, rate=self.fps, options=self.options)
            assert isinstance(stream, av.VideoStream), f"{self.codec} is not a video encoder"
            stream.width = width
            stream.height = height
            stream.pix_fmt = self.pix_fmt
            stream.time_base = self.time_base
            if self.rotation:
                stream.set_display_rotation(self.rotation)
            if self.codec in _BIT_RATES:
                stream.bit_rate = _BIT_RATES[self.codec]
            if self.gop is not None:
                stream.codec_context.gop_size = self.gop
            # A painter that hands back the same picture for consecutive frames (a still second) has it
            # converted once: the encoder keeps its own reference to a sent frame's pictures.
            last: tuple[NDArray[np.uint8], av.VideoFrame] | None = None
            for i, ts in enumerate(self.times):
                picture = self.paint(i, float(ts))
                if last is not None and last[0] is picture:
                    frame = last[1]
                else:
                    upright = np.ascontiguousarray(np.rot90(picture, k=turns)) if turns % 4 else picture
                    frame = av.VideoFrame.from_ndarray(upright, format="rgb24").reformat(format=self.pix_fmt)
                    last = (picture, frame)
                frame.pts = int(ts / self.time_base)
                frame.time_base = self.time_base
                container.mux(stream.encode(frame))
            container.mux(stream.encode(None))


def expected_sample_count(seconds: float, fps: int, every_s: float) -> int:
    """How many samples ``sample_frames`` should yield for a ``write_video`` output: one per target
    time ``k * every_s`` up to the last frame, i.e. ``ceil(duration / every_s)`` when fps >= 1/every_s."""
    n_frames = round(seconds * fps)
    last_ts = (n_frames - 1) / fps
    targets = math.floor(last_ts / every_s + 1e-9) + 1
    # A low-fps video has fewer frames than targets; each frame is yielded at most once.
    return min(targets, n_frames)


def write_corrupt_mp4(path: Path, *, seed: int = 0, size_bytes: int = 4096) -> Path:
    """A file that starts like an MP4 (a valid ``ftyp`` box) followed by random bytes, no ``moov``."""
    ftyp = b"ftypisom" + (512).to_bytes(4, "big") + b"isomiso2avc1mp41"
    header = (len(ftyp) + 4).to_bytes(4, "big") + ftyp
    garbage = np.random.default_rng(seed).integers(0, 256, size=size_bytes, dtype=np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header + garbage)
    return path


def write_truncated(source: Path, path: Path, *, keep_fraction: float = 0.5) -> Path:
    """Copy the first ``keep_fraction`` of ``source``'s bytes to ``path`` (a cut-off upload)."""
    data = source.read_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data[: int(len(data) * keep_fraction)])
    return path


def write_audio_only(path: Path, *, seconds: float = 1.0, rate: int = 16_000) -> Path:
    """An audio-only file: a 440 Hz tone, AAC in .m4a/.mp4/.mkv, or PCM in .wav."""
    codec = "pcm_s16le" if path.suffix == ".wav" else "aac"
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=rate, layout="mono")
        assert isinstance(stream, av.AudioStream)
        frame_size = stream.codec_context.frame_size or 1024
        n_samples = round(seconds * rate)
        tone = 0.3 * np.sin(2 * np.pi * 440.0 * np.arange(n_samples) / rate)
        for start in range(0, n_samples, frame_size):
            chunk = tone[None, start : start + frame_size]
            if codec == "pcm_s16le":
                frame = av.AudioFrame.from_ndarray((chunk * 32767).astype(np.int16), format="s16", layout="mono")
            else:
                frame = av.AudioFrame.from_ndarray(chunk.astype(np.float32), format="fltp", layout="mono")
            frame.sample_rate = rate
            frame.pts = start
            frame.time_base = Fraction(1, rate)
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def write_no_streams_mp4(path: Path) -> Path:
    """A well-formed MP4 that holds no stream at all: an ``ftyp`` box and a ``moov`` with only its
    movie header (FFmpeg's muxer refuses to write one, so the boxes are written here)."""

    def box(kind: bytes, payload: bytes) -> bytes:
        return (8 + len(payload)).to_bytes(4, "big") + kind + payload

    ftyp = box(b"ftyp", b"isom" + (512).to_bytes(4, "big") + b"isomiso2mp41")
    # mvhd v0: flags, times, timescale 1000, duration 0, rate 1.0, volume 1.0, identity matrix, next id.
    matrix = b"".join(v.to_bytes(4, "big") for v in (0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000))
    mvhd = box(
        b"mvhd",
        bytes(4)
        + bytes(8)
        + (1000).to_bytes(4, "big")
        + bytes(4)
        + (0x10000).to_bytes(4, "big")
        + (0x100).to_bytes(2, "big")
        + bytes(10)
        + matrix
        + bytes(24)
        + (1).to_bytes(4, "big"),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(ftyp + box(b"moov", mvhd))
    return path


def write_still_image(path: Path, *, image_format: str = "PNG", seed: int = 0) -> Path:
    """A still image in ``image_format`` (PNG, JPEG, ...) whatever the suffix of ``path`` says."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(frame_at(0, seed)).save(path, format=image_format)
    return path


def write_pixel_bomb(path: Path, *, size: tuple[int, int] = (8000, 8000), seconds: int = 1) -> Path:
    """A decompression bomb: one flat black H.264 frame per second at ``size`` (8000x8000 by default,
    64 Mpixels, over 8K UHD), a couple of hundred kilobytes on disk. Returns ``path``."""
    width, height = size
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=1, options=_FAST_OPTIONS["libx264"])
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        # Filled planes directly: drawing and converting 64 Mpixels of RGB would take seconds.
        frame = av.VideoFrame(width, height, "yuv420p")
        for plane in frame.planes:
            plane.update(bytes(plane.buffer_size))
        for second in range(seconds):
            frame.pts = second
            frame.time_base = Fraction(1, 1)
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path
