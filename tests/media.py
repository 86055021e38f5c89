"""Test media: the generators live in ``pipeline.samples`` (the demo and benchmarks use them too)."""

from pipeline.samples import (
    VIDEO_FORMATS,
    expected_sample_count,
    frame_at,
    mae,
    write_audio_only,
    write_corrupt_mp4,
    write_truncated,
    write_video,
)

__all__ = [
    "VIDEO_FORMATS",
    "expected_sample_count",
    "frame_at",
    "mae",
    "write_audio_only",
    "write_corrupt_mp4",
    "write_truncated",
    "write_video",
]
