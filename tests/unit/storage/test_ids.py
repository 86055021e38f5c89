"""storage/ids.py: video ids, frame ids, S3 URIs and index fingerprints."""

from __future__ import annotations

import hashlib
import re

import pytest

from storage.errors import InvalidInput, PermanentError
from storage.ids import fingerprint, frame_id, parse_s3_uri, s3_uri, video_id
from storage.sampling import Sampling, SamplingStrategy

BUCKETS = ["videos", "archive"]


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3://videos/a.mp4", ("videos", "a.mp4")),
        ("s3://archive/a.mp4", ("archive", "a.mp4")),
        ("s3://videos/2026/02/12/cam-01/part 1/clip.mkv", ("videos", "2026/02/12/cam-01/part 1/clip.mkv")),
        ("s3://videos/" + "d/" * 200 + "x.mp4", ("videos", "d/" * 200 + "x.mp4")),
        ("s3://videos/日本/動画 🎬.mp4", ("videos", "日本/動画 🎬.mp4")),
        ("s3://videos/café+1 100%.mp4", ("videos", "café+1 100%.mp4")),
        ("s3://videos/a..b.mp4", ("videos", "a..b.mp4")),
        ("s3://videos/.hidden/...mp4", ("videos", ".hidden/...mp4")),
        ("s3://videos/trailing/", ("videos", "trailing/")),
        ("s3://videos/%C3%A9t%C3%A9.mp4", ("videos", "%C3%A9t%C3%A9.mp4")),
        ("s3://videos/bad %ff utf8.mp4", ("videos", "bad %ff utf8.mp4")),
        ("s3://videos/a%2e.mp4", ("videos", "a%2e.mp4")),
    ],
)
def test_accepts_objects_in_configured_buckets(uri: str, expected: tuple[str, str]) -> None:
    assert parse_s3_uri(uri, BUCKETS) == expected


def test_round_trips_with_s3_uri() -> None:
    key = "deep/prefix/日本 clip+1.mp4"

    assert parse_s3_uri(s3_uri("videos", key), BUCKETS) == ("videos", key)


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("http://videos/a.mp4", "only s3://"),
        ("https://minio:9000/videos/a.mp4", "only s3://"),
        ("S3://videos/a.mp4", "only s3://"),
        ("/videos/a.mp4", "only s3://"),
        ("videos/a.mp4", "only s3://"),
        ("", "only s3://"),
        ("s3://", "needs a bucket and a key"),
        ("s3://videos", "needs a bucket and a key"),
        ("s3://videos/", "needs a bucket and a key"),
        ("s3:///a.mp4", "needs a bucket and a key"),
        ("s3://other/a.mp4", "not one of the configured buckets"),
        ("s3://Videos/a.mp4", "not one of the configured buckets"),
        ("s3://vidx-index/lancedb/frames.lance", "not one of the configured buckets"),
        ("s3://videos/../archive/a.mp4", r"'\.' or '\.\.'"),
        ("s3://videos/a/../../b.mp4", r"'\.' or '\.\.'"),
        ("s3://videos/a/..", r"'\.' or '\.\.'"),
        ("s3://videos/./a.mp4", r"'\.' or '\.\.'"),
        ("s3://videos/a/%2E%2E/b.mp4", r"'\.' or '\.\.'"),
        ("s3://videos//etc/passwd", "start with '/'"),
        ("s3://videos/a//b.mp4", "contain '//'"),
        ("s3://videos/a/%2e%2e/b.mp4", r"'\.' or '\.\.'"),
        ("s3://videos/a/%252e%252e/b.mp4", r"'\.' or '\.\.'"),
        ("s3://videos/a/.%2E/b.mp4", r"'\.' or '\.\.'"),
        ("s3://videos/a/\uff0e\uff0e/b.mp4", r"'\.' or '\.\.'"),
        ("s3://videos/..", r"'\.' or '\.\.'"),
        ("s3://videos/a%2F..%2Fb.mp4", "percent-encoded"),
        ("s3://videos/a%2fb.mp4", "percent-encoded"),
        ("s3://videos/a%5C..%5Cb.mp4", "percent-encoded"),
        ("s3://videos/a%00.mp4", "percent-encoded"),
        ("s3://videos/a%252Fb.mp4", "percent-encoded"),
        ("s3://videos/a/%25252e%25252e/b.mp4", r"'\.' or '\.\.'"),
        ("s3://videos/..\\..\\etc\\passwd", "backslashes"),
        ("s3://videos/a\\b.mp4", "backslashes"),
        ("s3://videos/a\x00.mp4", "control characters"),
        ("s3://videos/a\n.mp4", "control characters"),
        ("s3://videos/a\x7f.mp4", "control characters"),
        ("s3://videos/a%0a.mp4", "control characters"),
        ("s3://videos/a\ud800.mp4", "control characters"),
        ("s3://videos/" + "k" * 1025, "longer than 1024 bytes"),
        ("s3://videos/" + "é" * 513, "longer than 1024 bytes"),
    ],
)
def test_rejects_what_is_not_a_configured_object(uri: str, message: str) -> None:
    with pytest.raises(InvalidInput, match=message) as info:
        parse_s3_uri(uri, BUCKETS)

    assert isinstance(info.value, PermanentError)


