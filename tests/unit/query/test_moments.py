"""pipeline/query/moments.py: frame hits -> merged, ranked moments."""

from __future__ import annotations

import random

import pytest

from pipeline.query.moments import FrameHit, Moment, merge_moments
from storage.sampling import Sampling


def hit(ts_s: float, score: float, video: str = "va") -> FrameHit:
    return FrameHit(
        frame_id=f"{video}-{round(ts_s * 1000):07d}",
        video_id=video,
        uri=f"s3://videos/{video}.mp4",
        ts_s=ts_s,
        score=score,
    )


def spans(moments: list[Moment]) -> list[tuple[str, float, float]]:
    return [(m.video_id, m.start_s, m.end_s) for m in moments]


def test_no_hits_no_moments() -> None:
    assert merge_moments([], sampling=Sampling(1.0), k=10, keep_fraction=1.0) == []


def test_single_hit_spans_its_sampling_interval() -> None:
    (moment,) = merge_moments([hit(4.0, 0.3)], sampling=Sampling(1.0), k=10, keep_fraction=1.0)

    assert moment == Moment(
        video_id="va",
        uri="s3://videos/va.mp4",
        start_s=4.0,
        end_s=5.0,
        ts_s=4.0,
        score=0.3,
        frame_id="va-0004000",
    )


def test_adjacent_hits_merge_and_keep_the_best_frame() -> None:
    hits = [hit(2.0, 0.1), hit(3.0, 0.4), hit(4.0, 0.2)]

    (moment,) = merge_moments(hits, sampling=Sampling(1.0), k=10, keep_fraction=1.0)

    assert (moment.start_s, moment.end_s) == (2.0, 5.0)
    assert (moment.ts_s, moment.score, moment.frame_id) == (3.0, 0.4, "va-0003000")


@pytest.mark.parametrize(
    ("every_s", "gap_s", "merged"),
    [
        (1.0, 1.0, True),
        (1.0, 1.5, True),  # one missing sample is bridged
        (1.0, 1.51, False),
        (1.0, 2.0, False),
        (0.5, 0.75, True),
        (0.5, 1.0, False),
        (2.0, 3.0, True),
        (2.0, 4.0, False),
    ],
)
def test_merge_gap_is_one_and_a_half_sampling_intervals(every_s: float, gap_s: float, merged: bool) -> None:
    moments = merge_moments(
        [hit(10.0, 0.5), hit(10.0 + gap_s, 0.4)], sampling=Sampling(every_s), k=10, keep_fraction=1.0
    )

    assert len(moments) == (1 if merged else 2)
    if merged:
        assert (moments[0].start_s, moments[0].end_s) == (10.0, round(10.0 + gap_s + every_s, 3))


def test_chains_merge_transitively() -> None:
    hits = [hit(float(t), 0.1 + t / 100) for t in range(0, 10)]

    (moment,) = merge_moments(hits, sampling=Sampling(1.0), k=10, keep_fraction=1.0)

    assert (moment.start_s, moment.end_s, moment.ts_s) == (0.0, 10.0, 9.0)


def test_input_order_does_not_matter() -> None:
    hits = [hit(t, s) for t, s in [(0.0, 0.2), (1.0, 0.3), (5.0, 0.9), (6.0, 0.1), (20.0, 0.5)]]
    hits += [hit(t, s, video="vb") for t, s in [(0.0, 0.6), (1.0, 0.7)]]
    expected = merge_moments(hits, sampling=Sampling(1.0), k=10, keep_fraction=1.0)

    shuffled = hits[:]
    random.Random(4).shuffle(shuffled)

    assert merge_moments(shuffled, sampling=Sampling(1.0), k=10, keep_fraction=1.0) == expected
    assert merge_moments(iter(shuffled), sampling=Sampling(1.0), k=10, keep_fraction=1.0) == expected


def test_videos_never_merge_with_each_other() -> None:
    hits = [hit(1.0, 0.5, "va"), hit(1.0, 0.4, "vb"), hit(2.0, 0.3, "va")]

    moments = merge_moments(hits, sampling=Sampling(1.0), k=10, keep_fraction=1.0)

    assert spans(moments) == [("va", 1.0, 3.0), ("vb", 1.0, 2.0)]
    assert moments[1].uri == "s3://videos/vb.mp4"


