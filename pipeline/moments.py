"""Turn frame hits into moments: adjacent matching frames of one video merged into [start_s, end_s]."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass


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


def merge_moments(hits: Iterable[FrameHit], every_s: float, k: int) -> list[Moment]:
    """Group hits per video, merge runs whose neighbours are at most ``1.5 × every_s`` apart, and
    return the ``k`` best moments by their best frame's score (ties: earlier video id, earlier time).

    A moment spans its frames' sampling intervals: ``end_s`` is the last frame's time plus ``every_s``.
    """
    gap_s = 1.5 * every_s
    by_video: dict[str, list[FrameHit]] = defaultdict(list)
    for hit in hits:
        by_video[hit.video_id].append(hit)
    moments: list[Moment] = []
    for video_hits in by_video.values():
        video_hits.sort(key=lambda h: h.ts_s)
        run: list[FrameHit] = [video_hits[0]]
        for hit in video_hits[1:]:
            if hit.ts_s - run[-1].ts_s <= gap_s:
                run.append(hit)
            else:
                moments.append(_moment(run, every_s))
                run = [hit]
        moments.append(_moment(run, every_s))
    moments.sort(key=lambda m: (-m.score, m.video_id, m.start_s))
    return moments[:k]


def _moment(run: list[FrameHit], every_s: float) -> Moment:
    best = max(run, key=lambda h: h.score)
    return Moment(
        video_id=best.video_id,
        uri=best.uri,
        start_s=run[0].ts_s,
        end_s=round(run[-1].ts_s + every_s, 3),
        ts_s=best.ts_s,
        score=best.score,
        frame_id=best.frame_id,
    )
