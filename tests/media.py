"""Test media: the generators live in ``infra.dev.samples`` (the demo and benchmarks use them too)."""

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
    "VIDEO_FORMATS",
    "VideoFormat",
    "expected_sample_count",
    "frame_at",
    "mae",
    "write_audio_only",
    "write_corrupt_mp4",
    "write_large_video",
    "write_no_streams_mp4",
    "write_pixel_bomb",
    "write_still_image",
    "write_timed_video",
    "write_truncated",
    "write_video",
]
