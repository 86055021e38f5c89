"""Generated sample media: videos whose content is known per second (the demo, tests, benchmarks).

Every second of a generated video shows one picture: an 8x6 grid of random colours seeded by
``(seed, second index)``. Pictures of different seconds or seeds differ a lot (mean absolute error
around 85 per channel), all frames within one second are identical, and flat blocks compress well,
so a decoded frame can be matched to the second it came from with ``frame_at`` and ``mae``.
"""

from __future__ import annotations

import io
import math
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from numpy.typing import NDArray

#: Grid of flat colour blocks drawn for each second (columns, rows).
GRID = (8, 6)

#: Encoder options that keep generation fast; codecs not listed use FFmpeg's defaults.
_FAST_OPTIONS: dict[str, dict[str, str]] = {
    "libx264": {"preset": "ultrafast"},
    "libx265": {"preset": "ultrafast", "log-level": "error"},
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
}


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
) -> Path:
    """Encode ``round(seconds * fps)`` frames; frame i shows ``frame_at(i // fps, seed, size)``.

    The container is inferred from the suffix (.mp4, .mkv, .mov, .avi, .webm, .ts, ...). ``gop`` is
    the keyframe interval in frames (None: the encoder's default). ``seekable=False`` writes through
    a pipe-like sink (.mkv, .webm, .ts only), so the container carries no duration. Returns ``path``.

    Raises:
        ValueError: no frame to write (``seconds * fps`` rounds to 0), or ``seekable=False`` with a
            suffix that has no streaming muxer here.
    """
    n_frames = round(seconds * fps)
    if n_frames <= 0:
        raise ValueError("seconds * fps must give at least one frame")
    if not seekable and path.suffix not in _STREAM_FORMATS:
        raise ValueError(f"seekable=False needs one of {sorted(_STREAM_FORMATS)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if seekable:
        _encode(str(path), None, n_frames, fps, size, codec, seed, gop, pix_fmt)
    else:
        with path.open("wb") as raw:
            sink = _NonSeekable(raw)
            _encode(sink, _STREAM_FORMATS[path.suffix], n_frames, fps, size, codec, seed, gop, pix_fmt)
    return path


def _encode(
    target: str | io.RawIOBase,
    format_name: str | None,
    n_frames: int,
    fps: int,
    size: tuple[int, int],
    codec: str,
    seed: int,
    gop: int | None,
    pix_fmt: str,
) -> None:
    width, height = size
    with av.open(target, mode="w", format=format_name) as container:
        stream = container.add_stream(codec, rate=fps, options=_FAST_OPTIONS.get(codec, {}))
        assert isinstance(stream, av.VideoStream), f"{codec} is not a video encoder"
        stream.width = width
        stream.height = height
        stream.pix_fmt = pix_fmt
        stream.time_base = Fraction(1, fps)
        if codec in _BIT_RATES:
            stream.bit_rate = _BIT_RATES[codec]
        if gop is not None:
            stream.codec_context.gop_size = gop
        pictures = [frame_at(second, seed, size) for second in range(math.ceil(n_frames / fps))]
        for i in range(n_frames):
            frame = av.VideoFrame.from_ndarray(pictures[i // fps], format="rgb24").reformat(format=pix_fmt)
            frame.pts = i
            frame.time_base = Fraction(1, fps)
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