def test_key_of_exactly_1024_bytes_is_accepted() -> None:
    assert parse_s3_uri("s3://videos/" + "é" * 512, BUCKETS) == ("videos", "é" * 512)


@pytest.mark.parametrize("uri", [None, 42, b"s3://videos/a.mp4"])
def test_non_strings_are_invalid(uri: object) -> None:
    with pytest.raises(InvalidInput):
        parse_s3_uri(uri, BUCKETS)  # type: ignore[arg-type]


def test_no_configured_buckets_accepts_nothing() -> None:
    with pytest.raises(InvalidInput):
        parse_s3_uri("s3://videos/a.mp4", [])


def test_video_id_is_stable_and_shaped() -> None:
    vid = video_id("videos", "a.mp4")

    assert vid == video_id("videos", "a.mp4")
    assert re.fullmatch(r"v[0-9a-f]{24}", vid)
    # Pinned: ids are stored in the index, so the derivation must never change silently.
    assert vid == "v" + hashlib.sha256(b"videos\x00a.mp4").hexdigest()[:24]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("videos", "a.mp4"), ("videos", "b.mp4")),
        (("videos", "a.mp4"), ("archive", "a.mp4")),
        (("videos", "a.mp4"), ("videos", "A.mp4")),
        (("videos", "a.mp4"), ("videos", "a.mp4 ")),
        (("videos", "x/a.mp4"), ("videos/x", "a.mp4")),
        (("a", "b/c"), ("a/b", "c")),
        (("videos", "café.mp4"), ("videos", "cafe\u0301.mp4")),
    ],
)
def test_video_ids_are_distinct(a: tuple[str, str], b: tuple[str, str]) -> None:
    assert video_id(*a) != video_id(*b)


def test_many_video_ids_are_distinct() -> None:
    ids = {video_id("videos", f"clips/{i}.mp4") for i in range(10_000)}

    assert len(ids) == 10_000


def test_frame_id_sorts_by_sample_index() -> None:
    vid = video_id("videos", "a.mp4")
    ids = [frame_id(vid, i) for i in (0, 1, 9, 10, 123, 1_000_000)]

    assert ids[0] == f"{vid}-0000000"
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)


def test_fingerprint_depends_on_version_model_and_sampling() -> None:
    base = fingerprint("etag-1", "google/siglip2-base-patch16-224", Sampling(1.0))

    assert base == fingerprint("etag-1", "google/siglip2-base-patch16-224", Sampling(1.0))
    assert re.fullmatch(r"[0-9a-f]{32}", base)
    assert base == fingerprint("etag-1", "google/siglip2-base-patch16-224", Sampling(1))
    others = {
        fingerprint("etag-2", "google/siglip2-base-patch16-224", Sampling(1.0)),
        fingerprint("etag-1", "google/siglip-base-patch16-224", Sampling(1.0)),
        fingerprint("etag-1", "google/siglip2-base-patch16-224", Sampling(0.5)),
    }
    assert base not in others
    assert len(others) == 3


def test_fingerprints_and_labels_are_the_ones_existing_indexes_hold() -> None:
    # Written by every release before the Sampling value: existing rows must keep matching.
    assert fingerprint("etag-1", "google/siglip2-base-patch16-224", Sampling(1.0)) == "454f33a7a6db36d416c35f67e2fe9bf0"
    assert fingerprint("etag-1", "google/siglip2-base-patch16-224", Sampling(0.5)) == "4c767d1f52234fd3e73c43291a9f5753"
    assert (Sampling(1.0).label, Sampling(0.5).label, Sampling(2.5).label) == (
        "every_s=1",
        "every_s=0.5",
        "every_s=2.5",
    )


@pytest.mark.parametrize("every_s", [1.0, 0.5, 0.25, 2.5, 3600.0])
def test_a_sampling_label_parses_back_to_its_sampling(every_s: float) -> None:
    sampling = Sampling(every_s)
    assert Sampling.parse(sampling.label) == sampling
    assert sampling.strategy is SamplingStrategy.INTERVAL


@pytest.mark.parametrize("label", ["every_s", "every_s=0", "every_s=-1", "every_s=x", "scenes=1", ""])
def test_a_label_of_no_known_sampling_is_refused(label: str) -> None:
    with pytest.raises(ValueError):
        Sampling.parse(label)