def test_ranked_by_best_score_then_k_best_kept() -> None:
    hits = [hit(0.0, 0.2), hit(10.0, 0.9), hit(20.0, 0.5), hit(30.0, 0.7, "vb")]

    moments = merge_moments(hits, sampling=Sampling(1.0), k=3, keep_fraction=1.0)

    assert [m.score for m in moments] == [0.9, 0.7, 0.5]
    assert spans(moments) == [("va", 10.0, 11.0), ("vb", 30.0, 31.0), ("va", 20.0, 21.0)]


def test_k_zero_gives_nothing() -> None:
    assert merge_moments([hit(0.0, 0.5)], sampling=Sampling(1.0), k=0, keep_fraction=1.0) == []


def test_ties_prefer_earlier_video_then_earlier_time() -> None:
    hits = [hit(40.0, 0.5, "vc"), hit(20.0, 0.5, "va"), hit(0.0, 0.5, "vb"), hit(5.0, 0.5, "va")]

    moments = merge_moments(hits, sampling=Sampling(1.0), k=10, keep_fraction=1.0)

    assert spans(moments) == [("va", 5.0, 6.0), ("va", 20.0, 21.0), ("vb", 0.0, 1.0), ("vc", 40.0, 41.0)]


def test_end_is_rounded_to_milliseconds() -> None:
    (moment,) = merge_moments([hit(0.1, 0.5), hit(0.2, 0.4)], sampling=Sampling(0.1), k=10, keep_fraction=1.0)

    assert moment.end_s == 0.3


def test_weak_frames_do_not_stretch_a_moment() -> None:
    # Given a video whose frames all came back as candidates, but only t = 4..5 match well
    hits = [hit(float(t), 0.95 if t in (4, 5) else 0.40 + 0.01 * t) for t in range(12)]
    hits.append(FrameHit(frame_id="o-1", video_id="other", uri="s3://b/other.mp4", ts_s=1.0, score=0.30))
    # When moments are merged with the default trimming
    moments = merge_moments(hits, sampling=Sampling(1.0), k=10)
    # Then the best moment spans just the well-matching seconds
    assert (moments[0].start_s, moments[0].end_s, moments[0].ts_s) == (4.0, 6.0, 4.0)


# Moments end within their video.


def test_end_never_passes_the_video_duration() -> None:
    hits = [hit(8.0, 0.5), hit(9.0, 0.4)]

    (moment,) = merge_moments(hits, sampling=Sampling(1.0), k=10, keep_fraction=1.0, durations_s={"va": 9.4})

    assert (moment.start_s, moment.end_s, moment.ts_s) == (8.0, 9.4, 8.0)


def test_a_duration_clamps_only_its_own_video() -> None:
    hits = [hit(9.0, 0.5, "va"), hit(9.0, 0.4, "vb"), hit(2.0, 0.3, "va")]

    moments = merge_moments(hits, sampling=Sampling(1.0), k=10, keep_fraction=1.0, durations_s={"va": 9.5})

    assert spans(moments) == [("va", 9.0, 9.5), ("vb", 9.0, 10.0), ("va", 2.0, 3.0)]


def test_a_moment_never_ends_before_its_last_frame() -> None:
    # A recorded duration shorter than the frames' own times is wrong; the frames are what was seen.
    (moment,) = merge_moments(
        [hit(8.0, 0.5), hit(9.0, 0.4)], sampling=Sampling(1.0), k=10, keep_fraction=1.0, durations_s={"va": 8.5}
    )

    assert (moment.start_s, moment.end_s) == (8.0, 9.0)


def test_ends_are_within_the_durations_for_any_hits() -> None:
    rng = random.Random(9)
    durations = {f"v{i}": rng.uniform(1.0, 30.0) for i in range(5)}
    hits = [
        hit(round(rng.uniform(0.0, duration), 3), rng.random(), video)
        for video, duration in durations.items()
        for _ in range(20)
    ]

    for every_s in (0.5, 1.0, 2.0):
        moments = merge_moments(
            hits, sampling=Sampling(every_s), k=100, keep_fraction=rng.random(), durations_s=durations
        )

        assert moments
        assert all(m.start_s <= m.ts_s <= m.end_s <= durations[m.video_id] for m in moments)
