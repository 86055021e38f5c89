"""pipeline/media/decode.py: frame sampling by presentation time, probing, limits and failure reasons."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import av
import numpy as np
import pydantic
import pytest

from infra.dev.samples import write_textured_video
from pipeline.media.decode import (
    DecodeLimits,
    DecodeStats,
    DecodeStrategy,
    SampledFrame,
    VideoInfo,
    open_sampled,
    probe,
    sample_frames,
    span,
)
from storage.errors import CorruptVideo, LimitExceeded, NotAVideo, PermanentError
from storage.sampling import Sampling
from tests.media import (
    MATRIX_FORMATS,
    expected_sample_count,
    frame_at,
    mae,
    mp4_edit_lists,
    write_audio_only,
    write_corrupt_mp4,
    write_late_video,
    write_no_streams_mp4,
    write_pixel_bomb,
    write_still_image,
    write_timed_video,
    write_truncated,
    write_video,
)

#: Decoded frames of the right second are within this mean absolute error of ``frame_at``; frames of
#: another second or seed are around 85 away.
SAME_PICTURE_MAE = 20.0
OTHER_PICTURE_MAE = 40.0
SECONDS = 3.0
SIZE = (160, 120)

#: (suffix, encoder, codec name the probe reports, pixel format): every format of the matrix.
FORMAT_PARAMS = [
    # No skip: the pinned PyAV wheel ships every one of these encoders; losing one must fail.
    pytest.param(f.suffix, f.encoder, f.codec, f.pix_fmt, id=name)
    for name, f in MATRIX_FORMATS.items()
]
FPS = [10, 24, 25, 30]
EVERY_S = [1.0, 0.5, 2.0]

VideoFactory = Callable[..., Path]


@pytest.fixture(scope="module")
def video(tmp_path_factory: pytest.TempPathFactory) -> VideoFactory:
    """Generate a video once per module for each distinct set of ``write_video`` arguments."""
    root = tmp_path_factory.mktemp("videos")
    cache: dict[tuple[object, ...], Path] = {}

    def make(suffix: str = ".mp4", **kwargs: object) -> Path:
        key = (suffix, *sorted(kwargs.items()))
        if key not in cache:
            kwargs.setdefault("seconds", SECONDS)
            cache[key] = write_video(root / f"v{len(cache)}{suffix}", **kwargs)  # type: ignore[arg-type]
        return cache[key]

    return make


def sample(path: Path, every_s: float = 1.0, limits: DecodeLimits | None = None, **kwargs: Any) -> list[SampledFrame]:
    return list(sample_frames(path, Sampling(every_s), limits or DecodeLimits(), **kwargs))


def assert_shows_second(frame: SampledFrame, second: int, seed: int, seconds: float = SECONDS) -> None:
    error = mae(frame.rgb, frame_at(second, seed, SIZE))
    assert error < SAME_PICTURE_MAE, f"frame at {frame.ts_s}s is not second {second} (MAE {error:.1f})"
    for other in range(math.ceil(seconds)):
        if other != second:
            assert mae(frame.rgb, frame_at(other, seed, SIZE)) > OTHER_PICTURE_MAE


@pytest.mark.parametrize("every_s", EVERY_S)
@pytest.mark.parametrize("fps", FPS)
@pytest.mark.parametrize(("suffix", "encoder", "codec_name", "pix_fmt"), FORMAT_PARAMS)
def test_samples_one_frame_per_interval_by_presentation_time(
    video: VideoFactory, suffix: str, encoder: str, codec_name: str, pix_fmt: str, fps: int, every_s: float
) -> None:
    seed = fps
    path = video(suffix, codec=encoder, fps=fps, seed=seed, pix_fmt=pix_fmt)

    frames = sample(path, every_s)

    assert len(frames) == math.ceil(SECONDS / every_s) == expected_sample_count(SECONDS, fps, every_s)
    assert [f.index for f in frames] == list(range(len(frames)))
    # Time 0 is the container's start, which is the first frame of these video-only files: also in
    # MPEG-TS/PS, whose clocks start above zero.
    assert frames[0].ts_s == 0.0
    for k, frame in enumerate(frames):
        target = k * every_s
        # The first frame presented at or after the target time.
        assert target - 1e-3 <= frame.ts_s < target + 1 / fps + 1e-3
        assert frame.rgb.shape == (SIZE[1], SIZE[0], 3)
        assert frame.rgb.dtype == np.uint8
        assert_shows_second(frame, math.floor(target), seed)


@pytest.mark.parametrize(
    ("seconds", "every_s", "expected_ts"),
    [
        (2.5, 1.0, [0.0, 1.0, 2.0]),
        (2.5, 2.0, [0.0, 2.0]),
        (2.5, 0.5, [0.0, 0.5, 1.0, 1.5, 2.0]),
        (0.1, 1.0, [0.0]),
    ],
)
def test_partial_last_interval_is_sampled(
    video: VideoFactory, seconds: float, every_s: float, expected_ts: list[float]
) -> None:
    frames = sample(video(seconds=seconds), every_s)

    assert [f.ts_s for f in frames] == expected_ts
    assert len(frames) == math.ceil(seconds / every_s)


@pytest.mark.parametrize(
    ("fps", "every_s", "expected_ts"),
    [
        (1, 0.5, [0.0, 1.0, 2.0]),
        (1, 0.25, [0.0, 1.0, 2.0]),
        (2, 0.25, [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]),
        (3, 0.1, [round(i / 3, 3) for i in range(9)]),
    ],
)
def test_low_fps_video_does_not_repeat_frames(
    video: VideoFactory, fps: int, every_s: float, expected_ts: list[float]
) -> None:
    frames = sample(video(fps=fps, seed=7), every_s)

    assert [f.ts_s for f in frames] == expected_ts
    assert len(frames) == expected_sample_count(SECONDS, fps, every_s)
    for frame in frames:
        assert_shows_second(frame, math.floor(frame.ts_s + 1e-6), seed=7)


@pytest.mark.parametrize("gop", [1, 7, 300])
def test_keyframe_interval_does_not_change_the_samples(video: VideoFactory, gop: int) -> None:
    frames = sample(video(gop=gop, seed=3), 0.5)

    assert [f.ts_s for f in frames] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    for frame in frames:
        assert_shows_second(frame, math.floor(frame.ts_s), seed=3)


def test_different_seeds_draw_different_videos(video: VideoFactory) -> None:
    (a,) = sample(video(seconds=1, seed=1))
    (b,) = sample(video(seconds=1, seed=2))

    assert mae(a.rgb, frame_at(0, 1, SIZE)) < SAME_PICTURE_MAE
    assert mae(a.rgb, b.rgb) > OTHER_PICTURE_MAE


def test_frames_are_scaled_down_to_max_side(video: VideoFactory) -> None:
    path = video(size=(320, 240), seed=5)

    frames = sample(path, 1.0, max_side=160)

    assert [f.rgb.shape for f in frames] == [(120, 160, 3)] * 3
    # The grid survives the scaling: the picture is frame_at drawn at the smaller size.
    for frame in frames:
        assert_shows_second(frame, math.floor(frame.ts_s), seed=5)


def test_frames_are_never_scaled_up(video: VideoFactory) -> None:
    frames = sample(video(), 1.0, max_side=4096)

    assert {f.rgb.shape for f in frames} == {(120, 160, 3)}


def test_odd_target_size_is_made_even(video: VideoFactory) -> None:
    frames = sample(video(size=(160, 90)), 1.0, max_side=101)

    assert {f.rgb.shape for f in frames} == {(56, 100, 3)}


@pytest.mark.parametrize("every_s", [0.0, -1.0])
def test_every_s_must_be_positive(video: VideoFactory, every_s: float) -> None:
    with pytest.raises(ValueError, match="every_s"):
        sample(video(), every_s)


def test_stopping_early_closes_cleanly(video: VideoFactory) -> None:
    frames = sample_frames(video(), Sampling(0.5), DecodeLimits())
    first = next(frames)
    # Dropping the last reference closes the generator mid-decode: its with-block closes the container.
    del frames

    assert first.ts_s == 0.0


@pytest.mark.parametrize(("suffix", "encoder", "codec_name", "pix_fmt"), FORMAT_PARAMS)
def test_probe_reads_stream_facts(
    video: VideoFactory, suffix: str, encoder: str, codec_name: str, pix_fmt: str
) -> None:
    info = probe(video(suffix, codec=encoder, fps=25, seed=25, pix_fmt=pix_fmt), DecodeLimits())

    # The codec, not the decoder FFmpeg picked (AV1 decodes with libdav1d).
    assert (info.width, info.height, info.codec) == (160, 120, codec_name)
    assert info.fps == pytest.approx(25.0)
    # MPEG program streams (.mpg) report the last frame's start, one frame short.
    assert info.duration_s == pytest.approx(SECONDS, abs=0.1)


@pytest.mark.parametrize("isolated", [True, False], ids=["worker", "in-process"])
def test_open_sampled_gives_the_probe_and_the_frames(video: VideoFactory, isolated: bool) -> None:
    path = video(".mkv", fps=25, seed=7)

    info, frames = open_sampled(path, Sampling(0.5), DecodeLimits(), isolated=isolated)

    assert info == probe(path, DecodeLimits())
    got, expected = list(frames), sample(path, 0.5)
    assert [(f.index, f.ts_s) for f in got] == [(f.index, f.ts_s) for f in expected]
    assert all(mae(a.rgb, b.rgb) == 0.0 for a, b in zip(got, expected, strict=True))


def test_open_sampled_opens_the_file_once(video: VideoFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    path = video(fps=25, seed=8)
    opened: list[str] = []
    real_open = av.open

    def counting_open(file: str, *args: Any, **kwargs: Any) -> Any:
        opened.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(av, "open", counting_open)
    info, frames = open_sampled(path, Sampling(1.0), DecodeLimits(), isolated=False)
    assert len(list(frames)) == 3

    assert opened == [str(path)]
    assert info.duration_s == pytest.approx(SECONDS, abs=0.1)


@pytest.mark.parametrize("isolated", [True, False], ids=["worker", "in-process"])
def test_open_sampled_raises_what_probe_raises_before_any_frame(
    video: VideoFactory, tmp_path: Path, isolated: bool
) -> None:
    text = tmp_path / "notes.mp4"
    text.write_text("not a video\n")
    limits = DecodeLimits(max_duration_s=2.0)

    with pytest.raises(NotAVideo) as not_a_video:
        open_sampled(text, Sampling(1.0), DecodeLimits(), isolated=isolated)
    with pytest.raises(LimitExceeded) as too_long:
        open_sampled(video(), Sampling(1.0), limits, isolated=isolated)
    with pytest.raises(LimitExceeded) as probed:
        probe(video(), limits, isolated=isolated)

    assert not_a_video.value.reason == "not a video: a text file"
    assert too_long.value.reason == probed.value.reason == "exceeds max duration 2s (video is 3s)"


# Odd but valid videos.


@pytest.mark.parametrize("rotation", [90, -90, 180, 270])
def test_rotated_video_yields_upright_frames(tmp_path: Path, rotation: int) -> None:
    # A phone held upright: pictures stored turned, with a display matrix that turns them back.
    upright = (120, 160)
    path = write_video(tmp_path / f"phone{rotation}.mp4", seconds=2, size=upright, rotation=rotation, seed=11)

    frames = sample(path)

    assert [f.ts_s for f in frames] == [0.0, 1.0]
    for frame in frames:
        assert frame.rgb.shape == (160, 120, 3)
        assert frame.rgb.flags.c_contiguous
        second = int(frame.ts_s)
        assert mae(frame.rgb, frame_at(second, 11, upright)) < SAME_PICTURE_MAE
        # The stored picture, turned back the wrong way, is not the upright one.
        wrong = np.rot90(frame.rgb, k=2)
        assert mae(wrong, frame_at(second, 11, upright)) > OTHER_PICTURE_MAE


def test_rotated_frames_are_scaled_by_their_longer_side(tmp_path: Path) -> None:
    path = write_video(tmp_path / "phone.mov", seconds=1, size=(240, 320), rotation=-90, seed=12)

    (frame,) = sample(path, max_side=160)

    assert frame.rgb.shape == (160, 120, 3)
    assert mae(frame.rgb, frame_at(0, 12, (120, 160))) < SAME_PICTURE_MAE


def test_variable_frame_rate_is_sampled_by_presentation_time(tmp_path: Path) -> None:
    times = [0.0, 0.04, 0.1, 0.5, 0.55, 1.2, 1.25, 1.3, 2.7, 2.9, 3.05]
    path = write_timed_video(tmp_path / "vfr.mp4", times, seed=13)

    frames = sample(path, 1.0)

    # The first frame presented at or after 0, 1, 2 and 3 s.
    assert [f.ts_s for f in frames] == [0.0, 1.2, 2.7, 3.05]
    for frame in frames:
        assert_shows_second(frame, math.floor(frame.ts_s), seed=13, seconds=4)


def test_one_frame_video_yields_one_sample(tmp_path: Path) -> None:
    path = write_video(tmp_path / "one.mp4", seconds=0.1, fps=10, seed=14)

    frames = sample(path, 1.0)

    assert [f.ts_s for f in frames] == [0.0]
    assert mae(frames[0].rgb, frame_at(0, 14, SIZE)) < SAME_PICTURE_MAE


def test_long_low_fps_video_within_limits(tmp_path: Path) -> None:
    # Ten minutes, one frame every 10 s: 60 frames, 60 samples at 1 s (never a frame twice).
    path = write_timed_video(tmp_path / "timelapse.mp4", [10.0 * i for i in range(60)], seed=15)

    assert probe(path, DecodeLimits(max_duration_s=600)).duration_s == pytest.approx(590, abs=1)
    frames = sample(path, 1.0, DecodeLimits(max_duration_s=600, max_frames=60))

    assert [f.ts_s for f in frames] == [10.0 * i for i in range(60)]
    assert mae(frames[-1].rgb, frame_at(590, 15, SIZE)) < SAME_PICTURE_MAE


@pytest.mark.parametrize(
    "kwargs",
    [{"times_s": []}, {"times_s": [0.0, 1.0, 1.0]}, {"times_s": [1.0, 0.5]}],
)
def test_timed_video_needs_increasing_times(tmp_path: Path, kwargs: dict[str, list[float]]) -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        write_timed_video(tmp_path / "x.mp4", kwargs["times_s"])


def test_rotation_must_be_a_quarter_turn(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 90"):
        write_video(tmp_path / "x.mp4", seconds=1, rotation=45)


def test_probe_of_a_streamed_file_has_no_duration(tmp_path: Path) -> None:
    path = write_video(tmp_path / "live.mkv", seconds=2, seekable=False)

    assert probe(path, DecodeLimits()) == VideoInfo(
        duration_s=None, width=160, height=120, codec="h264", fps=10.0, audio_tracks=0, subtitle_tracks=0
    )
    assert [f.ts_s for f in sample(path)] == [0.0, 1.0]


def test_the_stream_facts_from_the_decode_worker_count_the_audio_and_subtitle_tracks(tmp_path: Path) -> None:
    from infra.dev.textclips import Cue, Line, spoken_clip, subtitled_clip

    subtitled = subtitled_clip(tmp_path / "sub", [Cue(0.5, 1.5, "a red boat")], 2, fmt="mov_text")
    spoken = spoken_clip(tmp_path / "said.mp4", [Line(0.2, "a red boat", "slt")], 2)
    assert (probe(subtitled, DecodeLimits()).audio_tracks, probe(subtitled, DecodeLimits()).subtitle_tracks) == (0, 1)
    assert (probe(spoken, DecodeLimits()).audio_tracks, probe(spoken, DecodeLimits()).subtitle_tracks) == (1, 0)


# Times on the player's timeline: counted from the container's start, not from the first video frame.


@pytest.mark.parametrize("suffix", [".mp4", ".mov", ".mkv"])
def test_video_that_starts_after_its_audio_is_timed_from_the_container_start(tmp_path: Path, suffix: str) -> None:
    # Sound from 0 s, pictures from 1.5 s: a player shows the first picture at 1.5 s.
    path = write_late_video(tmp_path / f"late{suffix}", video_start_s=1.5, seed=21)

    for strategy in (DecodeStrategy.AUTO, DecodeStrategy.SEQUENTIAL):
        frames = sample(path, 1.0, strategy=strategy)

        # Targets 0 and 1 s both get the first picture; then the one shown at 2, 3 and 4 s.
        assert [f.ts_s for f in frames] == [1.5, 2.0, 3.0, 4.0]
        for frame in frames:
            # Drawn for the second the player shows it in.
            assert_shows_second(frame, math.floor(frame.ts_s), seed=21, seconds=5)


def test_late_video_in_mp4_is_timed_by_its_edit_list(tmp_path: Path) -> None:
    path = write_late_video(tmp_path / "late.mp4", video_start_s=2.25, seed=22)

    # The movie timeline players follow: the sound from its start, the video after an empty edit.
    edits = mp4_edit_lists(path)
    assert [media is None for _, media in edits["soun"]] == [False]
    assert edits["vide"][0] == (2.25, None)
    assert sample(path)[0].ts_s == 2.25


@pytest.mark.parametrize(
    ("clock_s", "video_start_s", "expected_ts"),
    [
        # What ffmpeg's own muxer writes: the clock starts at 1.4 s.
        (1.4, 0.0, [0.0, 1.0, 2.0]),
        (1.4, 1.5, [1.5, 2.0, 3.0, 4.0]),
        # Any clock (a recording off a broadcast), and a start between frames.
        (1000.0, 2.25, [2.25, 3.05, 4.05, 5.05]),
        # The 33-bit 90 kHz clock wraps to 0 two seconds into the file.
        (2**33 / 90_000 - 2.0, 1.5, [1.5, 2.0, 3.0, 4.0]),
    ],
    ids=["ffmpeg-clock", "video-late", "any-clock", "clock-wraps"],
)
def test_mpeg_ts_is_timed_from_its_earliest_stream(
    tmp_path: Path, clock_s: float, video_start_s: float, expected_ts: list[float]
) -> None:
    # Players of MPEG-TS (hls.js over MSE: its initPTS) start the timeline at the first timestamp
    # of the audio and video streams; here the audio's, stamped at exactly ``clock_s``.
    path = write_late_video(tmp_path / "late.ts", video_start_s=video_start_s, clock_s=clock_s, seed=23)

    for strategy in (DecodeStrategy.AUTO, DecodeStrategy.SEQUENTIAL):
        frames = sample(path, 1.0, strategy=strategy)

        assert [f.ts_s for f in frames] == expected_ts
        for frame in frames:
            assert_shows_second(frame, math.floor(frame.ts_s), seed=23, seconds=6)


@pytest.mark.parametrize("suffix", [".mp4", ".mkv", ".ts"])
def test_duration_is_measured_on_the_timeline(tmp_path: Path, suffix: str) -> None:
    # One second of sound, then 3 s of pictures from 1.5 s: the video ends at 4.5 s.
    clock_s = 1.4 if suffix == ".ts" else 0.0
    path = write_late_video(tmp_path / f"late{suffix}", video_start_s=1.5, audio_s=1.0, clock_s=clock_s)

    info = probe(path, DecodeLimits())
    frames = sample(path, 0.5)

    assert info.duration_s == pytest.approx(4.5, abs=0.05)
    assert frames[-1].ts_s <= info.duration_s


def test_sampling_targets_are_on_the_timeline(tmp_path: Path) -> None:
    # A frame every 0.1 s from 1.5 s: at 0.4 s sampling, the frames for 1.6, 2.0, 2.4, ... (not 1.9, 2.3).
    path = write_late_video(tmp_path / "late.mp4", video_start_s=1.5, video_s=1.5)

    assert [f.ts_s for f in sample(path, 0.4)] == [1.5, 1.6, 2.0, 2.4, 2.8]


# Inputs that aren't (whole) videos.


@pytest.mark.parametrize("suffix", [".m4a", ".mp4", ".mkv", ".wav"])
def test_audio_only_is_not_a_video(tmp_path: Path, suffix: str) -> None:
    path = write_audio_only(tmp_path / f"tone{suffix}")

    with pytest.raises(NotAVideo) as info:
        sample(path)
    with pytest.raises(NotAVideo):
        probe(path, DecodeLimits())

    assert info.value.reason == f"not a video: audio only ({'pcm_s16le' if suffix == '.wav' else 'aac'})"


def test_zero_byte_file_is_corrupt_with_a_readable_reason(tmp_path: Path) -> None:
    path = tmp_path / "empty.mp4"
    path.write_bytes(b"")

    with pytest.raises(CorruptVideo) as info:
        sample(path)
    with pytest.raises(CorruptVideo):
        probe(path, DecodeLimits())

    assert info.value.reason == "decode error: empty file (0 bytes)"


def test_mp4_header_then_garbage_is_corrupt(tmp_path: Path) -> None:
    path = write_corrupt_mp4(tmp_path / "corrupt.mp4")

    with pytest.raises(CorruptVideo) as info:
        sample(path)

    assert info.value.reason.startswith("decode error: unreadable container: ")
    assert info.value.__cause__ is not None


def test_truncated_mp4_without_its_index_is_corrupt(video: VideoFactory, tmp_path: Path) -> None:
    # The MP4 muxer writes the moov index last, so a cut-off upload has no index at all.
    path = write_truncated(video(), tmp_path / "cut.mp4", keep_fraction=0.5)

    with pytest.raises(CorruptVideo):
        sample(path)


# FFmpeg fails on some texts and takes others for audio (the second opens as AMR).
@pytest.mark.parametrize("text", ["these are not the frames you are looking for\n", "grüße, 日本語\t\r\n" * 400])
def test_text_with_a_video_suffix_is_not_a_video(tmp_path: Path, text: str) -> None:
    path = tmp_path / "notes.mp4"
    path.write_text(text, encoding="utf-8")

    with pytest.raises(NotAVideo) as info:
        probe(path, DecodeLimits())
    with pytest.raises(NotAVideo):
        sample(path)

    assert info.value.reason == "not a video: a text file"


@pytest.mark.parametrize(("image_format", "name"), [("PNG", "png"), ("JPEG", "jpeg"), ("BMP", "bmp")])
def test_image_with_a_video_suffix_is_not_a_video(tmp_path: Path, image_format: str, name: str) -> None:
    path = write_still_image(tmp_path / "photo.mp4", image_format=image_format)

    with pytest.raises(NotAVideo) as info:
        sample(path)

    assert info.value.reason == f"not a video: a still image ({name})"


def test_mp4_without_streams_is_not_a_video(tmp_path: Path) -> None:
    path = write_no_streams_mp4(tmp_path / "empty.mp4")

    with pytest.raises(NotAVideo) as info:
        sample(path)

    assert info.value.reason == "not a video: no video stream"


@pytest.mark.parametrize("suffix", [".mkv", ".ts"])
def test_truncated_stream_container_yields_what_it_has(video: VideoFactory, tmp_path: Path, suffix: str) -> None:
    # Streaming containers carry no trailing index: a cut-off file decodes up to where it ends.
    source = video(suffix, codec="libx264" if suffix == ".mkv" else "mpeg2video")
    path = write_truncated(source, tmp_path / f"cut{suffix}", keep_fraction=0.6)

    frames = sample(path)

    assert 1 <= len(frames) < 3
    assert_shows_second(frames[0], 0, seed=0)


# Limits: each violation raises LimitExceeded naming its limit.


def test_max_pixels(video: VideoFactory) -> None:
    path = video()

    with pytest.raises(LimitExceeded) as info:
        sample(path, limits=DecodeLimits(max_pixels=160 * 120 - 1))
    with pytest.raises(LimitExceeded, match="max pixels"):
        probe(path, DecodeLimits(max_pixels=160 * 120 - 1))

    assert info.value.reason == "frame 160x120 exceeds max pixels per frame 19199"
    assert isinstance(info.value, PermanentError)
    assert len(sample(path, limits=DecodeLimits(max_pixels=160 * 120))) == 3


def test_decompression_bomb_is_refused_from_its_stream_parameters(tmp_path: Path) -> None:
    # 200 kB on disk, 64 Mpixels a frame: refused by the default limit (8K UHD) without decoding.
    path = write_pixel_bomb(tmp_path / "bomb.mp4")
    assert path.stat().st_size < 1_000_000

    with pytest.raises(LimitExceeded) as info:
        probe(path, DecodeLimits())
    frames = sample_frames(path, Sampling(1.0), DecodeLimits())
    with pytest.raises(LimitExceeded) as sampled:
        next(frames)

    assert info.value.reason == sampled.value.reason == "frame 8000x8000 exceeds max pixels per frame 33177600"


def test_max_duration_from_the_container(video: VideoFactory) -> None:
    path = video()

    with pytest.raises(LimitExceeded) as info:
        sample(path, limits=DecodeLimits(max_duration_s=2.0))
    with pytest.raises(LimitExceeded, match="max duration"):
        probe(path, DecodeLimits(max_duration_s=2.0))

    assert info.value.reason == "exceeds max duration 2s (video is 3s)"
    assert len(sample(path, limits=DecodeLimits(max_duration_s=3.0))) == 3


def test_max_duration_while_decoding_a_stream_without_duration(tmp_path: Path) -> None:
    path = write_video(tmp_path / "live.mkv", seconds=SECONDS, seekable=False)
    frames = sample_frames(path, Sampling(1.0), DecodeLimits(max_duration_s=1.5))

    assert [next(frames).ts_s, next(frames).ts_s] == [0.0, 1.0]
    with pytest.raises(LimitExceeded, match=r"^exceeds max duration 1\.5s \(a frame at 1\.6s\)$"):
        next(frames)


def test_max_frames(video: VideoFactory) -> None:
    path = video()
    frames = sample_frames(path, Sampling(1.0), DecodeLimits(max_frames=2))

    assert [next(frames).index, next(frames).index] == [0, 1]
    with pytest.raises(LimitExceeded, match=r"^exceeds max frames per video 2 \(at 00:00:02\)$"):
        next(frames)
    assert len(sample(path, limits=DecodeLimits(max_frames=3))) == 3


def test_max_frames_counts_samples_not_decoded_frames(video: VideoFactory) -> None:
    # 30 decoded frames, 3 samples.
    assert len(sample(video(fps=10), 1.0, DecodeLimits(max_frames=3))) == 3


@pytest.mark.parametrize("isolated", [True, False], ids=["in-a-worker", "in-this-thread"])
def test_max_decode_time(video: VideoFactory, isolated: bool) -> None:
    # Checked at each frame: the frame it reached is named (a stuck worker is killed: test_decode_worker).
    with pytest.raises(LimitExceeded, match=r"^exceeds max decode time 0s \([0-9.]+s to reach 00:00:00\)$"):
        sample(video(), limits=DecodeLimits(max_decode_s=1e-9), isolated=isolated)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.04, "0s"), (2.5, "2.5s"), (59.96, "60s"), (150, "2m30s"), (600, "10m"), (4 * 3600, "4h"), (18_120, "5h02m")],
)
def test_span_reads_like_a_person_wrote_it(seconds: float, text: str) -> None:
    assert span(seconds) == text


@pytest.mark.parametrize("field", ["max_duration_s", "max_pixels", "max_frames", "max_decode_s"])
def test_limits_must_be_positive(field: str) -> None:
    with pytest.raises(pydantic.ValidationError):
        DecodeLimits(**{field: 0})


# The sampled decoder (decode only the GOPs and frames that hold a sample) against a full decode.

#: Frame rate of the textured videos: 15 frames a second keep each a handful of GOPs small and quick.
TEXTURED_FPS = 15
TEXTURED_SIZE = (96, 64)


def textured(root: Path, name: str, **kwargs: object) -> Path:
    kwargs.setdefault("seconds", 4.0)
    kwargs.setdefault("fps", TEXTURED_FPS)
    kwargs.setdefault("size", TEXTURED_SIZE)
    return write_textured_video(root / name, **kwargs)  # type: ignore[arg-type]


def assert_same_samples(
    path: Path, every_s: float, limits: DecodeLimits | None = None, max_side: int = 384
) -> tuple[DecodeStats, DecodeStats]:
    """The sampled decoder yields the frames of a full decode: same indices, times and pixels."""
    full_stats, sampled_stats = DecodeStats(), DecodeStats()
    full = sample(path, every_s, limits, max_side=max_side, strategy=DecodeStrategy.SEQUENTIAL, stats=full_stats)
    sampled = sample(path, every_s, limits, max_side=max_side, strategy=DecodeStrategy.AUTO, stats=sampled_stats)

    assert [(f.index, f.ts_s) for f in sampled] == [(f.index, f.ts_s) for f in full]
    for a, b in zip(sampled, full, strict=True):
        assert a.rgb.shape == b.rgb.shape
        assert mae(a.rgb, b.rgb) == 0.0, f"frame at {a.ts_s}s differs"
    assert sampled_stats.frames_decoded <= full_stats.frames_decoded
    return full_stats, sampled_stats


def test_textured_frames_differ_from_their_neighbours(tmp_path: Path) -> None:
    # Otherwise the comparisons below couldn't tell a neighbouring frame from the right one.
    frames = sample(textured(tmp_path, "t.mp4", seconds=1.0), 1 / TEXTURED_FPS)

    assert len(frames) == TEXTURED_FPS
    assert min(mae(a.rgb, b.rgb) for a, b in itertools.pairwise(frames)) > 5


@pytest.mark.parametrize("every_s", [0.2, 1.0, 2.5])
@pytest.mark.parametrize("gop_s", [1 / TEXTURED_FPS, 0.4, 1.0, 3.0])
def test_sampled_decode_matches_full_decode(
    tmp_path_factory: pytest.TempPathFactory, gop_s: float, every_s: float
) -> None:
    root = tmp_path_factory.mktemp("gop")
    path = textured(root, "v.mp4", gop_s=gop_s, seed=round(gop_s * 100))

    full, sampled = assert_same_samples(path, every_s)

    assert not sampled.fell_back
    if every_s > gop_s:
        # Sparser samples than keyframes: whole GOPs are skipped.
        assert sampled.gops_skipped > 0 or gop_s * TEXTURED_FPS < 2
        assert sampled.frames_decoded < full.frames_decoded


@pytest.mark.parametrize("fps", [10, 24, 30])
def test_sampled_decode_skips_most_frames_at_one_per_second(tmp_path: Path, fps: int) -> None:
    path = textured(tmp_path, "v.mp4", fps=fps, gop_s=2.0, seconds=6.0)

    full, sampled = assert_same_samples(path, 1.0)

    # Two samples a GOP: the first half of each GOP, less its unreferenced B-frames, is decoded.
    assert full.frames_decoded == 6 * fps
    assert sampled.frames_decoded < 0.6 * full.frames_decoded


@pytest.mark.parametrize(
    ("suffix", "codec", "x265_params", "planned"),
    [
        (".mkv", "libx264", None, True),
        (".ts", "libx264", None, True),
        (".webm", "libvpx-vp9", None, True),
        (".mkv", "libx265", "open-gop=0", True),
        # x265 writes open GOPs by default (leading pictures refer back): decoded in full.
        (".mkv", "libx265", "", False),
    ],
)
def test_sampled_decode_of_a_stream_without_index(
    tmp_path: Path, suffix: str, codec: str, x265_params: str | None, planned: bool
) -> None:
    # Written through a pipe: no duration, no cues; the plan needs only the packets as they come.
    options = None if x265_params is None else {"preset": "ultrafast", "x265-params": f"log-level=error:{x265_params}"}
    path = textured(tmp_path, f"live{suffix}", codec=codec, gop_s=1.0, seekable=False, options=options)

    _, sampled = assert_same_samples(path, 1.5)

    assert (sampled.gops_skipped > 0) is planned
    assert sampled.fell_back is not planned


def test_sampled_decode_of_variable_frame_rate(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    times = np.cumsum(rng.uniform(0.01, 0.3, size=60)).round(3)
    path = textured(tmp_path, "vfr.mp4", times_s=[0.0, *times.tolist()], gop_s=0.5)

    for every_s in (0.25, 1.0, 3.0):
        assert_same_samples(path, every_s)


def test_open_gops_fall_back_to_a_full_decode(tmp_path: Path) -> None:
    # MPEG-2 with B-frames: each GOP's first B-frames are shown before its keyframe and refer back.
    path = textured(tmp_path, "open.ts", codec="mpeg2video", gop_s=1.0, options={"bf": "2"})

    _, sampled = assert_same_samples(path, 2.0)

    assert sampled.fell_back


def test_rotated_video_sampled_like_a_full_decode(tmp_path: Path) -> None:
    path = write_video(tmp_path / "phone.mp4", seconds=4, size=(64, 96), rotation=90, gop=5, seed=16)

    assert_same_samples(path, 1.5, max_side=48)


@pytest.mark.parametrize(
    "limits",
    [DecodeLimits(max_frames=2), DecodeLimits(max_duration_s=2.5), DecodeLimits(max_pixels=10)],
    ids=["frames", "duration", "pixels"],
)
def test_sampled_decode_keeps_the_limits(tmp_path: Path, limits: DecodeLimits) -> None:
    path = textured(tmp_path, "live.mkv", gop_s=0.5, seekable=False)

    def outcome(strategy: DecodeStrategy) -> tuple[list[float], str]:
        got: list[float] = []
        with pytest.raises(LimitExceeded) as info:
            for frame in sample_frames(path, Sampling(1.0), limits, strategy=strategy):
                got.append(frame.ts_s)
        return got, info.value.reason

    assert outcome(DecodeStrategy.AUTO) == outcome(DecodeStrategy.SEQUENTIAL)


def test_keyframes_strategy_yields_keyframes_only(tmp_path: Path) -> None:
    path = textured(tmp_path, "v.mp4", gop_s=2.0, seconds=6.0)

    frames = sample(path, 1.0, strategy=DecodeStrategy.KEYFRAMES)

    # One sample a GOP: the keyframes at 0, 2 and 4 s.
    assert [f.ts_s for f in frames] == [0.0, 2.0, 4.0]
    exact = {f.ts_s: f for f in sample(path, 1.0)}
    assert all(mae(f.rgb, exact[f.ts_s].rgb) == 0.0 for f in frames)
