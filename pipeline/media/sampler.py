"""Decode a video with PyAV in this process and sample its frames (``Sampling``: one every ``every_s``
seconds of the player's timeline, ``pipeline.media.probe`` says where its zero is). Only sampled
frames are converted to RGB, scaled down in swscale (decoder side) rather than in Python; frames
carrying a display matrix (phone videos) are turned upright. Each limit violation names the limit
and the value that broke it. ``pipeline.media.decode`` runs this in a worker process.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import cast

import av
import av.error
import numpy as np
from av.video.reformatter import VideoReformatter
from numpy.typing import NDArray

from pipeline.media.probe import VideoInfo, check_pixels, open_container, scaled_size, span, stream_info
from pipeline.media.settings import DecodeLimits, DecodeStrategy
from storage.errors import CorruptVideo, LimitExceeded
from storage.sampling import Sampling, hms


@dataclass(frozen=True, slots=True)
class SampledFrame:
    """One sampled frame: its index in the sample sequence, its presentation time, RGB pixels."""

    index: int
    ts_s: float
    rgb: NDArray[np.uint8]


def _upright_rgb(frame: av.VideoFrame, reformatter: VideoReformatter, width: int, height: int) -> NDArray[np.uint8]:
    # One reformatter for all of a video's frames: its scaler is set up once, not per frame.
    scaled = reformatter.reformat(frame, width, height, "rgb24")
    # rgb24 is uint8 already (no copy); asarray narrows to_ndarray's union type for mypy.
    rgb = np.asarray(scaled.to_ndarray(), dtype=np.uint8)
    # ``rotation`` is the counter-clockwise turn (a multiple of 90 for every real camera) that
    # displays the frame upright, as np.rot90 turns.
    quarter_turns = round(frame.rotation / 90) % 4
    if quarter_turns:
        rgb = np.ascontiguousarray(np.rot90(rgb, k=quarter_turns))
    return rgb


@dataclass(slots=True)
class DecodeStats:
    """What one ``sample_frames`` call did, filled in when it ends or fails (benchmarks, tests, logs)."""

    packets: int = 0
    #: Frames the decoder produced (sampled or not); skipped frames aren't counted.
    frames_decoded: int = 0
    #: GOPs decoded after a plan (only up to their last sample) and GOPs skipped whole.
    gops_planned: int = 0
    gops_skipped: int = 0
    #: The packets didn't allow a plan from some point on, and decoding went on sequentially.
    fell_back: bool = False
    #: CPU seconds (all threads) the decode took in its worker process; 0 when decoded in-process.
    worker_cpu_s: float = 0.0


#: Decoder threads for ``threads=0`` by strategy (absent: FFmpeg's choice). A sparse decode is a chain
#: from each keyframe (mostly the keyframe itself): frame threads add CPU time and barely shorten it,
#: and videos are decoded side by side by the consumers anyway.
_SPARSE_THREADS = {DecodeStrategy.AUTO: 1, DecodeStrategy.SAMPLED: 1, DecodeStrategy.KEYFRAMES: 1}

#: Codecs whose decoders skip non-reference frames exactly (``skip_frame = NONREF``).
_NONREF_SKIP_CODECS = frozenset({"h264", "hevc"})

#: A frame at 3.9999 s is the frame for t = 4: pts rounding.
_TS_TOLERANCE_S = 1e-3


class _Sampler:
    """The state of one ``sample_frames`` call: targets, limits, time, and the frames picked."""

    def __init__(
        self,
        sampling: Sampling,
        limits: DecodeLimits,
        time_base: Fraction,
        zero: Fraction | None,
        out_size: tuple[int, int],
        stats: DecodeStats,
    ) -> None:
        self.stats = stats
        self.every_s = sampling.every_s
        self.limits = limits
        self.time_base = time_base
        #: The timeline's zero in seconds of the stream's clock; None until the first frame sets it.
        self.zero = zero
        self.out_w, self.out_h = out_size
        self.reformatter = VideoReformatter()
        self.started = time.monotonic()
        # Time the consumer spends between frames (embedding, thumbnails) is not decode time.
        self.paused_s = 0.0
        self.next_target = 0.0
        self.index = 0
        self.last_ts = 0.0
        #: Planned pts of frames to yield; frames up to ``planned_until`` not in it are dropped.
        self.wanted: set[int] = set()
        self.planned_until: int | None = None

    def ts(self, pts: int) -> float:
        """The time on the timeline of a frame presented at ``pts``."""
        if self.zero is None:
            self.zero = pts * self.time_base
        return float(pts * self.time_base - self.zero)

    def check_time(self, ts: float) -> None:
        decode_s = time.monotonic() - self.started - self.paused_s
        if decode_s > self.limits.max_decode_s:
            raise LimitExceeded(
                f"exceeds max decode time {span(self.limits.max_decode_s)} ({span(decode_s)} to reach {hms(ts)})"
            )

    def take(self, ts: float) -> bool:
        """Whether the frame at ``ts`` is the next sample; if so, move the target past it."""
        if ts + _TS_TOLERANCE_S < self.next_target:
            return False
        while self.next_target <= ts + _TS_TOLERANCE_S:
            self.next_target += self.every_s
        return True

    def frames(self, decoded: list[av.VideoFrame]) -> Iterator[SampledFrame]:
        """Check each decoded frame against the limits and yield the sampled ones."""
        self.stats.frames_decoded += len(decoded)
        for frame in decoded:
            if frame.pts is None:
                continue
            ts = self.ts(frame.pts)
            self.last_ts = ts
            if ts > self.limits.max_duration_s:
                raise LimitExceeded(f"exceeds max duration {span(self.limits.max_duration_s)} (a frame at {span(ts)})")
            self.check_time(ts)
            # A stream may change its picture size mid-way (a bomb behind a small first frame).
            check_pixels(frame.width, frame.height, self.limits)
            if self.planned_until is not None and frame.pts <= self.planned_until:
                if frame.pts not in self.wanted:
                    continue
                self.wanted.discard(frame.pts)
            elif not self.take(ts):
                continue
            if self.index >= self.limits.max_frames:
                raise LimitExceeded(f"exceeds max frames per video {self.limits.max_frames} (at {hms(ts)})")
            rgb = _upright_rgb(frame, self.reformatter, self.out_w, self.out_h)
            handed_over = time.monotonic()
            yield SampledFrame(index=self.index, ts_s=round(ts, 3), rgb=rgb)
            self.paused_s += time.monotonic() - handed_over
            self.index += 1

    def plan(self, gop: list[av.Packet]) -> int:
        """Pick the samples among a closed GOP's frames by their packets' pts (as ``take`` would on the
        decoded frames) and return how many of its packets, in decode order, must be decoded."""
        pts = [int(p.pts) for p in gop if p.pts is not None]
        if self.zero is None:
            self.zero = min(pts) * self.time_base
        self.planned_until = max(pts)
        picked = {p for p in sorted(pts) if self.take(self.ts(p))}
        self.wanted |= picked
        if self.ts(max(pts)) > self.limits.max_duration_s:
            # Decoded whole, the GOP raises at its first frame over the limit, as a full decode would.
            self.wanted |= {p for p in pts if self.ts(p) > self.limits.max_duration_s}
            return len(gop)
        return 1 + max((i for i, p in enumerate(gop) if p.pts in picked), default=-1)


def _gops(packets: Iterator[av.Packet]) -> Iterator[list[av.Packet]]:
    """Group demuxed packets into GOPs, each starting at a keyframe (the first may not)."""
    gop: list[av.Packet] = []
    for packet in packets:
        # The demuxer ends a stream with an empty packet.
        if packet.size == 0:
            continue
        if packet.is_keyframe and gop:
            yield gop
            gop = []
        gop.append(packet)
    if gop:
        yield gop


def _plannable(gop: list[av.Packet], following: list[av.Packet] | None) -> bool:
    """A GOP can be planned from its packets when every packet has a pts, it starts at a keyframe, and
    no frame of the next GOP is presented before that GOP's keyframe (no open GOP: the next GOP's
    leading frames would refer to frames of this one that a plan skips)."""
    if not gop[0].is_keyframe or any(p.pts is None for p in gop):
        return False
    key_pts = gop[0].pts
    assert key_pts is not None
    if min(int(p.pts) for p in gop if p.pts is not None) < key_pts:
        return False
    if following is None:
        return True
    next_key = following[0].pts
    if next_key is None or any(p.pts is None for p in following):
        return False
    # An open next GOP: its leading frames (presented before its keyframe) refer back into this one.
    if min(int(p.pts) for p in following if p.pts is not None) < next_key:
        return False
    return max(int(p.pts) for p in gop if p.pts is not None) < next_key


def _decode_sampled(
    ctx: av.VideoCodecContext, packets: Iterator[av.Packet], sampler: _Sampler
) -> Iterator[SampledFrame]:
    skip_nonref = ctx.name in _NONREF_SKIP_CODECS
    gops = _gops(packets)
    planning = True
    current = next(gops, None)
    while current is not None:
        following = next(gops, None)
        planning = planning and _plannable(current, following)
        sampler.stats.packets += len(current)
        if planning:
            needed = sampler.plan(current)
            sampler.stats.gops_planned += needed > 0
            sampler.stats.gops_skipped += needed == 0
            if needed == 0:
                sampler.check_time(sampler.last_ts)
            for packet in current[:needed]:
                # Frames no one refers to are decoded only when sampled.
                ctx.skip_frame = "NONREF" if skip_nonref and packet.pts not in sampler.wanted else "DEFAULT"
                yield from sampler.frames(ctx.decode(packet))
        else:
            sampler.stats.fell_back = True
            ctx.skip_frame = "DEFAULT"
            for packet in current:
                yield from sampler.frames(ctx.decode(packet))
        current = following
    ctx.skip_frame = "DEFAULT"
    yield from sampler.frames(ctx.decode(None))


def open_file(
    path: Path,
    sampling: Sampling,
    limits: DecodeLimits,
    max_side: int,
    strategy: DecodeStrategy,
    threads: int,
    stats: DecodeStats,
) -> tuple[VideoInfo, Generator[SampledFrame, None, None]]:
    """``pipeline.media.decode.open_sampled``, in this thread: the file is opened once; its stream facts
    are checked here (raising what ``probe_file`` raises) and the frames come from the generator,
    which holds the file open until it ends or is closed."""
    video = _video(path, sampling, limits, max_side, strategy, threads, stats)
    # The generator runs up to its stream facts: open errors are raised here, and closing it closes the file.
    info = next(video)
    assert isinstance(info, VideoInfo)
    return info, cast("Generator[SampledFrame, None, None]", video)


def _video(
    path: Path,
    sampling: Sampling,
    limits: DecodeLimits,
    max_side: int,
    strategy: DecodeStrategy,
    threads: int,
    stats: DecodeStats,
) -> Generator[VideoInfo | SampledFrame, None, None]:
    """The stream facts, then the sampled frames."""
    with open_container(path) as container:
        info, stream, zero = stream_info(container, limits)
        yield info
        stream.thread_type = "AUTO"
        threads = threads or _SPARSE_THREADS.get(strategy, 0)
        if threads:
            stream.codec_context.thread_count = threads
        out_size = scaled_size(info.width, info.height, max_side)
        sampler = _Sampler(sampling, limits, stream.time_base or Fraction(1, 1), zero, out_size, stats)
        try:
            if strategy in (DecodeStrategy.AUTO, DecodeStrategy.SAMPLED):
                yield from _decode_sampled(stream.codec_context, container.demux(stream), sampler)
            else:
                if strategy is DecodeStrategy.KEYFRAMES:
                    stream.codec_context.skip_frame = "NONKEY"
                for packet in container.demux(stream):
                    sampler.stats.packets += packet.size > 0
                    yield from sampler.frames(stream.codec_context.decode(packet))
        except av.error.FFmpegError as exc:
            raise CorruptVideo(f"at {hms(sampler.last_ts)}: {exc.strerror or exc}") from exc
        if sampler.index == 0:
            raise CorruptVideo("no frame could be decoded")
