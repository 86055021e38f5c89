"""Turn frame hits into moments: adjacent matching frames of one video merged into [start_s, end_s]."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from storage.sampling import Sampling


@dataclass(frozen=True, slots=True)
class FrameHit:
    frame_id: str
    video_id: str
    uri: str
    ts_s: float
    score: float


@dataclass(frozen=True, slots=True)
class Moment:
    video_id: str
    uri: str
    start_s: float
    end_s: float
    #: Time of the best-scoring frame of the moment.
    ts_s: float
    score: float
    #: The best frame, whose thumbnail represents the moment.
    frame_id: str


def merge_moments(
    hits: Iterable[FrameHit],
    sampling: Sampling,
    k: int,
    keep_fraction: float = 0.5,
    durations_s: Mapping[str, float] | None = None,
    sampling_by_video: Mapping[str, Sampling] | None = None,
) -> list[Moment]:
    """Group hits per video, keep each video's frames within ``keep_fraction`` of the way from the
    candidates' lowest score to that video's best, merge runs whose neighbours are at most 1.5 sampling
    intervals apart, and return the ``k`` best moments by their best frame's score (ties: earlier video
    id, earlier time).

    A moment spans its frames' sampling intervals: ``end_s`` is the last frame's time plus the interval,
    but never past the video's duration where ``durations_s`` (by video id) knows it; a moment never
    ends before its last frame either (a duration shorter than the frames' own times is wrong).
    ``sampling_by_video`` holds each video's own sampling where known (else ``sampling``).
    """
    durations_s = durations_s or {}
    samplings = sampling_by_video or {}
    hits = list(hits)
    if not hits:
        return []
    floor = min(h.score for h in hits)
    by_video: dict[str, list[FrameHit]] = defaultdict(list)
    for hit in hits:
        by_video[hit.video_id].append(hit)
    moments: list[Moment] = []
    for vid, video_hits in by_video.items():
        interval = samplings.get(vid, sampling).every_s
        gap_s = 1.5 * interval
        # A moment is where the video is close to its own best match: frames scoring in the lower
        # half between the candidates' floor and this video's peak don't extend it.
        peak = max(h.score for h in video_hits)
        cut = peak - keep_fraction * (peak - floor)
        video_hits = sorted((h for h in video_hits if h.score >= cut), key=lambda h: h.ts_s)
        run: list[FrameHit] = [video_hits[0]]
        for hit in video_hits[1:]:
            if hit.ts_s - run[-1].ts_s <= gap_s:
                run.append(hit)
            else:
                moments.append(_moment(run, interval, durations_s.get(vid)))
                run = [hit]
        moments.append(_moment(run, interval, durations_s.get(vid)))
    moments.sort(key=lambda m: (-m.score, m.video_id, m.start_s))
    return moments[:k]


def _moment(run: list[FrameHit], every_s: float, duration_s: float | None) -> Moment:
    best = max(run, key=lambda h: h.score)
    end_s = round(run[-1].ts_s + every_s, 3)
    if duration_s is not None:
        end_s = max(run[-1].ts_s, min(end_s, duration_s))
    return Moment(
        video_id=best.video_id,
        uri=best.uri,
        start_s=run[0].ts_s,
        end_s=end_s,
        ts_s=best.ts_s,
        score=best.score,
        frame_id=best.frame_id,
    )
