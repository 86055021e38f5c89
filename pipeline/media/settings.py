"""What decoding may do: its limits and strategy, as settings (no PyAV here: the settings import this)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field


class DecodeLimits(BaseModel):
    """Bounds on one video's decode; each violation names itself in the failure reason."""

    #: Longest video, by container duration or by the presentation time of any decoded frame.
    max_duration_s: float = Field(default=4 * 3600.0, gt=0)
    #: Largest picture (width x height; 8K UHD by default), checked from the stream parameters
    #: before any frame is decoded (decompression bombs) and again for every decoded frame.
    max_pixels: int = Field(default=7680 * 4320, gt=0)
    #: Most sampled frames per video (rows written), not decoded frames.
    max_frames: int = Field(default=20_000, gt=0)
    #: Longest wall time spent decoding one video (time the consumer holds a frame is not counted);
    #: a decode that overruns it, even inside one FFmpeg call, is abandoned (its worker process killed).
    max_decode_s: float = Field(default=1800.0, gt=0)


class DecodeStrategy(StrEnum):
    """How ``sample_frames`` decodes; every strategy but ``keyframes`` yields the same frames."""

    #: ``sampled`` unless the stream's packets can't be planned from (no pts, open GOPs), then ``sequential``.
    AUTO = "auto"
    #: Decode every frame; convert only the sampled ones.
    SEQUENTIAL = "sequential"
    #: Demux every packet but decode only the GOPs that hold a sample, each only up to its last sample,
    #: skipping unsampled non-reference frames (H.264, HEVC). Falls back to ``sequential`` where the
    #: packets don't allow a plan.
    SAMPLED = "sampled"
    #: Approximate: decode keyframes only; each sample is the first keyframe at or after its target
    #: (fewer samples when keyframes are further apart than ``every_s``).
    KEYFRAMES = "keyframes"
